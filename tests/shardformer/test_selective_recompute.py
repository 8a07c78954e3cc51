"""Issue 60 point 3: selective recomputation (`checkpointing="selective"` beside `"full"`,
meshboost/shardformer/selective.py), fp32 Llama with attention dropout on.

(a) One process: no recomputation, full and selective give the same loss (bitwise) and gradients (1e-7), so
the recompute replays the dropout masks; the backward of selective runs exactly the matmuls of no
recomputation (what it kept is not recomputed) and full strictly more (a policy keeping nothing counts as
full: the count tells them apart); its live-bytes peak lies strictly between full's and none's; a fused
attention kernel with dropout is recomputed, not kept. (b) One spawn of world 2 looping tp=2, tp=2 with
sequence parallelism, pp=2 (also with a per-stage count) and ZeRO-3 (FSDP2) over dp=2: with dropout on,
the three modes give the same loss and gradients on every rank (the per-tp-rank streams replayed); with
dropout off, selective equals the unsharded model without recomputation. (c) An unknown mode is refused by
name, and "selective" with compile (inductor fails torch's cached-tensor check in the backward) with the fix.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from meshboost import Booster
from meshboost.plan.tracker import device_bytes, live_bytes_tracker
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PipelineConfig, ZeroConfig
from meshboost.shardformer import PipelineGradientCheckpointConfig, enable_checkpointing, selective_policy
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import booster_backward
from meshboost.testing.sharded_training import whole
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS, MODES = "LlamaForCausalLM", (None, "full", "selective")
MATMULS = ("mm", "addmm", "bmm")


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in MATMULS
        return func(*args, **(kwargs or {}))


def _one_process(config, batch, mode, policy=None):
    model = build_model(CLS, copy.deepcopy(config)).train()
    if policy is None:
        enable_checkpointing(model, mode)
    else:
        enable_checkpointing(model, mode, policy)
    torch.manual_seed(11)
    tracker = live_bytes_tracker()()
    tracker.track_external(model)
    with tracker:
        loss = model(**batch).loss
        with _Matmuls() as matmuls:
            loss.backward()
    peak = device_bytes(tracker.get_tracker_snapshot("peak"))
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, matmuls.count, peak


def _keeps_nothing(ctx, func, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_one_process_modes_agree_and_selective_keeps_the_matmuls():
    config = tiny_config("llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                         attention_dropout=0.2)
    batch = tiny_batch(CLS, config, batch=2, seq=128, seed=3)
    runs = {mode: _one_process(config, batch, mode) for mode in MODES}
    ref_loss, ref_grads, _, _ = runs[None]
    for mode in ("full", "selective"):
        loss, grads, _, _ = runs[mode]
        assert torch.equal(loss, ref_loss), f"{mode}: loss {loss} vs {ref_loss}"
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-7, msg=f"{mode}: {name}")
    none, full, selective = (runs[m][2] for m in MODES)
    assert selective == none < full, f"backward matmuls: none {none}, full {full}, selective {selective}"
    assert _one_process(config, batch, "selective", _keeps_nothing)[2] == full     # the count tells them apart
    none, full, selective = (runs[m][3] for m in MODES)
    assert full < selective < none, f"peak bytes: none {none}, full {full}, selective {selective}"


def test_attention_kernels_with_dropout_are_recomputed():
    """A kept fused kernel with dropout would skip its draw in the recompute (shifting every later mask on
    CUDA's philox offset): kept at dropout_p 0 only, by position or keyword."""
    q = torch.randn(1, 2, 4, 8)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert selective_policy(None, flash, q, q, q) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, flash, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(None, efficient, q, q, q, None, True, dropout_p=0.2) == CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(None, efficient, q, q, q, None, True) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, torch.ops.aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, torch.ops.aten.native_dropout.default, q, 0.1, True) != CheckpointPolicy.MUST_SAVE


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"checkpointing='partial'.*'full', 'selective'"):
        HybridParallelConfig(checkpointing="partial")
    with pytest.raises(ValueError, match="'full', 'selective'"):
        enable_checkpointing(torch.nn.Linear(2, 2), "partial")
    with pytest.raises(ValueError, match="checkpointing='full' with compile"):
        HybridParallelConfig(checkpointing="selective", compile=True)
    HybridParallelConfig(checkpointing="full", compile=True)


LAYOUTS = ({"tp_size": 2}, {"tp_size": 2, "sequence_parallel": True}, {"pp_size": 2, "num_microbatches": 2},
           {"zero": ZeroConfig(stage=3)},      # FSDP2 over dp=2: its all-gathers run inside the checkpointed call
           # ColossalAI's per-stage knob still picks the blocks: stage 0's checkpointed, stage 1's not
           {"pp_size": 2, "num_microbatches": 2,
            "gradient_checkpoint": PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 0])})


def _boosted(config, settings: dict, mode, batch):
    """(loss, this rank's gradients by name, gathered over tp) of one step of `mode` at `settings`."""
    model = build_model(CLS, copy.deepcopy(config))
    settings = dict(settings)
    pipeline = PipelineConfig(num_microbatches=settings.pop("num_microbatches", None))
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(checkpointing=mode, pipeline=pipeline,
                                                                       **settings)))
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    model.train()
    flags = {getattr(m, "gradient_checkpointing", False) for m in model.unwrap().modules()}
    assert (True in flags) == (mode is not None), f"{settings} {mode}: checkpointing flags {flags}"
    torch.manual_seed(11)
    loss = booster_backward(booster, model, opt, batch)
    grads = {n: whole(p.grad, p) for n, p in model.unwrap().named_parameters() if p.grad is not None}
    assert grads, f"{settings} {mode}: no gradient held"
    return loss.detach(), grads


def _body(rank: int, world: int) -> None:
    on = tiny_config("llama", num_hidden_layers=2, attention_dropout=0.2)
    off = tiny_config("llama", num_hidden_layers=2)
    batch = tiny_batch(CLS, on, batch=4, seq=16, seed=7)
    ref = build_model(CLS, copy.deepcopy(off)).train()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    for settings in LAYOUTS:
        base_loss, base_grads = _boosted(on, settings, None, batch)
        for mode in ("full", "selective"):
            loss, grads = _boosted(on, settings, mode, batch)
            assert torch.equal(loss, base_loss), f"{settings} {mode} dropout on: loss {loss} vs {base_loss}"
            assert grads.keys() == base_grads.keys(), settings
            for name, grad in grads.items():
                torch.testing.assert_close(grad, base_grads[name], rtol=0, atol=1e-7, msg=f"{settings} {mode}: {name}")
        loss, grads = _boosted(off, settings, "selective", batch)
        assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"{settings}: {loss} vs {ref_loss}"
        want = dict(ref.named_parameters(remove_duplicate=False))
        for name, grad in grads.items():
            assert_close(grad, want[name].grad, msg=f"{settings} selective vs one process: {name}")
        dist.barrier()


def test_selective_under_tp_sp_pp_equals_full_none_and_one_process():
    spawn(_body, 2)
