"""Issue 59 point 2 on 4 processes (fp32, tiny Llama, vocabulary 101: padded at tp=2): `generate_rollouts` from
the boosted policy, each layout against one process's transformers `generate` from the same weights:

- greedy: tp=2 x dp=2, tp=2 x dp=2 with ZeRO-3 (FSDP2 gathering one unit at a time), dp=4, and TorchDDPPlugin and
  FSDPPlugin at dp=4 each return one process's greedy rows (the prompts of different lengths, left-padded for
  generate, re-laid right-padded);
- sampling (temperature 0.9, top_p 0.95): the tp ranks' rows are equal, the replicas' differ, and replica r's rows
  are one process's samples with the generator seeded `replica_seed(seed, r)`; the global RNG is untouched;
- the rows are what the log-prob path takes: the completion's log-probs by `token_logprobs` on the rollout
  batch equal the log-softmax of the scores `generate` used (the right-padded rows hold the positions generate
  gave the left-padded ones); the response mask stops after the first end-of-sequence token;
- ep=2 on a tiny Qwen3-MoE (dp=4, replicas of different sizes): greedy rows equal one process's (the experts'
  token exchange inside every decoding step, the replicas kept in step by synced_gpus);
- refused by name on every rank: pp=2 (generate on an exported copy), cp=2, sequence parallelism; a replica with
  no prompts under ZeRO-3 (its peers would wait in FSDP2's gathers) raises on every rank.
One process group, the layouts looped inside."""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import GenerationConfig

from meshboost import Booster
from meshboost.pipeline.config import PipelineConfig
from meshboost.plugins import FSDPPlugin, HybridParallelConfig, HybridParallelPlugin, TorchDDPPlugin, ZeroConfig
from meshboost.post_training import RolloutBatch, generate_rollouts, replica_seed, token_logprobs
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_config
from meshboost.testing.moe import build_causal_lm, moe_config

G, NEW, SEED = 2, 6, 11
PROMPTS = [[[5, 9, 2], [7, 3, 3, 8, 1], [4], [6, 6]], [[8, 2, 2, 9], [3], [10, 11, 12], [1, 2]],
           [[9, 9], [13, 5, 7], [2, 4, 6, 8], [5]], [[7], [1, 1, 1], [20, 30], [40, 41, 42, 43]]]
SAMPLE = dict(temperature=0.9, top_p=0.95)
LAYOUTS = {"tp2 dp2": (HybridParallelConfig(tp_size=2), 2),
           "tp2 dp2 zero3": (HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=3)), 2),
           "dp4": (HybridParallelConfig(), 4),
           "TorchDDPPlugin dp4": (TorchDDPPlugin, 4),          # plugins without a mesh: every rank a replica
           "FSDPPlugin dp4": (FSDPPlugin, 4)}


def _config():
    config = tiny_config("llama", num_key_value_heads=2)
    config.eos_token_id = 17                # some completions end early: the response mask must stop there
    return config


def _one_process(model, prompts, seed: int | None) -> RolloutBatch:
    """transformers' generate on one process (greedy when seed is None, else sampled from that seed)."""
    if seed is None:
        return generate_rollouts(model, prompts, G, NEW, do_sample=False)
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    want = _sampled_rows(model, prompts)
    torch.set_rng_state(state)
    return want


def _sampled_rows(model, prompts) -> RolloutBatch:
    """The one-process truth of a sampled replica: HF generate under the current global RNG, no meshboost code."""
    from meshboost.post_training.rollout import _left_padded, _response_mask, _right_padded

    ids, mask = _left_padded(prompts, 0, "cpu")
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=17, **SAMPLE)
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completion = out[:, ids.shape[1]:]
    return _right_padded(ids, mask, completion, _response_mask(completion, 17), 0, G)


def _same(got: RolloutBatch, want: RolloutBatch, what: str) -> None:
    for field in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(got, field), getattr(want, field)), (what, field, getattr(got, field),
                                                                        getattr(want, field))


def _gathered(rows: torch.Tensor, group) -> list[torch.Tensor]:
    width = torch.tensor([rows.shape[1]])
    widths = [torch.zeros_like(width) for _ in range(dist.get_world_size(group))]
    dist.all_gather(widths, width, group=group)
    padded = torch.nn.functional.pad(rows, (0, int(max(widths)) - rows.shape[1]), value=-1)
    out = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(out, padded, group=group)
    return out


