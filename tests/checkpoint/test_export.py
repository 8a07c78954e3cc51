"""booster.export_weights streams the full HF tensors from any layout, in one spawn of 4 (fp32, tiny models):

* tp=2 (vocab padding), GPT-2 at tp=2 ZeRO-2 (fused c_attn split over tp, Conv1D, tied head), pp=2 (stage 1's buckets travel to rank 0), dp=4 ZeRO-1 and ZeRO-3 (FSDP2), HSDP
  (2 replicas x 2 shards), cp=2 (Ulysses), ep=2 and ep=2 x tp=2 on a tiny Qwen3-MoE, and tp=2 ZeRO-1 in bf16 with fp32
  masters: rank 0 receives exactly `save_model`'s tensors (names in state-dict order, values bitwise, fp32
  masters when asked for fp32), which equal the unsharded model's; the other ranks yield nothing; a
  requested dtype is the saved tensor cast; a plain HF model fed with `load_into` gives the reference's
  logits bitwise and the boosted forward's within tolerance;
* LoRA at tp=2 ZeRO-1, pp=2 and ZeRO-3 over dp=4: merged equals peft's `merge_and_unload` of the same unsharded peft model bitwise (the
  training model untouched), adapters equal `save_lora_as_pretrained`'s file bitwise;
* delta mode after one AdamW step with frozen layers sends exactly the tensors whose values changed (no frozen
  one), then nothing; the consumer updated by it matches the boosted model;
* bad inputs, on every rank: a bucket smaller than the largest tensor; an export called on ranks 0 and 1
  only (they raise after the timeout naming ranks 2 and 3, which raise the same when they call late, once the
  callers have raised: no sleep races the timeout under load), after
  which exports work again; a consumer on rank 0 that closes the stream after one tensor (the other ranks
  still gathering) hangs no rank, and the next delta export sends everything.
"""

import copy
import os

import peft
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from meshboost import Booster
from meshboost.checkpoint import checkpoint_entries
from meshboost.checkpoint.export import load_into
from meshboost.distributed import comm
from meshboost.booster.plugin import HybridParallelPlugin, MoeHybridParallelPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model, tiny_config
from meshboost.testing.moe import build_causal_lm, moe_config

LLAMA = "LlamaForCausalLM"
CONTEXT = dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
IDS = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(3))


def _export(booster, model, **kwargs):
    pairs = [(n, t.detach().cpu().clone()) for n, t in booster.export_weights(model, **kwargs)]
    if dist.get_rank() != 0:
        assert pairs == [], "only global rank 0 receives"
    return pairs


def _saved(booster, model, path):
    booster.save_model(model, path, shard=False, use_safetensors=True)
    return load_file(os.path.join(path, "model.safetensors")) if dist.get_rank() == 0 else None


def _logits(model, booster=None):
    """Logits over the whole vocabulary (a tp model's vocab-parallel shards gathered, the padding dropped)."""
    with torch.no_grad():
        logits = model(input_ids=IDS).logits.float()
    if booster is not None and booster.plugin.tp_size > 1:
        logits = comm.all_gather(logits.contiguous(), booster.plugin.tp_group, dim=-1)
    return logits[..., :model.unwrap().config.vocab_size] if booster is not None else logits


