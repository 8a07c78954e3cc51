"""ColossalAI's `test_shard_gpt2::test_gpt2` ring_attn configurations (issue 56 item 3), renamed, in one 4-rank
process group, each against the unsharded single-process model from the same weights and the same call:

(a) the narrowed case, fp32: GPT-2 built with eager attention (ColossalAI's zoo builds it so), a right-padded
    batch, `enable_all_optimization=True` at sp=2 x dp=2 in both context modes: loss, every gradient and every
    weight after one AdamW step equal the unsharded eager model's, and the context-parallel attention wraps the
    SDPA the kernel switch chose. Before: the switch moved the model to SDPA after context parallelism had been
    planned around eager, so no layer called the context-parallel attention and each rank attended within its
    own piece of the sequence (ring_attn: loss 4.838398 against 4.839800, silently; all_to_all alike);
(b) a LazyInitContext copy of a model with tied embeddings at pp=2: the last stage's LM head starts from the
    embedding's values, as in the materialised original (before: from its own unit's seed, up to 0.119 off on
    the zoo's GPT-2, which alone made config 0's loss 6.9508 against the unsharded 7.1049, even at sp=1);
(c) ColossalAI's configs 0 (pp=2 x sp=2, 2 micro-batches) and 1 (tp=2 x sp=2), fp16 with initial_scale=1, lazy
    init, every optimization, the zoo's GPT-2 and padded batch, through ColossalAI's keywords: loss, the gradients
    of the layers ColossalAI checks (gathered) and every held weight after one Adam step, within the fp16
    tolerance (ColossalAI's own 5e-3).
And, without a process group: the context-parallel attention wraps what the model runs when installed, and is
refused where no layer would call it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin as ColossalAIPlugin
from meshboost.lazy import LazyInitContext
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.shardformer import ShardConfig
from meshboost.shardformer.context import install
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import gathered

RING, ULYSSES = "ring_attn", "all_to_all"


def _zoo_config(**overrides) -> transformers.GPT2Config:
    """ColossalAI's tests/kit/model_zoo/transformers/gpt.py config (eager attention, tied embeddings)."""
    settings = dict(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, attn_pdrop=0, embd_pdrop=0, resid_pdrop=0,
                    summary_first_dropout=0, pad_token_id=1022, tie_word_embeddings=True,
                    attn_implementation="eager")
    return transformers.GPT2Config(**{**settings, **overrides})


def _zoo_batch(rows: int = 1) -> dict:
    """The zoo's `data_gen_for_lm`: 8 tokens right-padded to 12, padding unlabelled; `rows` copies."""
    ids = torch.tensor([[22, 11, 616, 4, 5, 13, 318, 345] + [0] * 4])
    mask = torch.tensor([[1] * 8 + [0] * 4])
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return {k: v.repeat(rows, 1) for k, v in batch.items()}


# -- (a) eager GPT-2, every optimization, context parallelism, fp32 ------------------------------------------
def _check_eager_optimized(rank: int) -> None:
    config = _zoo_config(n_embd=32, vocab_size=128, pad_token_id=None)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 8:], mask[1, 10:] = 0, 0                    # right padding, unequal per replica
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    for mode in (RING, ULYSSES):
        torch.manual_seed(0)
        ref = transformers.GPT2LMHeadModel(copy.deepcopy(config))
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        plugin = HybridParallelPlugin(HybridParallelConfig(cp_size=2, cp_mode=mode,
                                                           sharding=ShardConfig(enable_all_optimization=True)))
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, opt)
        what = f"eager GPT-2, all optimizations, {mode} sp=2 x dp=2"
        expected = ref(**batch).loss
        expected.backward()
        mine = {k: v.chunk(plugin.mesh.dp_size)[plugin.mesh.dp_rank] for k, v in batch.items()}
        loss = model(**mine).loss
        booster.backward(loss, opt)
        got = loss.detach().clone()
        torch.distributed.all_reduce(got, group=plugin.mesh.dp_group)       # the replicas' mean: the batch's
        assert abs(got.item() / plugin.mesh.dp_size - expected.item()) <= LOSS_ATOL[torch.float32], \
            f"{what}: loss {got.item() / plugin.mesh.dp_size} vs {expected.item()}"
        reference = dict(ref.named_parameters())
        for n, p in model.unwrap().named_parameters():
            assert_close(p.grad, reference[n].grad, msg=f"{what} grad {n}")
        ref_opt.step()
        opt.step()
        for n, p in model.unwrap().named_parameters():
            assert_close(p.detach(), reference[n].detach(), msg=f"{what} weight after AdamW {n}")
        assert model.context.attention.inner_name == "sdpa", f"{what}: cp wraps the SDPA the kernel switch chose"