def _check_layouts(rank):
    config = _config()
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    for what, (plugin_config, replicas) in LAYOUTS.items():
        plugin = plugin_config() if callable(plugin_config) else HybridParallelPlugin(plugin_config)
        booster = Booster(plugin=plugin)
        policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
        model, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=0.1))
        model.train()
        mesh = getattr(model, "mesh", None)
        replica, tp = (mesh.dp_rank, mesh.tp_size) if mesh is not None else (dist.get_rank(), 1)
        prompts = PROMPTS[replica] if replicas == 4 else PROMPTS[replica] + PROMPTS[replica + 2]
        greedy = generate_rollouts(model, prompts, G, NEW, do_sample=False)
        _same(greedy, _one_process(whole, prompts, None), f"{what} greedy")
        state = torch.get_rng_state()
        sampled = generate_rollouts(model, prompts, G, NEW, seed=SEED, **SAMPLE)
        assert torch.equal(torch.get_rng_state(), state), f"{what}: the global RNG moved"
        assert model.training, f"{what}: the model's mode was not restored"
        _same(sampled, _one_process(whole, prompts, replica_seed(SEED, replica)), f"{what} sampled")
        everyone = _gathered(sampled.input_ids, None)
        for r in range(dist.get_world_size()):          # tp ranks equal, replicas different
            first_of_replica = r - r % tp if tp > 1 else r
            assert torch.equal(everyone[r], everyone[first_of_replica]), (what, r)
        if replicas == 2:                                # the same prompts on both replicas: samples still differ
            same_prompts = generate_rollouts(model, PROMPTS[0], G, NEW, seed=SEED, **SAMPLE)
            rows = _gathered(same_prompts.input_ids, None)
            assert not torch.equal(rows[0], rows[tp]), f"{what}: two replicas drew the same samples"
        # the log-prob path reads the rows as generate scored them
        batch = sampled.model_batch()
        model.eval()
        with torch.no_grad():
            scores = token_logprobs(model, batch)
        model.train()
        want = token_logprobs(whole.eval(), batch).logprobs
        torch.testing.assert_close(scores.logprobs, want, rtol=1e-5, atol=1e-5)


def _check_generate_scores(rank):
    """The rows' log-probs (token_logprobs on the right-padded batch) equal generate's own per-step scores
    (log-softmax of the raw logits it sampled from) at every completion token: positions and masks line up."""
    config = _config()
    model = build_model("LlamaForCausalLM", copy.deepcopy(config)).eval()
    prompts = PROMPTS[0]
    rows = generate_rollouts(model, prompts, 1, NEW, do_sample=False)
    from meshboost.post_training.rollout import _left_padded

    ids, mask = _left_padded(prompts, 0, "cpu")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=17)
    steps = torch.stack(out.logits, dim=1).log_softmax(-1)             # [rows, new, vocab]
    scored = token_logprobs(model, rows.model_batch())
    for i in range(len(prompts)):
        start = len(prompts[i]) - 1                                      # the position that predicts completion 0
        n = int(rows.response_mask[i].sum())
        tokens = rows.input_ids[i, start + 1:start + 1 + n]
        want = steps[i, :n].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(scored.logprobs[i, start:start + n], want, rtol=1e-5, atol=1e-5)
        assert scored.mask[i].sum() == n and bool(scored.mask[i, start:start + n].all())
        ended = (tokens == 17).nonzero().flatten()
        assert len(ended) == 0 or int(ended[0]) == n - 1, "the response mask runs past the first end token"
    assert rows.response_mask.sum(1).min() <= NEW


def _check_experts(rank):
    """ep=2 on a tiny Qwen3-MoE (dp=4, each replica its own prompts): every replica's greedy rows are one
    process's, though the experts' token exchange runs inside every decoding step (synced_gpus keeps the
    replicas stepping together until the last has finished)."""
    config = moe_config("qwen3_moe", use_cache=True, eos_token_id=17)
    whole = build_causal_lm(config)
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig.of(ep_size=2, zero_stage=1)))
    model, *_ = booster.boost(build_causal_lm(config))
    prompts = PROMPTS[model.mesh.dp_rank][: 1 + model.mesh.dp_rank]       # replicas of different sizes
    got = generate_rollouts(model, prompts, G, NEW, do_sample=False)
    _same(got, _one_process(whole, prompts, None), "ep2 greedy")


def _check_refusals(rank):
    config = _config()
    for what, plugin_config, text in (
            ("pp2", HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=1)), "export_weights"),
            ("cp2", HybridParallelConfig(cp_size=2), "cp_size=2"),
            ("tp2 sp", HybridParallelConfig(tp_size=2, sequence_parallel=True), "sequence parallelism")):
        booster = Booster(plugin=HybridParallelPlugin(plugin_config))
        model, *_ = booster.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
        with pytest.raises(NotImplementedError, match=text):
            generate_rollouts(model, PROMPTS[0], G, NEW)
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(zero=ZeroConfig(stage=3))))
    model, *_ = booster.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
    with pytest.raises(ValueError, match="every rank before any collective"):   # one replica without prompts
        generate_rollouts(model, [] if rank == 2 else PROMPTS[rank], G, NEW)


def _body(rank, world_size):
    _check_generate_scores(rank)
    _check_refusals(rank)
    _check_layouts(rank)
    _check_experts(rank)


def test_rollouts():
    spawn(_body, 4)