def _check_layout(what, root, kwargs, make, bucket_bytes, forward=True, dtype=None, low=torch.bfloat16,
                  plugin=HybridParallelPlugin):
    """Boost `make()`'s model at `kwargs`; its export (in `dtype`) equals save_model's file and the unsharded
    model; the export with dtype=`low` is that cast to bf16."""
    ref = make()
    expected = {n: t.detach() for n, t in checkpoint_entries(ref).items()}
    booster = Booster(plugin=plugin(**kwargs))
    model = make()
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    pairs = _export(booster, model, bucket_bytes=bucket_bytes, dtype=dtype)
    cast = _export(booster, model, bucket_bytes=bucket_bytes, dtype=low)
    saved = _saved(booster, model, os.path.join(root, what.replace(" ", "_")))
    boosted = _logits(model, booster) if forward else None
    if dist.get_rank() == 0:
        assert [n for n, _ in pairs] == list(expected), what
        for n, t in pairs:
            assert t.dtype == saved[n].dtype and torch.equal(t, saved[n]), f"{what}: {n} differs from save_model's"
            assert torch.equal(t, expected[n].to(t.dtype)), f"{what}: {n} differs from the unsharded model's"
        assert len(cast) == len(pairs), what
        for (n, t), (_, full) in zip(cast, pairs):
            assert t.dtype == torch.bfloat16 and torch.equal(t, full.to(torch.bfloat16)), f"{what}: {n} bf16"
        consumer = make()
        for p in consumer.parameters():
            p.data.normal_()                         # nothing of the consumer's own weights may survive
        load_into(consumer, pairs, strict=True)
        assert torch.equal(_logits(consumer), _logits(ref)), what
        if boosted is not None:
            assert_close(_logits(consumer), boosted, msg=f"{what}: consumer vs boosted forward")


def _llama():
    return build_model(LLAMA, tiny_config("llama"))


def _gpt2():
    return build_model("GPT2LMHeadModel", tiny_config("gpt2"))


def _moe():
    return build_causal_lm(moe_config("qwen3_moe"))


def _layouts(root):
    bucket = 101 * 32 * 4              # the embedding's bytes: the smallest bucket allowed, many buckets
    _check_layout("tp2", root, dict(tp_size=2), _llama, bucket)
    _check_layout("gpt2 tp2 zero2", root, dict(tp_size=2, zero_stage=2), _gpt2, 2 * bucket)   # fused c_attn, tied
    _check_layout("pp2", root, dict(tp_size=1, pp_size=2, num_microbatches=1), _llama, 3 * bucket, forward=False)
    _check_layout("zero1 dp4", root, dict(tp_size=1, zero_stage=1), _llama, bucket)
    _check_layout("zero3 dp4", root, dict(tp_size=1, zero_stage=3), _llama, 2 * bucket)
    _check_layout("hsdp 2x2", root, dict(tp_size=1, zero_stage=3, dp_replicate_size=2), _llama, bucket)
    _check_layout("cp2", root, dict(tp_size=1, **CONTEXT), _llama, bucket, forward=False)
    _check_layout("ep2", root, dict(tp_size=1, pp_size=1, ep_size=2, zero_stage=1), _moe, 1 << 20,
                  plugin=MoeHybridParallelPlugin)
    _check_layout("ep2 tp2", root, dict(tp_size=2, pp_size=1, ep_size=2, zero_stage=1), _moe, 1 << 20,
                  plugin=MoeHybridParallelPlugin)
    # fp32 masters of bf16 weights: fp32 is save_model's (the masters), the default the working weights
    _check_layout("tp2 zero1 bf16", root, dict(tp_size=2, zero_stage=1, precision="bf16"), _llama, bucket,
                  forward=False, dtype=torch.float32, low=None)


def _lora(root):
    for what, kwargs in (("tp2 zero1", dict(tp_size=2, zero_stage=1)),
                         ("pp2", dict(tp_size=1, pp_size=2, num_microbatches=1)),
                         ("zero3 dp4", dict(tp_size=1, zero_stage=3))):
        _lora_layout(root, what, kwargs)


