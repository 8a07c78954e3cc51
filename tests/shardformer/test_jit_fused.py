"""Issue 13 items 4 and 5: `jit_fuse` (the engine of `enable_jit_fused`) and apex in `fuse_norms`.

jit_fuse swaps each activation module whose forward is a chain of pointwise ops (GPT-2's NewGELU, a
Python GELU) for a `JitFusedActivation` calling that forward `torch.compile`d with dynamic shapes,
keeps every parameter object, and gives the eager numbers (fp32): eval outputs, loss and every
gradient; a new batch and sequence length does not recompile. A single-op activation (BERT's F.gelu,
the pooler's tanh) and a module carrying a hook are kept; without a working compiler nothing is
swapped and the one log line says why; a compiled function 0.1% off is refused. At tp=2 the sharded,
compiled model (`ShardConfig(enable_jit_fused=True)`, and `enable_all_optimization=True`) matches the
unsharded eager one (`check_tp_equivalence`: outputs, loss, gathered gradients, weights after AdamW).
fuse_norms uses apex's kernels when `apex.normalization` is there (a torch stand-in plays apex, absent
here), each with the norm's own weights, and names its backend.
"""

import copy
import importlib.util
import logging
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshboost.shardformer import optimizations, sharder
from meshboost.shardformer.optimizations import FusedRMSNorm, JitFusedActivation, fuse_norms, jit_fuse
from meshboost.testing import spawn
from meshboost.testing.compare import check_tp_equivalence, model_loss
from meshboost.testing.models import build_model, tiny_batch, tiny_config
from meshboost.testing.tolerance import assert_close

# (class, family, config overrides, activation modules swapped): GPT-2's NewGELU tanh chain, BERT with
# the Python (erf) GELU; the tanh of BERT's pooler is one kernel and stays.
CHAINS = (("GPT2LMHeadModel", "gpt2", {}, 2),
          ("BertForSequenceClassification", "bert", {"hidden_act": "gelu_python"}, 2))


def _activations(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__module__ == "transformers.activations"
            or isinstance(m, JitFusedActivation)]


@pytest.mark.parametrize("class_name,family,overrides,swapped", CHAINS)
def test_jit_fuse_swaps_chains_and_keeps_eager_numbers(class_name, family, overrides, swapped):
    config = tiny_config(family, **overrides)
    eager = build_model(class_name, copy.deepcopy(config))
    fused = build_model(class_name, copy.deepcopy(config))
    params = dict(fused.named_parameters())
    assert jit_fuse(fused, "cpu") == swapped
    assert all(isinstance(m, JitFusedActivation) for m in _activations(fused)), _activations(fused)
    assert {n: id(p) for n, p in fused.named_parameters()} == {n: id(p) for n, p in params.items()}
    batch = tiny_batch(class_name, config)
    eager.eval(), fused.eval()
    with torch.no_grad():
        assert_close(model_loss(fused, batch)[1], model_loss(eager, batch)[1], msg=f"{class_name} eval output")
    eager.train(), fused.train()
    for model in (eager, fused):
        model_loss(model, batch)[0].backward()
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close(p.grad, q.grad, msg=f"{class_name} grad {name}")
    with torch._dynamo.config.patch(error_on_recompile=True):      # dynamic shapes: other batch and length
        model_loss(fused, tiny_batch(class_name, config, batch=3, seq=6))[0].backward()


def test_jit_fuse_keeps_single_kernels_and_hooked_modules():
    bert = build_model("BertForSequenceClassification", tiny_config("bert"))      # F.gelu, tanh: one op each
    assert jit_fuse(bert, "cpu") == 0
    assert not any(isinstance(m, JitFusedActivation) for m in bert.modules())
    gpt2 = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    guarded = gpt2.transformer.h[0].mlp.act
    guarded.register_forward_hook(lambda module, args, out: None)
    assert jit_fuse(gpt2, "cpu") == 1
    assert gpt2.transformer.h[0].mlp.act is guarded
    assert isinstance(gpt2.transformer.h[1].mlp.act, JitFusedActivation)


