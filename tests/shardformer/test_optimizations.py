"""Issue 13 (first switches): `enable_flash_attention` and `enable_fused_normalization` keep the
unsharded numbers. At tp=2, from models built with eager attention: the sharded model switches to
torch's SDPA (CPU) and its RMS norms to the fused kernel, and its eval outputs, loss, gathered
gradients and weights after AdamW match the unsharded eager model (fp32). A norm the fused kernel
does not reproduce (Gemma's 1 + weight) is kept; the switches not implemented yet raise naming
what exists; the plugin accepts the switches."""

import pytest
import torch.distributed as dist

from meshboost import Booster
from meshboost.plugins import HybridParallelPlugin
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.optimizations import FusedRMSNorm
from meshboost.testing import spawn
from meshboost.testing.compare import check_tp_equivalence
from meshboost.testing.models import build_model, tiny_config

SWITCHES = {"enable_flash_attention": True, "enable_fused_normalization": True}
CASES = (("BertForSequenceClassification", "bert"), ("GPT2LMHeadModel", "gpt2"), ("LlamaForCausalLM", "llama"),
         ("Qwen2ForCausalLM", "qwen2"), ("GemmaForCausalLM", "gemma"))


def _body(rank: int, world: int) -> None:
    group = dist.group.WORLD
    for cls, family in CASES:
        check_tp_equivalence(cls, family, group, shard_options=SWITCHES, attention="eager")
    # what the switches did, on one sharded model of each kind
    for cls, family, fused in (("LlamaForCausalLM", "llama", True), ("GemmaForCausalLM", "gemma", False)):
        model = build_model(cls, tiny_config(family))
        model.set_attn_implementation("eager")
        ShardFormer(ShardConfig(tensor_parallel_process_group=group, **SWITCHES)).optimize(model)
        assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(isinstance(m, FusedRMSNorm) == fused for m in norms), \
            f"{cls}: {[type(m).__name__ for m in norms]}"
    # through the plugin, as ColossalAI scripts pass them
    model = build_model("LlamaForCausalLM", tiny_config("llama"))
    model.set_attn_implementation("eager")
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, **SWITCHES))
    model, *_ = booster.boost(model)
    assert model.unwrap().config._attn_implementation == "sdpa"
    assert any(isinstance(m, FusedRMSNorm) for m in model.unwrap().modules())


def test_switches_keep_unsharded_numbers_at_tp2():
    spawn(_body, 2)


def test_switches_not_implemented_yet_raise_naming_what_exists():
    for kwargs in ({"enable_all_optimization": True}, {"enable_jit_fused": True}, {"enable_sequence_overlap": True}):
        with pytest.raises(NotImplementedError, match="enable_flash_attention=True"):
            ShardConfig(**kwargs)


def test_fused_norms_keep_hooked_norms():
    """A norm carrying a module hook (the sharder's guard refusing an uncovered per-head norm) is not
    swapped: the swap would drop the guard and let a wrong layout run."""
    from meshboost.shardformer.optimizations import fuse_norms
    model = build_model("LlamaForCausalLM", tiny_config("llama"))
    guarded = model.model.layers[0].input_layernorm
    guarded.register_forward_pre_hook(lambda module, args: None)
    assert fuse_norms(model, "cpu") == 2 * len(model.model.layers)        # every other norm, and the final one
    assert model.model.layers[0].input_layernorm is guarded
    assert isinstance(model.model.layers[1].input_layernorm, FusedRMSNorm)

