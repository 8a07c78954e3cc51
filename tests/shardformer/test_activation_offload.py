"""Issue 60 point 2: activation offload (`HybridParallelConfig(activation_offload=...)`,
meshboost/shardformer/offload.py), fp32 Llama.

(a) One process, attention dropout on: offload on and off give the same loss and gradients bitwise, with
checkpointing off, "full" and torch's reentrant form. The counters say what moved: without checkpointing
most of the blocks' saved bytes (never a parameter, every saved reference handed back, the previous block
prefetched, each handed tensor the host copy, and every original freed once the forward ended: on a GPU,
the device memory saved); with checkpointing, exactly each block's checkpointed input (its hidden states)
and nothing else. A stale host copy (zeros) makes the comparison fail, holding the originals the freed
count: the test sees a wrong rule. (b) The switch: True takes the defaults, a bad `min_bytes` or type and
compile are refused by name. (c) One spawn of world 2 looping tp=2 with sequence parallelism, pp=2 (1F1B
and interleaved), DDP and ZeRO-1, 2 and 3 over dp=2, cp=2 (Ulysses), and pp=2 with checkpointing: offload
on equals the same layout off bitwise (loss, every rank's gradients, weights after an SGD step), and every
rank moved bytes to host.
"""

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PipelineConfig, ZeroConfig
from meshboost.plugins.speed import transformer_blocks
from meshboost.shardformer import enable_checkpointing
from meshboost.shardformer.offload import ActivationOffloader, OffloadConfig, install_offload
from meshboost.testing import spawn
from meshboost.testing.compare import booster_backward
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS = "LlamaForCausalLM"
MIN_BYTES = 1024


def _differences(ref: tuple, run: tuple) -> list[str]:
    """Names whose values differ bitwise between two (loss, gradients) runs ('loss' for the loss)."""
    (ref_loss, ref_grads), (loss, grads) = ref, run
    assert grads.keys() == ref_grads.keys()
    bad = [] if torch.equal(loss, ref_loss) else ["loss"]
    return bad + [n for n, g in grads.items() if not torch.equal(g, ref_grads[n])]


