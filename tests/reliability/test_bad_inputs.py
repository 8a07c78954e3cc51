"""Bad or unlucky inputs end as a clear error on every rank (or as exact numbers), never as a silent
wrong number or a hang: one process group of 4 ranks runs the whole matrix (issue 11).

- ids / labels outside the vocabulary at tp = 2 and 4: IndexError naming the value, where the
  unsharded model raises too; GPT-2 fed more positions than its n_positions: IndexError naming the
  limit, before any collective.
- `load_optimizer` from another model: refused naming the parameter and shapes, nothing changed
  (zero_stage 0 and 1, fp16 with masters).
- ranks that disagree on the plugin configuration: ValueError naming the setting and each rank's
  value, on every rank, in well under a second.
- `ShardConfig()` without a group shards over the world and its layers communicate over the world:
  the same loss and gradients as the unsharded model.
- tp ranks fed different batches: ValueError on the first call, naming the fix.
- fp16: `loss.backward()` instead of `booster.backward` raises at `step()` on every rank with the
  weights unchanged; NaN inputs skip, then raise after `max_skips_at_min_scale` skips at the floor.
- re-boosting a sharded model and an optimizer built on another model are refused clearly; a failed
  save tells the ranks that did not write what failed; a dataset smaller than dp warns.
- untied input/output embeddings (Llama, `tie_word_embeddings=False`) save and resume bitwise
  (fp32) at the same layout, the two weights keeping their own Adam state.
- expert parallelism: ep_size not dividing dp or the experts, ep on a dense model, an expert id out of
  range on one ep rank, one replica fed an empty batch (refused on every data-parallel rank); context
  parallelism: cp_size not dividing the world, a sequence length the split cannot cut, cp ranks fed
  different batches; HSDP: dp_replicate_size not dividing dp (or, with ep, dp / ep), below 1, with ZeRO-1/2 or
  cpu_offload.
- recurrent mixers split by heads: their bad layouts (key heads or groups tp does not divide, with ep too,
  context parallelism) live with them in tests/shardformer/test_mixers.py.
- ZeRO-3: `reshard_after_forward` without zero_stage=3, a module mixing expert and dense weights under ep.
- LoRA: enable_lora twice, an adapter folder whose rank or target modules differ from its weights, and
  at tp=2 adapters the layout cannot shard exactly (on the vocab-parallel embedding, modules_to_save on
  the LM head, DoRA, lora_dropout on a column under sequence parallelism), lora_dropout with context
  parallelism.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import gathered, model_loss
from meshboost.testing.models import VOCAB, build_model, tiny_batch, tiny_config


def _boost(cls, family, plugin, seed=0, **overrides):
    model = build_model(cls, tiny_config(family, **overrides), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _ids_and_labels_out_of_range(rank, world):
    for tp in (2, 4):
        plugin = HybridParallelPlugin(tp_size=tp)
        _, model, _ = _boost("GPT2LMHeadModel", "gpt2", plugin)
        ids = torch.randint(1, VOCAB, (2, 8))
        bad_ids = ids.clone()
        bad_ids[1, 3] = VOCAB + 5                       # held by no rank: would embed as zeros
        with pytest.raises(IndexError, match=rf"token ids must lie in \[0, {VOCAB}\).*found {VOCAB + 5}"):
            model(input_ids=bad_ids, labels=ids)
        bad_labels = ids.clone()
        bad_labels[0, 2] = VOCAB                        # the padded rows would give a plausible loss
        with pytest.raises(IndexError, match=rf"labels must be -100 \(ignored\) or lie in \[0, {VOCAB}\)"):
            model(input_ids=ids, labels=bad_labels)
        with pytest.raises(IndexError):                 # the unsharded model refuses it too
            build_model("GPT2LMHeadModel", tiny_config("gpt2"))(input_ids=bad_ids)
        # issue 37 item 8: past n_positions the unsharded model raises a bare "index out of range in self"
        limit = model.unwrap().config.n_positions
        long = torch.randint(1, VOCAB, (2, limit + 1))
        with pytest.raises(IndexError, match=rf"a sequence of {limit + 1} tokens runs past the model's learned "
                                             rf"absolute position embeddings \(config.n_positions={limit}"):
            model(input_ids=long, labels=long)
        with pytest.raises(IndexError, match=rf"position id {limit} runs past .*config.n_positions={limit}"):
            model(input_ids=ids, position_ids=torch.arange(limit - 7, limit + 1).expand(2, 8))
        assert model(input_ids=long[:, :limit], labels=long[:, :limit]).loss.isfinite()     # at the limit: runs


def _optimizer_from_another_model(rank, world, root):
    for i, extra in enumerate((dict(zero_stage=0), dict(zero_stage=1), dict(zero_stage=1, precision="fp16"))):
        plugin = HybridParallelPlugin(tp_size=2, **extra)
        booster, model, opt = _boost("GPT2LMHeadModel", "gpt2", plugin)
        booster.backward(model(**_lm_batch()).loss, opt)
        opt.step(), opt.zero_grad()
        path = os.path.join(root, f"gpt2-{i}.bin")
        booster.save_optimizer(opt, path)
        # The same family at another width: every name exists, the shapes differ (also untied ones).
        other_plugin = HybridParallelPlugin(tp_size=2, **extra)
        other_booster, other, other_opt = _boost("GPT2LMHeadModel", "gpt2", other_plugin, n_embd=64, n_inner=128)
        before = {n: gathered(p).clone() for n, p in other.unwrap().named_parameters()}
        with pytest.raises(ValueError, match=r"has shape .* the parameter is .*another model"):
            other_booster.load_optimizer(other_opt, path)
        after = {n: gathered(p) for n, p in other.unwrap().named_parameters()}
        assert all(torch.equal(before[n], after[n]) for n in before), f"{extra}: a refused load changed weights"
        assert not len(other_opt.unwrap().state), f"{extra}: a refused load left optimizer state behind"


def _lm_batch(seed=0, batch=4):
    ids = tiny_batch("GPT2LMHeadModel", tiny_config("gpt2"), batch=batch, seed=seed)["input_ids"]
    return {"input_ids": ids, "labels": ids.clone()}


def _disagreeing_configuration(rank, world):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"tp_size is 2 on rank 0, 1 on rank 1"):
        HybridParallelPlugin(tp_size=2 if rank == 0 else 1)
    with pytest.raises(ValueError, match=r"precision is 'fp16' on rank 0, 'fp16' on rank 1, 'fp32' on rank 2"):
        HybridParallelPlugin(tp_size=1, precision="fp32" if rank >= 2 else "fp16")
    assert time.perf_counter() - start < 5, "disagreement must be reported at once, not after a timeout"


def _shard_config_default_group(rank, world):
    config = tiny_config("gpt2")
    ref = build_model("GPT2LMHeadModel", copy.deepcopy(config))
    par = build_model("GPT2LMHeadModel", copy.deepcopy(config))
    ShardFormer(ShardConfig()).optimize(par)                         # no group: the world (4 ranks)
    assert get_tp_info(par.transformer.h[0].mlp.c_fc.weight).tp_size == world
    batch = tiny_batch("GPT2LMHeadModel", config)
    ref_loss, _ = model_loss(ref, batch)
    par_loss, _ = model_loss(par, batch)
    assert abs(ref_loss.item() - par_loss.item()) <= 1e-5, f"ShardConfig(): {par_loss.item()} vs {ref_loss.item()}"
    ref_loss.backward(), par_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        assert_close(gathered(p, p.grad), ref_params[name].grad, msg=f"ShardConfig() grad {name}")


def _tp_ranks_fed_different_batches(rank, world):
    plugin = HybridParallelPlugin(tp_size=2)
    _, model, _ = _boost("GPT2LMHeadModel", "gpt2", plugin)
    with pytest.raises(ValueError, match=r"tensor-parallel ranks .* were fed different inputs.*prepare_dataloader"):
        model(**_lm_batch(seed=rank))                   # each rank its own batch: a world-wide sampler's mistake
    plugin = HybridParallelPlugin(tp_size=2)
    _, model, _ = _boost("GPT2LMHeadModel", "gpt2", plugin)
    model(**_lm_batch(seed=plugin.mesh.dp_rank))        # the same batch within each tp group: fine


def _fp16_traps(rank, world):
    plugin = HybridParallelPlugin(tp_size=2, precision="fp16")
    booster, model, opt = _boost("GPT2LMHeadModel", "gpt2", plugin)
    before = [p.detach().clone() for p in model.unwrap().parameters()]
    loss = model(**_lm_batch()).loss
    if rank == 3:
        loss.backward()                                 # one rank forgets the loss scale
    else:
        booster.backward(loss, opt)
    with pytest.raises(RuntimeError, match="booster.backward"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.unwrap().parameters())), "weights changed"

    plugin = HybridParallelPlugin(tp_size=2, precision="fp16", initial_scale=4, min_scale=1, hysteresis=1,
                                  max_skips_at_min_scale=3)
    booster, model, opt = _boost("GPT2LMHeadModel", "gpt2", plugin)
    embedding = model.unwrap().transformer.wte
    embedding.register_forward_hook(lambda m, i, out: out * float("nan"))      # non-finite inputs
    with pytest.raises(FloatingPointError, match=r"skipped 3 steps in a row at the minimum loss scale 1"):
        for _ in range(10):
            booster.backward(model(**_lm_batch()).loss, opt)
            opt.step(), opt.zero_grad()
    assert opt.get_loss_scale() == 1


def _messages(rank, world, root):
    plugin = HybridParallelPlugin(tp_size=2)
    original = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    Booster(plugin=plugin).boost(original)
    with pytest.raises(ValueError, match="already sharded"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(original)
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    stranger = torch.optim.AdamW(build_model("GPT2LMHeadModel", tiny_config("gpt2")).parameters())
    with pytest.raises(ValueError, match="not GPT2LMHeadModel's"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(model, stranger)

    # A save that cannot be written: the writing rank raises the OS error, every other rank quotes it.
    booster, model, _ = _boost("GPT2LMHeadModel", "gpt2", HybridParallelPlugin(tp_size=2))
    blocker = os.path.join(root, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    target = os.path.join(blocker, "ckpt")               # below a file: no folder can be made there
    if rank == 0:
        with pytest.raises(OSError, match="cannot write a checkpoint"):
            booster.save_model(model, target, shard=True)
    else:
        with pytest.raises(RuntimeError, match=r"failed on rank 0: .*cannot write a checkpoint"):
            booster.save_model(model, target, shard=True)

    with pytest.warns(UserWarning, match="3 samples for 4 data-parallel replicas"):
        HybridParallelPlugin(tp_size=1).prepare_dataloader(TensorDataset(torch.arange(3)), batch_size=1)


def _untied_embeddings_resume(rank, world, root):
    """Llama with tie_word_embeddings=False (the class still lists lm_head in _tied_weights_keys)."""
    config = tiny_config("llama")
    assert config.tie_word_embeddings is False
    batches = [{"input_ids": b["input_ids"], "labels": b["input_ids"].clone()}
               for b in (tiny_batch("LlamaForCausalLM", config, batch=4, seed=s) for s in range(5))]
    for precision in ("fp32", "fp16"):
        plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, precision=precision)
        mine = lambda b: {k: v.chunk(plugin.dp_size)[plugin.mesh.dp_rank] for k, v in b.items()}  # noqa: E731

        def run(booster, model, opt, steps):
            out = []
            for b in steps:
                loss = model(**mine(b)).loss
                booster.backward(loss, opt)
                opt.step(), opt.zero_grad()
                out.append(loss.item())
            return out

        booster, model, opt = _boost("LlamaForCausalLM", "llama", plugin)
        run(booster, model, opt, batches[:3])
        booster.save_model(model, os.path.join(root, f"m-{precision}"), shard=True)
        booster.save_optimizer(opt, os.path.join(root, f"o-{precision}"), shard=True)
        expected = run(booster, model, opt, batches[3:])
        embed = model.unwrap().model.embed_tokens.weight
        head = model.unwrap().lm_head.weight
        assert embed is not head

        booster2, model2, opt2 = _boost("LlamaForCausalLM", "llama", HybridParallelPlugin(
            tp_size=2, zero_stage=1, precision=precision), seed=7)
        booster2.load_model(model2, os.path.join(root, f"m-{precision}"))
        booster2.load_optimizer(opt2, os.path.join(root, f"o-{precision}"))
        got = run(booster2, model2, opt2, batches[3:])
        assert got == expected, f"untied {precision}: resumed losses {got} vs uninterrupted {expected}"
        for name, p in model.unwrap().named_parameters():
            q = dict(model2.unwrap().named_parameters())[name]
            assert torch.equal(gather_tensor(p.detach(), get_tp_info(p)), gather_tensor(q.detach(), get_tp_info(q))), \
                f"untied {precision}: {name} differs after resuming"


def _expert_and_context_layouts(rank, world):
    """Expert and context parallelism's bad inputs, each a clear error on every rank before any
    collective (or, for a bad expert id on one ep rank, on every rank of its ep group before tokens are
    exchanged: the flag rides with the per-expert counts)."""
    from meshboost.plugins import HybridParallelConfig
    from meshboost.plugins import HybridParallelPlugin as CorePlugin
    from meshboost.testing.moe import build_causal_lm, moe_config

    with pytest.raises(ValueError, match="ep_size=3 does not divide the data-parallel size 4"):
        CorePlugin(HybridParallelConfig(ep_size=3))
    with pytest.raises(ValueError, match="ep_size=4 does not divide the 6 experts"):
        Booster(plugin=CorePlugin(HybridParallelConfig(ep_size=4))).boost(
            build_causal_lm(moe_config("qwen3_moe", num_experts=6)))
    with pytest.raises(ValueError, match="has no mixture-of-experts layer"):
        Booster(plugin=CorePlugin(HybridParallelConfig(ep_size=2))).boost(
            build_model("LlamaForCausalLM", tiny_config("llama")))
    model, *_ = Booster(plugin=CorePlugin(HybridParallelConfig(ep_size=2))).boost(
        build_causal_lm(moe_config("qwen3_moe")))
    experts = next(m for m in model.unwrap().modules() if type(m).__name__.endswith("Experts"))
    bad = 4 if model.mesh.ep_rank == 1 else 2                        # only ep rank 1 routes outside
    with pytest.raises(ValueError, match=r"ep rank\(s\) \[1\] routed a token to an expert id outside the 4 experts"):
        experts(torch.randn(3, 64), torch.tensor([[0, bad], [1, 2], [3, 0]]), torch.full((3, 2), 0.5))
    # issue 37 item 5: a replica fed 0 rows failed inside transformers and left its ep peers to gloo's
    # "Connection closed by peer"; now every data-parallel rank raises, naming the empty replica
    ids = torch.randint(1, model.unwrap().config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    rows = ids[:0] if rank == 1 else ids
    with pytest.raises(ValueError, match=r"ep_size=2: the batch of data-parallel replica\(s\) \[1\] \(global ranks "
                                         r"\[1\]\) is empty"):
        model(input_ids=rows, labels=rows)
    # context parallelism: a world the cp ranks cannot divide, a length the split cannot cut, cp ranks
    # fed different batches
    with pytest.raises(ValueError, match=r"tp_size x pp_size x cp_size = 1 x 1 x 3 = 3; launch a multiple of 3"):
        CorePlugin(HybridParallelConfig(cp_size=3))
    config = tiny_config("llama")
    config.use_cache = False
    model, *_ = Booster(plugin=CorePlugin(HybridParallelConfig(cp_size=2, cp_mode="ring_attn"))).boost(
        build_causal_lm(config))
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 4 \(cp_size=2, ring_attn; "
                                         r"ColossalAI's sp_size\)"):
        model(input_ids=ids, labels=ids)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(model.mesh.cp_rank))
    with pytest.raises(ValueError, match="context-parallel"):
        model(input_ids=ids, labels=ids)


def _hsdp_layouts(rank, world):
    """HSDP's bad layouts (dp_replicate_size): each a clear error naming the value and the fix, on every rank,
    before any collective but the argument agreement (the world is 4: dp = 4 without tp)."""
    from meshboost.booster.plugin import MoeHybridParallelPlugin

    rows = [
        (dict(dp_replicate_size=3, zero_stage=3), ValueError,
         r"dp_replicate_size=3 does not divide the data-parallel size 4;.*choose a divisor of 4"),
        (dict(dp_replicate_size=2, tp_size=2, sp_size=2, zero_stage=3, enable_sequence_parallelism=True,
              sequence_parallelism_mode="all_to_all"), ValueError, "dp_replicate_size=2 does not divide the "
         "data-parallel size 1"),
        (dict(dp_replicate_size=0, zero_stage=3), ValueError, "dp_replicate_size=0 must be a positive integer"),
        (dict(dp_replicate_size=2, zero_stage=1), NotImplementedError, "dp_replicate_size=2 with zero_stage=1.*use "
         "zero_stage=3"),
        (dict(dp_replicate_size=2, zero_stage=3, cpu_offload=True), NotImplementedError,
         "dp_replicate_size=2 with cpu_offload=True.*drop cpu_offload"),
    ]
    for kwargs, error, match in rows:
        with pytest.raises(error, match=match):
            HybridParallelPlugin(**{"tp_size": 1, **kwargs})
    # with ep the replica groups split the experts' replicas too (edp = dp / ep = 2 here)
    with pytest.raises(ValueError, match=r"dp_replicate_size=4 does not divide the experts' data-parallel size 2 "
                                         r".*choose a dp_replicate_size dividing 2"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=3, dp_replicate_size=4)


def _lora_inputs(rank, world, root):
    """LoRA's bad inputs, each a clear error on every rank before any collective: enable_lora twice, an
    adapter folder whose rank or target modules differ from its weights (peft alone warns and trains
    fresh adapters in their place), and at tp=2 the adapters the layout cannot shard exactly (an
    adapter on the vocab-parallel embedding or in modules_to_save on the LM head, DoRA, lora_dropout on
    a column under sequence parallelism)."""
    import json

    peft = pytest.importorskip("peft")

    def llama():
        return build_model("LlamaForCausalLM", tiny_config("llama"), seed=0)

    def config(**kwargs):
        return peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **kwargs})

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    wrapped = booster.enable_lora(llama(), lora_config=config())
    with pytest.raises(ValueError, match="already has peft adapters; call booster.enable_lora once"):
        booster.enable_lora(wrapped, lora_config=config())
    folders = {what: os.path.join(root, f"adapter_{what}") for what in ("rank", "targets")}
    if rank == 0:
        for what, folder in folders.items():
            peft.get_peft_model(llama(), config()).save_pretrained(folder)
            with open(os.path.join(folder, "adapter_config.json")) as fh:
                saved = json.load(fh)
            saved.update({"r": 8} if what == "rank" else {"target_modules": ["q_proj", "k_proj", "v_proj"]})
            with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
                json.dump(saved, fh)
    dist.barrier()
    with pytest.raises(ValueError, match="its weights do not fit the adapters its config builds"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).enable_lora(llama(), pretrained_dir=folders["rank"])
    with pytest.raises(ValueError, match=r"its config builds '.*k_proj.lora_A.weight', which its weights lack"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).enable_lora(llama(), pretrained_dir=folders["targets"])
    cases = [
        (dict(target_modules=["embed_tokens", "q_proj"]), {}, "input embedding is wrapped by peft"),
        (dict(modules_to_save=["lm_head"]), {}, "LM head is wrapped by peft"),
        (dict(use_dora=True), {}, "uses the DoraLinearVariant variant"),
        (dict(lora_dropout=0.1), dict(enable_sequence_parallelism=True), "lora_dropout=0.1 on a column-parallel"),
    ]
    cases.append((dict(lora_dropout=0.1), dict(sp_size=2, enable_sequence_parallelism=True,
                                               sequence_parallelism_mode="all_to_all"),
                  "lora_dropout=0.1 with cp_size=2: every context-parallel rank would draw the same mask"))
    for lora_kwargs, plugin_kwargs, match in cases:
        booster = Booster(plugin=HybridParallelPlugin(**{"tp_size": 2, **plugin_kwargs}))
        model = booster.enable_lora(llama(), lora_config=config(**lora_kwargs))
        with pytest.raises(NotImplementedError, match=match):
            booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _zero3_layouts(rank, world):
    """ZeRO-3 with pp and ep (issue 40): FSDP2's reshard_after_forward without zero_stage=3, and a module
    holding expert weights beside dense ones (FSDP2 shards a module's own weights over one mesh), each
    raised on every rank before any collective."""
    from meshboost.distributed.param_info import EXPERT, GradReduction, set_grad_reduction
    from meshboost.fsdp.wrap import replica_units
    from meshboost.optim import ZeroConfig
    from meshboost.plugins import HybridParallelConfig
    from meshboost.plugins import HybridParallelPlugin as CorePlugin

    with pytest.raises(ValueError, match="reshard_after_forward=False is FSDP2's setting, but zero_stage=1; set "
                                         "zero_stage=3"):
        HybridParallelConfig(zero=ZeroConfig(stage=1), reshard_after_forward=False)
    mesh = CorePlugin(HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=3))).mesh
    mixed = torch.nn.Module()
    mixed.experts, mixed.dense = torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(4))
    set_grad_reduction(mixed.experts, GradReduction(EXPERT))
    with pytest.raises(NotImplementedError, match=r"zero_stage=3: Module holds parameters averaged over different "
                                                  r"mesh axes \[\('dp',\), \('edp',\)\]"):
        replica_units(mixed, mesh, set())


def _body(rank, world, root):
    _lora_inputs(rank, world, root)
    _ids_and_labels_out_of_range(rank, world)
    _optimizer_from_another_model(rank, world, root)
    _disagreeing_configuration(rank, world)
    _shard_config_default_group(rank, world)
    _tp_ranks_fed_different_batches(rank, world)
    _fp16_traps(rank, world)
    _messages(rank, world, root)
    _untied_embeddings_resume(rank, world, root)
    _expert_and_context_layouts(rank, world)
    _zero3_layouts(rank, world)
    _hsdp_layouts(rank, world)


def test_bad_inputs_end_in_clear_errors(tmp_path):
    spawn(_body, 4, str(tmp_path))
