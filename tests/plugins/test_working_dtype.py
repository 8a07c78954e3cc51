"""Every plugin computes in the same working dtype, floating buffers included (issue 58): at dp=2, a tiny
Llama boosted in bf16 by LowLevelZeroPlugin, HybridParallelPlugin at zero_stage 0 and 3, meshboost's
FSDPPlugin, GeminiPlugin and TorchFSDPPlugin with FSDP1's `buffer_dtype=torch.bfloat16` gives, in eval on
the same batch, logits bitwise equal to the unsharded model cast by `model.to(torch.bfloat16)` on one process,
and holds its floating buffers (the rotary `inv_freq`) in bf16. An fp32 `inv_freq` under bf16 weights moves
the rotary angles (~4e-3 in these logits), so the FSDP2 paths that kept it fp32 gave other numbers than
zero_stage 0-2 from the same weights (ColossalChat's DPO under GeminiPlugin against its reference under
HybridParallelPlugin: a nonzero margin before any update). TorchFSDPPlugin follows FSDP1's MixedPrecision:
`buffer_dtype=None` (and FSDP2's MixedPrecisionPolicy, which has none) leaves the buffers as they are.
"""

import copy

import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

import meshboost
from meshboost import Booster
from meshboost.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, TorchFSDPPlugin
from meshboost.plugins import FSDPPlugin
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_config

BF16 = torch.bfloat16


def _plugins():
    yield "LowLevelZeroPlugin(stage=2)", LowLevelZeroPlugin(stage=2, precision="bf16"), BF16
    yield "HybridParallelPlugin(zero_stage=0)", HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16"), BF16
    yield "HybridParallelPlugin(zero_stage=3)", HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=3,
                                                                     precision="bf16"), BF16
    yield "FSDPPlugin", FSDPPlugin(precision="bf16"), BF16
    yield "GeminiPlugin", GeminiPlugin(precision="bf16", placement_policy="static"), BF16
    yield "TorchFSDPPlugin(buffer_dtype=bf16)", TorchFSDPPlugin(mixed_precision=MixedPrecision(
        param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16)), BF16
    yield "TorchFSDPPlugin(buffer_dtype=None)", TorchFSDPPlugin(mixed_precision=MixedPrecision(
        param_dtype=BF16, reduce_dtype=torch.float32)), torch.float32
    yield "TorchFSDPPlugin(MixedPrecisionPolicy)", TorchFSDPPlugin(mixed_precision=MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=torch.float32)), torch.float32


def _body(rank, world):
    config = tiny_config("llama", max_position_embeddings=64)
    base = build_model("LlamaForCausalLM", config)
    ids = torch.randint(1, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    device = meshboost.get_current_device()
    ids = ids.to(device)
    with torch.no_grad():
        expected = copy.deepcopy(base).to(device, BF16).eval()(input_ids=ids).logits
    for name, plugin, buffers in _plugins():
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, *_ = Booster(plugin=plugin).boost(model, optimizer)
        model.eval()
        held = {n: b.dtype for n, b in model.unwrap().named_buffers() if b.is_floating_point()}
        assert held and set(held.values()) == {buffers}, (name, held)
        if buffers != BF16:
            continue
        with torch.no_grad():
            got = model(input_ids=ids).logits
        assert got.dtype == BF16, (name, got.dtype)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_bf16_logits_and_buffers_equal_across_plugins_dp2():
    spawn(_body, 2)
