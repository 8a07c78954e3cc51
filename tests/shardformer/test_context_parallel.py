"""Context parallelism, the all_to_all (Ulysses) and ring_attn modes (issue 26, items 1, 2 and part of
3, 4), on 4 processes, each layout against single-process AdamW training on the whole batches from the
same weights (per-step loss within 2e-5 relative in fp32, every weight gathered after the last step):

- Llama with grouped-query attention (2 kv heads) at sp=2 (x dp=2), sp=4 (kv heads fewer than sp:
  repeated), tp=2 x sp=2 (its save reloaded by `from_pretrained`), sp=2 with ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2 over dp x cp, its save reloaded too); Qwen2 at
  sp=2; Qwen3-MoE at tp=2 x sp=2, sp=2 x ep=2 and (ring_attn, ZeRO-1) sp=2 x ep=2; ColossalAI's
  keywords (enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all", sp_size=2);
- the ring_attn mode (keys and values all-gathered, the zig-zag split) at sp=2, sp=4, tp=2 x sp=2 and
  with ZeRO-1 and ZeRO-3;
- with pipeline stages: sp=2 x pp=2 (1F1B), ring_attn sp=2 x pp=2 with ZeRO-1, interleaved chunks with
  every layer recomputed, on micro-batches that mask differently; eval through the schedule; a criterion
  other than the model's loss refused;
- what users send, in both modes with SDPA and eager: a right-padded batch, packed rows (position_ids
  restarting, use_cache off: documents isolated as transformers isolates them; with the cache on, and every
  other setting transformers' rule reads, tests/reliability/test_packed_rows.py), a sliding-window model (Mistral):
  whole-sequence eval logits and loss, the training loss and every gradient equal to the unsharded
  model's;
- per-call state: a call's masks travel with its inputs (a ContextCall), none is stored on the attention;
- refusals: a sequence length not divisible by the split on every rank before any collective;
  the tp group's modes with cp_size ("ring", "split_gather"), chunked attention, heads not dividing
  over sp, recurrent mixers (Qwen3-Next's Gated DeltaNet, Falcon-H1's Mamba: no state passing between
  chunks), non-causal models and implementations the mode cannot wrap (pure checks).
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
from meshboost.shardformer.context_checks import check_context
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model, tiny_config
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config, train_boosted, train_whole


def _config(family="llama", **overrides):
    config = moe_config(family) if family == "qwen3_moe" else tiny_config(family, **overrides)
    config.use_cache = False
    return config


def _ring(rank):
    """ring_attn: keys and values gathered, the zig-zag split; the same layouts, the same numbers."""
    config = _config(num_key_value_heads=2)
    batches = causal_batches(config, 2, batch=4, seq=16, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    for what, plugin_config in (("sp2 dp2", HybridParallelConfig(cp_size=2, cp_mode="ring_attn")),
                                ("sp4", HybridParallelConfig(cp_size=4, cp_mode="ring_attn")),
                                ("tp2 sp2", HybridParallelConfig(tp_size=2, cp_size=2, cp_mode="ring_attn")),
                                ("sp2 dp2 zero1", HybridParallelConfig(cp_size=2, cp_mode="ring_attn",
                                                                       zero=ZeroConfig(stage=1))),
                                ("sp2 dp2 zero3", HybridParallelConfig(cp_size=2, cp_mode="ring_attn",
                                                                       zero=ZeroConfig(stage=3)))):
        train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"llama ring_attn {what}")


def _layouts(rank):
    config = _config(num_key_value_heads=2)
    batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    for what, plugin_config in (("sp2 dp2", HybridParallelConfig(cp_size=2)),
                                ("sp4 (kv heads repeated)", HybridParallelConfig(cp_size=4)),
                                ("tp2 sp2", HybridParallelConfig(tp_size=2, cp_size=2)),
                                ("sp2 dp2 zero1", HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=1))),
                                ("sp2 dp2 zero2", HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=2))),
                                ("sp2 dp2 zero3", HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=3)))):
        booster, model, _ = train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"llama {what}")
        if what in ("tp2 sp2", "sp2 dp2 zero3"):   # zero3: FSDP2 shards over dp x cp, gathered on save            # one writer per stage: the cp ranks hold the same weights
            folder = os.path.join(tempfile.gettempdir(), f"meshboost_cp_{what[:3]}_{os.environ.get('MASTER_PORT', '0')}")
            booster.save_model(model, folder, shard=True)
            dist.barrier()
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            for n, p in reloaded.named_parameters():
                assert_close(p.detach(), ref_params[n].detach(), dtype=torch.float32, msg=f"reloaded {n}")
    config = _config("qwen2")
    batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    train_boosted(config, batches, HybridParallelConfig(cp_size=2), ref_losses, ref_params, "qwen2 sp2")
    # a mixture of experts: tp inside the experts with the sequence split, and experts split over ep while
    # the sequence is split over cp (expert gradients averaged over their replicas and the cp ranks)
    config = _config("qwen3_moe")
    batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    for what, plugin_config in (("tp2 sp2", HybridParallelConfig(tp_size=2, cp_size=2)),
                                ("sp2 ep2", HybridParallelConfig(cp_size=2, ep_size=2)),
                                ("ring_attn sp2 ep2 zero1", HybridParallelConfig(cp_size=2, ep_size=2, cp_mode="ring_attn",
                                                                                 zero=ZeroConfig(stage=1)))):
        train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"qwen3_moe {what}")
    # ColossalAI's keywords reach the same layout
    from meshboost.booster.plugin import HybridParallelPlugin as ColossalAIPlugin
    plugin = ColossalAIPlugin(tp_size=1, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
                              sp_size=2)
    assert (plugin.config.dims.cp, plugin.config.dims.cp_mode, plugin.sp_size) == (2, "all_to_all", 2)
    assert not plugin.config.sharding.enable_sequence_parallelism


def _pipeline(rank):
    """sp with pp: every stage holds this cp rank's piece of each micro-batch, the boundaries carry
    [B, S/sp, H], and the last stage reports the whole sequences' loss. 1F1B at sp=2 x pp=2 in both
    modes (ring_attn with ZeRO-1), and interleaved chunks with every layer recomputed in backward (the
    recomputation must mask with its own micro-batch's state while other micro-batches run); eval
    through the schedule returns whole-sequence logits; a criterion computing its own loss from the
    pieces is refused on every rank."""
    from meshboost.pipeline import PipelineConfig
    from meshboost.shardformer import PipelineGradientCheckpointConfig

    config = _config(num_key_value_heads=2, num_hidden_layers=4)
    batches = causal_batches(config, 2, batch=4, seq=8, seed=7)
    # micro-batches that mask differently: right padding (unequal tokens) in the first step, a packed row
    # (position_ids restarting, documents isolated) in the second
    batches[0]["attention_mask"] = torch.ones_like(batches[0]["input_ids"])
    batches[0]["attention_mask"][2, 5:] = 0
    batches[0]["labels"][2, 5:] = -100
    batches[1]["position_ids"] = torch.arange(8).repeat(4, 1)
    batches[1]["position_ids"][2] = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    ref_losses, ref_params = train_whole(config, batches)
    recompute = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    for what, plugin_config in (
            ("sp2 pp2", HybridParallelConfig(cp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2))),
            ("ring_attn sp2 pp2 zero1", HybridParallelConfig(cp_size=2, cp_mode="ring_attn", zero=ZeroConfig(stage=1),
                                                             pp_size=2, pipeline=PipelineConfig(num_microbatches=4))),
            ("sp2 pp2 interleaved, recomputed", HybridParallelConfig(
                cp_size=2, gradient_checkpoint=recompute,
                pp_size=2, pipeline=PipelineConfig(num_microbatches=4, num_model_chunks=2, pp_style="interleaved")))):
        model = build_causal_lm(config)
        if plugin_config.gradient_checkpoint is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        booster, model, _ = train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"llama {what}",
                                          model=model)
    ref = build_causal_lm(config)                      # the trained single-process weights
    ref.load_state_dict({n: p.detach() for n, p in ref_params.items()}, strict=False)
    ref.eval()
    with torch.no_grad():
        expected = ref(**batches[0])
    model.eval()
    got = booster.execute_pipeline(iter([batches[0]]), model, lambda out, inputs: out.loss, return_outputs=True)
    assert abs(got["loss"].item() - expected.loss.item()) < 1e-5, "pipeline eval loss"
    if booster.plugin.mesh.pp_rank == booster.plugin.pp_size - 1:
        real = batches[0]["attention_mask"].bool()
        assert torch.allclose(got["outputs"].logits[real], expected.logits[real], atol=1e-5), "pipeline eval logits"
    from torch.nn.functional import cross_entropy
    with pytest.raises(NotImplementedError, match="the criterion must return the model's own loss"):
        booster.execute_pipeline(iter([batches[0]]), model,
                                 lambda out, inputs: cross_entropy(out.logits.flatten(0, 1), inputs["labels"].flatten()))


def _compare(config, batch, mode, what, real=None):
    """Every rank fed `batch`: eval logits (of the `real` tokens) and loss, then the training loss and
    every gradient (averaged over dp x cp), as the unsharded model computes them. Returns the model."""
    ref = build_causal_lm(config)
    model = copy.deepcopy(ref)
    ref.eval()
    with torch.no_grad():
        expected = ref(**batch)
    ref.train()
    ref(**batch).loss.backward()
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(cp_size=2, cp_mode=mode)))
    model, *_ = booster.boost(model)
    model.eval()
    with torch.no_grad():
        got = model(**batch)
    real = torch.ones(batch["input_ids"].shape, dtype=torch.bool) if real is None else real
    assert got.logits.shape == expected.logits.shape, what
    assert torch.allclose(got.logits[real], expected.logits[real], atol=1e-5), what
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5, what
    model.train()
    model(**batch).loss.backward()
    reference = dict(ref.named_parameters())
    for n, p in model.unwrap().named_parameters():
        assert torch.allclose(p.grad, reference[n].grad, atol=1e-5), f"{what} grad {n}"
    return model


def _inputs(rank):
    """What users send, in both modes and with SDPA and eager: a right-padded batch, packed rows
    (position_ids restarting, no mask: transformers isolates the documents, and so must the split), a
    sliding-window model (Mistral, window 4 of 16 tokens)."""
    ids = torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    packed = dict(input_ids=ids, labels=ids, position_ids=torch.tensor([list(range(6)) + list(range(10))] * 2))
    for mode in ("all_to_all", "ring_attn"):
        for implementation in ("sdpa", "eager"):
            config = _config(num_key_value_heads=2)
            config._attn_implementation = implementation
            model = _compare(config, padded, mode, f"padded {implementation} {mode}", real=mask.bool())
            _compare(config, packed, mode, f"packed {implementation} {mode}")
        window = transformers.MistralConfig(**{**tiny_config("mistral").to_dict(), "sliding_window": 4,
                                                "use_cache": False})
        _compare(window, dict(input_ids=ids, labels=ids), mode, f"sliding window {mode}")
        # a length the split cannot cut: refused on every rank, before any collective
        multiple = 2 if mode == "all_to_all" else 4
        with pytest.raises(ValueError, match=f"sequence length 7 is not divisible by {multiple}"):
            model(input_ids=ids[:, :7], labels=ids[:, :7])


def _body(rank, world):
    _pipeline(rank)
    _layouts(rank)
    _ring(rank)
    _inputs(rank)


def test_context_parallel_all_to_all():
    spawn(_body, 4)


def test_context_parallel_refusals():
    for mode in ("ring", "split_gather"):         # the tp group's modes: named as such, listed nowhere else
        with pytest.raises(ValueError, match=f"sequence_parallelism_mode='{mode}' splits the sequence over the "
                                             "tensor-parallel group .* takes no cp_size"):
            HybridParallelConfig(cp_size=2, cp_mode=mode)
    with pytest.raises(ValueError, match="expected one of \\('all_to_all', 'ring_attn'\\)$"):
        HybridParallelConfig(cp_size=2, cp_mode="ulysses")
    with pytest.raises(ValueError, match="cp_mode='all_to_all' with cp_size=1 splits nothing"):
        HybridParallelConfig(cp_mode="all_to_all")
    with pytest.raises(ValueError, match="enable_sequence_parallelism=True \\(split_gather"):
        HybridParallelConfig(cp_size=2, sequence_parallel=True)
    from meshboost.booster.plugin.hybrid_parallel_plugin import _context
    with pytest.raises(ValueError, match="splits the sequence over the tensor-parallel ranks"):
        _context(dict(sp_size=2, sequence_parallelism_mode="split_gather", enable_sequence_parallelism=True, tp_size=1))
    llama = build_causal_lm(_config(num_key_value_heads=2))
    with pytest.raises(ValueError, match="4 attention heads over tp_size=1 leave 4 per rank, not divisible by cp_size=8"):
        check_context(llama, 8, 1)
    chunked = build_causal_lm(moe_config("llama4_text"))
    with pytest.raises(NotImplementedError, match="chunked or other attention layers"):
        check_context(chunked, 2, 1)
    from meshboost.shardformer.recurrent import recurrent_mixers, whole_mixers
    from meshboost.testing.tiny_configs import tiny_config as sweep_config
    for model_type in ("qwen3_next", "falcon_h1"):    # Gated DeltaNet; Mamba beside attention in every layer
        recurrent = build_causal_lm(sweep_config(model_type))
        # found by their decay, and (nothing split yet) reported whole, as the sweep's "ok (replicated: ...)" says
        assert whole_mixers(recurrent) == recurrent_mixers(recurrent) == [{"qwen3_next": "Qwen3NextGatedDeltaNet",
                                                                          "falcon_h1": "FalconH1Mixer"}[model_type]]
        with pytest.raises(NotImplementedError, match="recurrent mixers .* does not pass that state"):
            check_context(recurrent, 2, 1)
    with pytest.raises(NotImplementedError, match="causal LMs"):
        check_context(build_model("BertModel", tiny_config("bert")), 2, 1)
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(NotImplementedError, match="attn_implementation='flex_attention'"):
        check_context(llama, 2, 1)
    _state_with_inputs()


def _state_with_inputs():
    """A call's mask state travels with its inputs (issue 38): an attention call without its ContextCall is
    refused before any exchange, cutting a second batch leaves the first one's record as it was, and the
    attention function holds nothing of a call."""
    from meshboost.shardformer.context import CALL_KWARG, ContextInputs, install

    plain = build_causal_lm(_config(num_key_value_heads=2))
    attention = install(plain, None, 2, "sdpa")
    ids = torch.arange(8).view(1, 8) % plain.config.vocab_size
    with pytest.raises(RuntimeError, match="without the inputs' ContextCall"):
        plain(input_ids=ids)
    cut = ContextInputs(attention, 1, plain)
    first = cut.shard({"input_ids": ids, "attention_mask": torch.tensor([[1] * 6 + [0] * 2])})
    second = cut.shard({"input_ids": ids})
    assert first[CALL_KWARG].padding.tolist() == [[True] * 6 + [False] * 2] and second[CALL_KWARG].padding is None
    assert first[CALL_KWARG].positions.tolist() == [4, 5, 6, 7] and first["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert set(vars(attention)) == {"group", "size", "inner_name", "inner"}