# -- (b) a lazy copy with tied embeddings, cut into pipeline stages ------------------------------------------
def _lazy_copy(config):
    """ColossalAI's build_model_from_hybrid_plugin with use_lazy_init: (materialised original, lazy copy)."""
    ctx = LazyInitContext()
    with ctx:
        org = transformers.GPT2LMHeadModel(copy.deepcopy(config))
        model = copy.deepcopy(org)
    ctx.materialize(org)
    return org, model


def _check_lazy_tied_stages(rank: int) -> None:
    org, model = _lazy_copy(_zoo_config(n_embd=32, vocab_size=128, pad_token_id=None))
    booster = Booster(plugin=ColossalAIPlugin(tp_size=1, pp_size=2, num_microbatches=2))
    model, *_ = booster.boost(model)
    reference = dict(org.named_parameters(remove_duplicate=False))
    held = dict(model.unwrap().named_parameters(remove_duplicate=False))
    assert held, "every stage holds weights"
    for n, p in held.items():
        assert torch.equal(p.detach(), reference[n].detach()), f"pp=2, lazy: {n} differs from the original's"


# -- (c) ColossalAI's configs 0 and 1 -----------------------------------------------------------------------
CONFIGS = {"cfg0 pp2 sp2": dict(sp_size=2, tp_size=1, pp_size=2, num_microbatches=2),
           "cfg1 tp2 sp2": dict(sp_size=2, tp_size=2, pp_size=1, num_microbatches=1)}
CHECKED = ("transformer.h.0.mlp.c_fc", "transformer.wte", "transformer.h.0.mlp.c_proj", "transformer.h.0.ln_1",
           "transformer.h.0.ln_2")            # ColossalAI's col, row and norm layers of test_shard_gpt2


def _check_colossalai_configs(rank: int) -> None:
    half = torch.float16
    for what, layout in CONFIGS.items():
        org, model = _lazy_copy(_zoo_config())
        org_opt = torch.optim.Adam(org.parameters(), lr=1e-3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        plugin = ColossalAIPlugin(**layout, enable_sequence_parallelism=True, sequence_parallelism_mode=RING,
                                  enable_all_optimization=True, precision="fp16", initial_scale=1)
        booster = Booster(plugin=plugin)
        model, opt, criterion, *_ = booster.boost(model, opt, lambda outputs: outputs["loss"])
        batch = _zoo_batch(4 if plugin.stage_manager is not None else 1)
        if plugin.stage_manager is not None:
            loss = booster.execute_pipeline(iter([dict(batch)]), model, lambda outputs, inputs: criterion(outputs),
                                            opt, return_loss=True)["loss"]
        else:
            loss = criterion(model(**batch))
            opt.backward(loss)
        expected = criterion(org(**batch))
        expected.backward()
        if plugin.stage_manager is None or plugin.stage_manager.is_last_stage():
            assert abs(loss.item() - expected.item()) <= LOSS_ATOL[half], f"{what}: loss {loss.item()} vs {expected.item()}"
        reference = dict(org.named_parameters(remove_duplicate=False))
        held = dict(model.unwrap().named_parameters())
        for n, p in held.items():
            if n.rpartition(".")[0] in CHECKED:
                assert_close(gathered(p, p.grad), reference[n].grad, dtype=half, msg=f"{what} grad {n}")
        org_opt.step()
        opt.step()
        for n, p in held.items():
            assert_close(gathered(p), reference[n].detach(), dtype=half, msg=f"{what} weight after Adam {n}")


def _body(rank: int, world: int) -> None:
    _check_eager_optimized(rank)
    _check_lazy_tied_stages(rank)
    _check_colossalai_configs(rank)


def test_colossalai_gpt2_ring_attn():
    spawn(_body, 4)


def test_context_attention_reaches_the_model():
    """The context-parallel attention is installed around what the model runs when it is installed (after the
    kernel switch), and refused where no layer would call it: before, an implementation the model no longer ran
    matched nothing and every layer kept attending within its own piece, silently."""
    model = transformers.GPT2LMHeadModel(_zoo_config(n_embd=32, vocab_size=128, pad_token_id=None))
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="no module of GPT2LMHeadModel runs attn_implementation='eager'"):
        install(model, None, 2, "eager")
    attention = install(model, None, 2)
    assert attention.inner_name == "sdpa" and model.config._attn_implementation.startswith("meshboost_ulysses")
