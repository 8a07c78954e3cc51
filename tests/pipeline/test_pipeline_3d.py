"""Encoder-decoder models at tp=2 x pp=2 x dp=2 (8 processes, one process group) against one process.

Spec (issue 37, point 1): ColossalAI's test_shard_t5.py at this layout builds one model after another
from whatever state the previous step left the random generators in (no reseeding), and its second
model trained to loss 11.16 where the unsharded model gives 10.81. The cause: a pipeline stage draws
its own random numbers (tp's per-rank dropout streams draw once per split region the stage runs;
an encoder stage runs other regions than a decoder stage), so after one step the stages' generators
differed, and the next model got other weights on each stage. This module does what that test does:

- every case builds its model from the generators as the previous case's step left them (the first
  from the launch seed), the unsharded reference as a deep copy of it on every rank;
- after every step each rank's CPU generator is in the same state on all 8 ranks;
- T5 and Whisper, 1F1B and interleaved (2 chunks x 2 stages over 2 encoder + 2 decoder layers), and
  BLIP-2 (vision tower, Q-Former, OPT) split [3, 3], fp32: each dp replica's loss and the last
  stage's logits equal the reference on that replica's half of the batch; every gradient this rank
  holds (gathered along its tp split dim, averaged over dp, summed over the stages holding a tied
  weight) equals the reference gradient on the whole batch; every weight after one AdamW step
  equals the reference's, by HF name, and the stages together hold every name;
- T5 in fp16 with ZeRO-1 (fp32 masters partitioned over dp): loss and weights after the step within
  the fp16 tolerance.
And without processes: `generators_in_step` leaves a stage that drew random numbers and one that
drew none in one state, the next step in another, and puts the generators back when a step raises.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.pipeline import split_microbatches
from meshboost.pipeline.generators import generators_in_step
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import gathered
from meshboost.testing.models import tiny_batch, tiny_config

LR, M = 1e-3, 2          # micro-batches per replica (interleaved needs a multiple of pp_size)
INTERLEAVED = {"pp_style": "interleaved", "num_model_chunks": 2}
T5, WHISPER, BLIP2 = "T5ForConditionalGeneration", "WhisperForConditionalGeneration", "Blip2ForConditionalGeneration"
# (family, class, plugin options); the order matters: each model is built after the previous step
CASES = (("t5", T5, {}), ("t5", T5, INTERLEAVED), ("whisper", WHISPER, {}), ("whisper", WHISPER, INTERLEAVED),
         ("blip2", BLIP2, {"num_layers_per_stage": [3, 3]}),
         ("t5", T5, {"zero_stage": 1, "precision": "fp16", "initial_scale": 2**8}))


def criterion(outputs, inputs):
    return outputs.loss


def _generators_agree(where: str) -> None:
    state = torch.get_rng_state()
    every = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(every, state)
    differing = [r for r, s in enumerate(every) if not torch.equal(s, every[0])]
    assert not differing, f"{where}: ranks {differing} left the step with another CPU generator state than rank 0"


def _whole_vocab(logits: torch.Tensor, vocab: int, tp_group) -> torch.Tensor:
    """The logits over the whole vocabulary: a model whose loss runs vocab-parallel (BLIP-2's OPT)
    returns this rank's slice of the padded vocabulary, gathered here."""
    if logits.shape[-1] == vocab:
        return logits
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(pieces, logits.contiguous(), group=tp_group)
    return torch.cat(pieces, dim=-1)[..., :vocab]


def _reference(ref, batch: dict, dp: int):
    """Per replica half: (loss, logits) of the unsharded model; then its gradients on the whole batch."""
    with torch.no_grad():
        halves = [ref(**half) for half in split_microbatches(batch, dp)]
    ref(**batch).loss.backward()
    return [(out.loss.item(), out.logits) for out in halves]


def _check_case(family: str, cls: str, options: dict) -> None:
    config = tiny_config(family, **({} if family == "blip2" else {"num_hidden_layers": 2}))
    ref = getattr(transformers, cls)(copy.deepcopy(config))       # from the generators as they are
    if family == "blip2":                  # zeros through its first LayerNorm give gradients of ~1e14
        with torch.no_grad():
            ref.query_tokens.normal_(0.0, 1.0)
    model = copy.deepcopy(ref)
    batch = tiny_batch(cls, config, batch=8)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=M, **options)
    dtype = torch.float16 if options.get("precision") == "fp16" else torch.float32
    fp32 = dtype == torch.float32
    booster = Booster(plugin=plugin)
    model, opt, crit, _, _ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4), criterion)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-4)
    mesh = plugin.mesh
    wanted = _reference(ref, batch, mesh.dp_size)[mesh.dp_rank]
    mine = split_microbatches(batch, mesh.dp_size)[mesh.dp_rank]
    out = booster.execute_pipeline(iter([mine]), model, crit, opt, return_outputs=fp32)
    where = f"{cls} tp=2 x pp=2 x dp=2 {options} rank {dist.get_rank()}"
    _generators_agree(where)
    assert abs(out["loss"].item() - wanted[0]) <= LOSS_ATOL[dtype], f"{where}: loss {out['loss'].item()} vs {wanted[0]}"
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    held = list(model.unwrap().named_parameters(remove_duplicate=False))
    if fp32:
        if mesh.is_last_stage:
            assert_close(_whole_vocab(out["outputs"].logits, wanted[1].shape[-1], mesh.tp_group), wanted[1],
                         msg=f"{where} logits")
        for name, p in held:
            if not ref_params[name].requires_grad:          # Whisper's sinusoidal encoder positions
                assert p.grad is None, f"{where}: frozen {name} got a gradient"
                continue
            assert_close(gathered(p, p.grad), ref_params[name].grad, msg=f"{where} grad {name}")
    opt.step(), ref_opt.step()
    for name, p in held:
        assert_close(gathered(p), ref_params[name].detach(), dtype=dtype, msg=f"{where} weight {name}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [name for name, _ in held])
    assert set().union(*every) == set(ref_params), f"{where}: stages miss {set(ref_params) - set().union(*every)}"


def _body_8(rank: int, world_size: int) -> None:
    for family, cls, options in CASES:
        _check_case(family, cls, options)


def test_encoder_decoder_tp2_pp2_dp2():
    spawn(_body_8, 8)


def test_generators_in_step_end_in_one_state():
    """A stage that drew random numbers and one that drew none leave a step in the same state; the
    next step starts from another one; a step that raises is put back too (no processes)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        with generators_in_step(torch.device("cpu")):
            torch.rand(100)                                   # dropout masks on this stage
        drew = torch.get_rng_state()
        torch.manual_seed(7)
        with generators_in_step(torch.device("cpu")):
            pass                                              # no random draw on that one
        assert torch.equal(torch.get_rng_state(), drew)
        with generators_in_step(torch.device("cpu")):
            pass
        assert not torch.equal(torch.get_rng_state(), drew), "the next step must not replay this step's masks"
        torch.manual_seed(7)
        try:
            with generators_in_step(torch.device("cpu")):
                torch.rand(3)
                raise RuntimeError("a stage failed")
        except RuntimeError:
            pass
        assert torch.equal(torch.get_rng_state(), drew)