class _SavedBytes:
    """Bytes of the non-parameter tensors of at least MIN_BYTES saved inside the blocks (each save counted)."""

    def __init__(self, blocks):
        self.bytes = 0
        for block in blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _pack(self, t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            self.bytes += t.numel() * t.element_size() if t.numel() * t.element_size() >= MIN_BYTES else 0
        return t

    def _enter(self, module, args):
        self.context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.context.__enter__()

    def _leave(self, module, args, output):
        self.context.__exit__(None, None, None)


def _one_process(config, batch, checkpointing, offload: bool, count: bool = False, after_forward=None):
    model = build_model(CLS, copy.deepcopy(config)).train()
    if checkpointing == "reentrant":        # the user's own switch, torch's reentrant form: inputs saved the same way
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        enable_checkpointing(model, checkpointing)
    blocks = transformer_blocks(model)
    offloader = install_offload(blocks, OffloadConfig(min_bytes=MIN_BYTES), "cpu") if offload else None
    counter = _SavedBytes(blocks) if count else None
    torch.manual_seed(11)
    loss = model(**batch).loss
    if after_forward is not None:
        after_forward()
    loss.backward()
    return (loss.detach(), {n: p.grad for n, p in model.named_parameters()}), offloader, counter


def test_offload_is_exact_and_moves_the_blocks_saved_tensors(monkeypatch):
    config = tiny_config("llama", num_hidden_layers=3, hidden_size=64, intermediate_size=128, attention_dropout=0.2)
    batch = tiny_batch(CLS, config, batch=2, seq=32, seed=3)
    ref, _, counter = _one_process(config, batch, None, offload=False, count=True)
    handed, originals, freed = [], [], []
    original_unpack, original_to_host = ActivationOffloader.unpack, ActivationOffloader._to_host

    def to_host(self, t):
        originals.append((weakref.ref(t), t.numel() * t.element_size()))
        return original_to_host(self, t)

    def count_freed():          # the "device" side: what the backward no longer holds once the forward ended
        gc.collect()
        freed.append(sum(size for ref, size in originals if ref() is None))

    def unpack(self, packed):
        t = original_unpack(self, packed)
        if not isinstance(packed, torch.Tensor):
            handed.append(t is packed[1].host)
        return t

    monkeypatch.setattr(ActivationOffloader, "unpack", unpack)
    monkeypatch.setattr(ActivationOffloader, "_to_host", to_host)
    run, offloader, _ = _one_process(config, batch, None, offload=True, after_forward=count_freed)
    assert _differences(ref, run) == []
    stats = offloader.stats
    assert 0.3 * counter.bytes < stats.packed_bytes <= counter.bytes, (stats, counter.bytes)
    assert stats.kept_parameters > 0 and stats.unpacked == stats.packed + stats.reused, stats
    assert 0 < stats.prefetched <= stats.packed, stats
    assert handed and all(handed)           # the backward reads the host copies, not the originals
    # every original is gone once the forward ended (on a GPU: device memory freed); without offload the
    # backward's saved tensors would hold each of them
    assert freed == [stats.packed_bytes], (freed, stats)
    monkeypatch.setattr(ActivationOffloader, "unpack", original_unpack)
    monkeypatch.setattr(ActivationOffloader, "_to_host", original_to_host)

    for checkpointing in ("reentrant", "full"):
        checkpointed_ref, _, _ = _one_process(config, batch, checkpointing, offload=False)
        run, offloader, _ = _one_process(config, batch, checkpointing, offload=True)
        assert _differences(checkpointed_ref, run) == [], checkpointing
        stats, hidden = offloader.stats, 2 * 32 * 64 * 4            # batch x seq x hidden in fp32
        assert (stats.packed, stats.packed_bytes, stats.reused) == (3, 3 * hidden, 0), stats   # one input per block
        assert stats.kept_parameters == 0 and stats.unpacked == 3, stats

    def stale(self, t):         # a wrong rule: the host copy never written
        return torch.zeros_like(t), None

    monkeypatch.setattr(ActivationOffloader, "_to_host", stale)
    for checkpointing, truth in ((None, ref), ("full", checkpointed_ref)):
        wrong, _, _ = _one_process(config, batch, checkpointing, offload=True)
        assert _differences(truth, wrong), f"{checkpointing}: a stale host copy went unseen"


def test_switch_and_refusals():
    assert HybridParallelConfig(activation_offload=True).activation_offload == OffloadConfig()
    assert HybridParallelConfig(activation_offload=False).activation_offload is None
    assert HybridParallelConfig(activation_offload=OffloadConfig(min_bytes=0)).activation_offload.min_bytes == 0
    with pytest.raises(ValueError, match=r"min_bytes=-1"):
        OffloadConfig(min_bytes=-1)
    with pytest.raises(TypeError, match=r"activation_offload='yes'"):
        HybridParallelConfig(activation_offload="yes")
    with pytest.raises(NotImplementedError, match="activation_offload with compile"):
        HybridParallelConfig(activation_offload=True, compile=True)


LAYOUTS = ({"tp_size": 2, "sequence_parallel": True}, {"pp_size": 2, "num_microbatches": 2},
           {"pp_size": 2, "num_microbatches": 2, "pp_style": "interleaved", "num_model_chunks": 2},
           {"zero": ZeroConfig(stage=1)}, {"zero": ZeroConfig(stage=2)}, {"zero": ZeroConfig(stage=3)},
           {"cp_size": 2}, {},          # the last: torch DDP over dp=2
           {"pp_size": 2, "num_microbatches": 2, "checkpointing": "full"})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t       # FSDP2's DTensor: this rank's shard


def _boosted(config, settings: dict, offload, batch):
    """(loss, this rank's gradients by name (where the layout holds them: ZeRO-1/2 reduce-scatter them into
    the optimizer) and weights after an SGD step) and the offloader of one step at `settings`."""
    model = build_model(CLS, copy.deepcopy(config))
    settings = dict(settings)
    pipeline = PipelineConfig(**{k: settings.pop(k) for k in ("num_microbatches", "pp_style", "num_model_chunks")
                                 if k in settings})
    plugin = HybridParallelPlugin(HybridParallelConfig(activation_offload=offload, pipeline=pipeline, **settings))
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5))
    model.train()
    torch.manual_seed(11)
    loss = booster_backward(booster, model, opt, batch)
    grads = {n: _local(p.grad).clone() for n, p in model.unwrap().named_parameters() if p.grad is not None}
    opt.step()
    grads.update({f"{n} after the step": _local(p.detach()).clone() for n, p in model.unwrap().named_parameters()})
    return (loss.detach(), grads), model.activation_offload


def _body(rank: int, world: int) -> None:
    config = tiny_config("llama", num_hidden_layers=4)
    batch = tiny_batch(CLS, config, batch=4, seq=16, seed=7)
    for settings in LAYOUTS:
        ref, none = _boosted(config, settings, None, batch)
        run, offloader = _boosted(config, settings, OffloadConfig(min_bytes=256), batch)
        assert none is None
        assert _differences(ref, run) == [], f"rank {rank} {settings}: {_differences(ref, run)[:3]}"
        stats = offloader.stats
        assert stats.packed_bytes > 0 and stats.unpacked == stats.packed + stats.reused, f"{settings}: {stats}"
        # weights (FSDP2's gathered ones too) are never moved; under checkpointing the hooks see the inputs only
        assert (stats.kept_parameters > 0) == ("checkpointing" not in settings), f"{settings}: {stats}"
        dist.barrier()


def test_offload_at_tp_sp_pp_zero_equals_the_same_layout_without():
    spawn(_body, 2)