def _lora_layout(root, what, kwargs):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             init_lora_weights=False)          # B random: the merge is not the base
    booster = Booster(plugin=HybridParallelPlugin(**kwargs))
    model = booster.enable_lora(_llama(), lora_config=config)
    ref = copy.deepcopy(model)
    model, *_ = booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    merged = _export(booster, model, bucket_bytes=1 << 20)
    adapters = _export(booster, model, bucket_bytes=1 << 20, lora="adapters")
    path = os.path.join(root, "lora_" + what.replace(" ", "_"))
    booster.save_lora_as_pretrained(model, path, use_safetensors=True)
    boosted = _logits(model, booster) if booster.plugin.pp_size == 1 else None
    if dist.get_rank() == 0:
        saved = load_file(os.path.join(path, "adapter_model.safetensors"))
        assert [n for n, _ in adapters] and {n for n, _ in adapters} == set(saved)
        for n, t in adapters:
            assert torch.equal(t, saved[n]), f"lora {what}: adapter {n}"
        expected = checkpoint_entries(copy.deepcopy(ref).merge_and_unload())
        assert [n for n, _ in merged] == list(expected), what
        for n, t in merged:
            assert torch.equal(t, expected[n]), f"lora {what}: merged {n} differs from peft's merge_and_unload"
        consumer = _llama()
        load_into(consumer, merged, strict=True)
        assert_close(_logits(consumer), _logits(ref), msg=f"lora {what}: merged consumer vs unmerged peft model")
        if boosted is not None:
            assert_close(_logits(consumer), boosted, msg=f"lora {what}: merged consumer vs boosted LoRA forward")
    assert not any(getattr(m, "merged", False) for m in model.modules()), "the training model was merged"


def _delta(root):
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, zero_stage=1))
    model = _llama()
    frozen = {n for n, p in model.named_parameters() if "embed" in n or ".layers.0." in n}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                            lr=1e-2))
    first = _export(booster, model, bucket_bytes=1 << 20, delta=True)
    ids = IDS.chunk(2)[booster.plugin.mesh.dp_rank]
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    opt.zero_grad()
    second = _export(booster, model, bucket_bytes=1 << 20, delta=True)
    third = _export(booster, model, bucket_bytes=1 << 20, delta=True)
    full = _export(booster, model, bucket_bytes=1 << 20)
    boosted = _logits(model, booster)
    if dist.get_rank() == 0:
        before, now = dict(first), dict(full)
        assert list(before) == list(now) == list(checkpoint_entries(_llama()))
        changed = [n for n in now if not torch.equal(now[n], before[n])]
        assert changed and not set(changed) & frozen, changed
        assert [n for n, _ in second] == changed, "delta sends exactly the changed tensors"
        assert third == [], "nothing changed since the last export"
        consumer = _llama()
        load_into(consumer, first, strict=True)
        load_into(consumer, second)
        for n, t in checkpoint_entries(consumer).items():
            assert torch.equal(t, now[n]), n
        assert_close(_logits(consumer), boosted, msg="consumer after the delta vs boosted forward")


def _bad_inputs(root):
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model, *_ = booster.boost(_llama())
    with pytest.raises(ValueError, match=r"bucket_bytes=1000\): model.embed_tokens.weight takes 12928 bytes"):
        list(booster.export_weights(model, bucket_bytes=1000))
    rank = dist.get_rank()
    callers = dist.new_group([0, 1])                 # every rank creates it; ranks 0 and 1 start together
    store = dist.distributed_c10d._get_default_store()
    if rank >= 2:                                    # late: only once the callers have given up on them
        store.wait(["test_export/callers_done"])
    else:
        dist.barrier(group=callers)
    with pytest.raises(RuntimeError, match=r"called on ranks \[0, 1\] only: ranks \[2, 3\] did not call it"):
        list(booster.export_weights(model, timeout=5.0))
    if rank == 0:
        store.set("test_export/callers_done", "1")
    dist.barrier()
    pairs = booster.export_weights(model, bucket_bytes=1 << 14, delta=True)
    if rank == 0:                                    # the consumer stops after one tensor: nobody hangs
        assert next(pairs)[0] == "model.embed_tokens.weight"
        pairs.close()
    else:
        assert list(pairs) == []
    assert len(_export(booster, model, delta=True)) == (len(checkpoint_entries(_llama())) if rank == 0 else 0), \
        "a delta export after an abandoned one sends everything"
    assert len(_export(booster, model)) == (len(checkpoint_entries(_llama())) if rank == 0 else 0)


def _body(rank, world, root):
    _layouts(root)
    _lora(root)
    _delta(root)
    _bad_inputs(root)


def test_export_weights(tmp_path):
    spawn(_body, 4, str(tmp_path))
