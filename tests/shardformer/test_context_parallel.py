"""Context parallelism, the all_to_all (Ulysses) mode (issue 26, item 1 and part of 3, 4), on 4
processes, each layout against single-process AdamW training on the whole batches from the same
weights (per-step loss within 2e-5 relative in fp32, every weight gathered after the last step):

- Llama with grouped-query attention (2 kv heads) at sp=2 (x dp=2), sp=4 (kv heads fewer than sp:
  repeated), tp=2 x sp=2 (its save reloaded by `from_pretrained`), sp=2 with ZeRO-1 and ZeRO-2; Qwen2 and Qwen3-MoE at sp=2; ColossalAI's
  keywords (enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all", sp_size=2);
- a right-padded batch with SDPA and eager attention: whole-sequence eval logits and loss, the
  training loss and every gradient equal to the unsharded model's;
- refusals: a sequence length not divisible by sp_size and packed position_ids on every rank before
  any collective; ring modes, sliding windows, heads not dividing over sp, non-causal models and
  implementations the mode cannot wrap (pure checks).
One process group, the layouts looped inside."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from meshboost import Booster
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.shardformer.context import check_context
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model, tiny_config
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config, train_boosted, train_whole


def _config(family="llama", **overrides):
    config = moe_config(family) if family == "qwen3_moe" else tiny_config(family, **overrides)
    config.use_cache = False
    return config


def _layouts(rank):
    config = _config(num_key_value_heads=2)
    batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    for what, plugin_config in (("sp2 dp2", HybridParallelConfig(sp_size=2)),
                                ("sp4 (kv heads repeated)", HybridParallelConfig(sp_size=4)),
                                ("tp2 sp2", HybridParallelConfig(tp_size=2, sp_size=2)),
                                ("sp2 dp2 zero1", HybridParallelConfig(sp_size=2, zero=ZeroConfig(stage=1))),
                                ("sp2 dp2 zero2", HybridParallelConfig(sp_size=2, zero=ZeroConfig(stage=2)))):
        booster, model, _ = train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"llama {what}")
        if what == "tp2 sp2":            # one writer per stage: the cp ranks hold the same weights
            folder = os.path.join(tempfile.gettempdir(), f"meshboost_cp_{os.environ.get('MASTER_PORT', '0')}")
            booster.save_model(model, folder, shard=True)
            dist.barrier()
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            for n, p in reloaded.named_parameters():
                assert_close(p.detach(), ref_params[n].detach(), dtype=torch.float32, msg=f"reloaded {n}")
    for family in ("qwen2", "qwen3_moe"):
        config = _config(family)
        batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
        ref_losses, ref_params = train_whole(config, batches)
        train_boosted(config, batches, HybridParallelConfig(sp_size=2), ref_losses, ref_params, f"{family} sp2")
    # ColossalAI's keywords reach the same layout
    from meshboost.booster.plugin import HybridParallelPlugin as ColossalAIPlugin
    plugin = ColossalAIPlugin(tp_size=1, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
                              sp_size=2)
    assert (plugin.config.sp_size, plugin.config.sp_mode) == (2, "all_to_all")
    assert not plugin.config.sharding.enable_sequence_parallelism


def _padded(rank):
    """A right-padded batch (every rank the same): eval logits of the real tokens and the loss, then the
    training loss and every gradient (averaged over dp x cp), as the unsharded model computes them."""
    for implementation in ("sdpa", "eager"):
        config = _config(num_key_value_heads=2)
        config._attn_implementation = implementation
        ids = torch.randint(1, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        ref = build_causal_lm(config)
        model = copy.deepcopy(ref)
        ref.eval()
        with torch.no_grad():
            expected = ref(**batch)
        ref.train()
        ref(**batch).loss.backward()
        booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(sp_size=2)))
        model, *_ = booster.boost(model)
        model.eval()
        with torch.no_grad():
            got = model(**batch)
        real = mask.bool()
        assert got.logits.shape == expected.logits.shape, implementation
        assert torch.allclose(got.logits[real], expected.logits[real], atol=1e-5), implementation
        assert abs(got.loss.item() - expected.loss.item()) < 1e-5, implementation
        model.train()
        loss = model(**batch).loss
        loss.backward()
        reference = dict(ref.named_parameters())
        for n, p in model.unwrap().named_parameters():
            assert torch.allclose(p.grad, reference[n].grad, atol=1e-5), f"{implementation} grad {n}"
        # a length not divisible by sp_size, and packed sequences: refused on every rank, before any collective
        with pytest.raises(ValueError, match="sequence length 7 is not divisible by sp_size=2"):
            model(input_ids=ids[:, :7], labels=labels[:, :7])
        packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
        with pytest.raises(NotImplementedError, match="packed sequences"):
            model(input_ids=ids, position_ids=packed, labels=labels)


def _body(rank, world):
    _layouts(rank)
    _padded(rank)


def test_context_parallel_all_to_all():
    spawn(_body, 4)


def test_context_parallel_refusals():
    with pytest.raises(NotImplementedError, match="'ring_attn' \\(ring attention\\) is not built yet"):
        HybridParallelConfig(sp_size=2, sp_mode="ring_attn")
    with pytest.raises(ValueError, match="sequence_parallelism_mode='all_to_all' with sp_size=1 splits nothing"):
        HybridParallelConfig(sp_mode="all_to_all")
    with pytest.raises(NotImplementedError, match="sp_size=2 with \\{'pp_size': 2\\}"):
        from meshboost.pipeline import PipelineConfig
        HybridParallelConfig(sp_size=2, pipeline=PipelineConfig(pp_size=2, num_microbatches=2))
    from meshboost.shardformer import ShardConfig
    with pytest.raises(ValueError, match="enable_sequence_parallelism=True \\(split_gather"):
        HybridParallelConfig(sp_size=2, sharding=ShardConfig(enable_sequence_parallelism=True))
    from meshboost.booster.plugin.hybrid_parallel_plugin import _context
    with pytest.raises(NotImplementedError, match="split_gather sequence parallelism runs over the tensor-parallel"):
        _context(dict(sp_size=2, sequence_parallelism_mode="split_gather", enable_sequence_parallelism=True))
    llama = build_causal_lm(_config(num_key_value_heads=2))
    with pytest.raises(ValueError, match="4 attention heads over tp_size=1 leave 4 per rank, not divisible by sp_size=8"):
        check_context(llama, 8, 1)
    mistral = build_causal_lm(transformers.MistralConfig(**{**tiny_config("mistral").to_dict(), "sliding_window": 4}))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        check_context(mistral, 2, 1)
    with pytest.raises(NotImplementedError, match="causal LMs"):
        check_context(build_model("BertModel", tiny_config("bert")), 2, 1)
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(NotImplementedError, match="attn_implementation='flex_attention'"):
        check_context(llama, 2, 1)