def test_jit_fuse_falls_back_to_eager_without_a_compiler(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(torch, "compile", no_compiler)
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    with caplog.at_level(logging.WARNING, logger="meshboost.shardformer"):
        assert jit_fuse(model, "cpu") == 0
    assert not any(isinstance(m, JitFusedActivation) for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "enable_jit_fused" in r.getMessage()]
    assert len(lines) == 1 and "eager: torch.compile cannot run here (RuntimeError: InvalidCxxCompiler" in lines[0], \
        lines


def test_jit_fuse_refuses_a_compiled_function_whose_numbers_differ(monkeypatch):
    def off_by_a_little(fn, **kwargs):                   # a "compiler" 0.1% off: a wrong kernel
        return lambda *args: fn(*args) * 1.001
    monkeypatch.setattr(torch, "compile", off_by_a_little)
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    assert jit_fuse(model, "cpu") == 0
    assert not any(isinstance(m, JitFusedActivation) for m in model.modules())


class _FakeApexRMSNorm(nn.Module):
    """apex's FusedRMSNorm interface on torch's kernel: (x / rms) * weight rounded once, as apex does."""

    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


class _FakeApexLayerNorm(nn.LayerNorm):
    """apex's FusedLayerNorm interface (a subclass, so it is not swapped again)."""


def test_fuse_norms_uses_apex_when_it_imports(monkeypatch, caplog):
    fake = types.SimpleNamespace(FusedRMSNorm=_FakeApexRMSNorm, FusedLayerNorm=_FakeApexLayerNorm)
    monkeypatch.setattr(optimizations, "_apex_normalization", lambda device_type: (fake, ""))
    for class_name, family, apex_type in (("LlamaForCausalLM", "llama", _FakeApexRMSNorm),
                                         ("BertForSequenceClassification", "bert", _FakeApexLayerNorm),
                                         ("GemmaForCausalLM", "gemma", None)):
        config = tiny_config(family)
        eager, fused = build_model(class_name, copy.deepcopy(config)), build_model(class_name, copy.deepcopy(config))
        params = {n: id(p) for n, p in fused.named_parameters()}
        with caplog.at_level(logging.WARNING, logger="meshboost.shardformer"):
            caplog.clear()
            count = fuse_norms(fused, "cpu")
        norms = [m for m in fused.modules() if isinstance(m, (nn.LayerNorm, _FakeApexRMSNorm, FusedRMSNorm))
                 or type(m).__name__.endswith("RMSNorm")]
        assert {n: id(p) for n, p in fused.named_parameters()} == params
        if apex_type is None:                # Gemma's 1 + weight: neither apex nor torch reproduce it
            assert count == 0 and not any(isinstance(m, (_FakeApexRMSNorm, FusedRMSNorm)) for m in norms)
        else:
            assert count == len(norms) > 0 and all(type(m) is apex_type for m in norms), norms
        assert "backend apex.normalization" in caplog.text, caplog.text
        batch = tiny_batch(class_name, config)
        with torch.no_grad():
            assert_close(model_loss(fused, batch)[1], model_loss(eager, batch)[1], msg=f"{class_name} apex norms")


def test_fuse_norms_says_why_apex_is_not_used(caplog):
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed here")
    model = build_model("LlamaForCausalLM", tiny_config("llama"))
    with caplog.at_level(logging.WARNING, logger="meshboost.shardformer"):
        assert fuse_norms(model, "cuda") > 0       # no apex here: torch's kernel (probed on the CPU)
    assert "backend torch (apex.normalization does not import" in caplog.text, caplog.text


def _tp2_body(rank: int, world: int) -> None:
    swapped = []                    # what the switch's jit_fuse returned, model by model

    def counted(model, device_type):
        swapped.append(jit_fuse(model, device_type))
        return swapped[-1]

    with mock.patch.object(sharder, "jit_fuse", counted):
        for class_name, family, overrides, expected in CHAINS:
            check_tp_equivalence(class_name, family, dist.group.WORLD, shard_options={"enable_jit_fused": True},
                                 **overrides)
            assert swapped[-1] == expected, (class_name, swapped)
        check_tp_equivalence("LlamaForCausalLM", "llama", dist.group.WORLD, attention="eager",
                             shard_options={"enable_all_optimization": True})
        assert swapped[-1] == 0          # SiLU is one kernel; act_fn(gate) * up lives in the forward


def test_jit_fused_shards_keep_unsharded_numbers_at_tp2():
    spawn(_tp2_body, 2)
