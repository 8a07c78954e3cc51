"""HybridParallelPlugin through the Booster against single-process training: a 10-step run at
tp=2 (per-step losses within 1e-5), tp=2 x dp=2 on the combined batch, each with the first step's
reduced gradients (gathered) and global norm against one process's, dp-only data sampling, and
the configuration errors."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import HybridParallelPlugin, TorchDDPPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import gradients_checked, train_reference
from meshboost.testing.models import build_model, tiny_config, token_batches

STEPS = 10


def _fresh(cls, config, lr):
    """A model, its AdamW and its lr schedule (1 / (1 + step)): the same for one process and the boosted run."""
    model = build_model(cls, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-4)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _reference(cls, config, batches, lr):
    """One process on the whole batches (`Reference`: losses, first step's gradients, model)."""
    model, opt, sched = _fresh(cls, config, lr)
    return train_reference(model, opt, batches, scheduler=sched)


def _train_boosted(cls, config, batches_for_me, lr, plugin, first, where):
    """Boosted training on this rank's batches; the first step's reduced gradients and global norm
    checked against `first` (one process's)."""
    model, opt, sched = _fresh(cls, config, lr)
    booster = Booster(plugin=plugin)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    losses = []
    for step, b in enumerate(batches_for_me):
        loss = model(**b).loss
        booster.backward(loss, opt)
        with gradients_checked(model, opt, first, where) if step == 0 else contextlib.nullcontext():
            opt.step()
        opt.zero_grad(), sched.step()
        # the loss reported to the user: mean over data-parallel replicas
        t = loss.detach().clone()
        dist.all_reduce(t, group=plugin.mesh.dp_group)
        losses.append(t.item() / plugin.dp_size)
    return losses, model


def _compare_weights(boosted, ref, where):
    inner = boosted.unwrap()
    ref_params = dict(ref.named_parameters())
    for n, p in inner.named_parameters():
        assert_close(gather_tensor(p.detach(), get_tp_info(p)), ref_params[n].detach(), msg=f"{where} weight {n}")


def _tp2_body(rank, world):
    """World 2: tp=2, dp=1; 10 steps of GPT-2 and Llama causal LM and BERT classification."""
    plugin = HybridParallelPlugin(tp_size=2)
    for cls, family in (("GPT2LMHeadModel", "gpt2"), ("LlamaForCausalLM", "llama")):
        config = tiny_config(family)
        batches = token_batches(config, STEPS, batch=4, seed=3, attention_mask=True)
        ref = _reference(cls, config, batches, lr=1e-3)
        losses, boosted = _train_boosted(cls, config, batches, 1e-3, plugin, ref.first, f"{cls} tp=2 step 0")
        for step, (a, b) in enumerate(zip(losses, ref.losses)):
            assert abs(a - b) <= 1e-5, f"{cls} tp=2 step {step}: loss {a} vs single-process {b}"
        _compare_weights(boosted, ref.model, f"{cls} tp=2 after {STEPS} steps")

    # A configuration error is raised identically on every rank, before any collective.
    with pytest.raises(ValueError, match="world_size=2 is not divisible by tp_size x pp_size x cp_size = 4 x 1 x 1"):
        HybridParallelPlugin(tp_size=4)
    with pytest.raises(ValueError, match="precision='fp8'"):
        HybridParallelPlugin(tp_size=2, precision="fp8")
    # Boosting an unknown model fails with the supported families listed.
    with pytest.raises(ValueError, match="custom_policy"):
        bad = torch.nn.Sequential(torch.nn.Linear(2, 2))
        Booster(plugin=plugin).boost(bad)

    # TorchDDPPlugin: plain data parallelism over all ranks equals single-process on the combined batch.
    config = tiny_config("gpt2")
    batches = token_batches(config, 3, batch=4, seed=3, attention_mask=True)
    ref = _reference("GPT2LMHeadModel", config, batches, 1e-3)
    mine = [{k: v.chunk(world)[rank] for k, v in b.items()} for b in batches]
    losses, boosted = _train_boosted("GPT2LMHeadModel", config, mine, 1e-3, TorchDDPPlugin(), ref.first,
                                     "TorchDDPPlugin dp=2 step 0")
    _compare_weights(boosted, ref.model, "TorchDDPPlugin dp=2")


def _tp2dp2_body(rank, world):
    """World 4: tp=2 x dp=2. Each dp replica gets half of every batch; the result equals one
    process training on the combined batch (DDP averages over dp; tp ranks see the same data)."""
    plugin = HybridParallelPlugin(tp_size=2)
    assert (plugin.mesh.dp_size, plugin.mesh.tp_size) == (2, 2)

    # prepare_dataloader samples over dp only: both tp ranks of a replica see the same batch.
    ds = TensorDataset(torch.arange(16))
    loader = plugin.prepare_dataloader(ds, batch_size=2, shuffle=True, seed=7)
    mine = torch.cat([b[0] for b in loader])
    seen = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine)
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3]), "tp ranks must share the batch"
    assert sorted(torch.cat([seen[0], seen[2]]).tolist()) == list(range(16)), "dp replicas must split the data"

    for cls, family in (("LlamaForCausalLM", "llama"), ("BertForSequenceClassification", "bert")):
        config = tiny_config(family)
        batches = token_batches(config, 4, batch=4, seed=3, attention_mask=True)
        if cls.startswith("Bert"):
            for b in batches:
                b["labels"] = b["input_ids"][:, 0] % 2
        ref = _reference(cls, config, batches, 1e-3)
        mine = [{k: v.chunk(plugin.dp_size)[plugin.mesh.dp_rank] for k, v in b.items()} for b in batches]
        losses, boosted = _train_boosted(cls, config, mine, 1e-3, plugin, ref.first, f"{cls} tp=2 x dp=2 step 0")
        for step, (a, b) in enumerate(zip(losses, ref.losses)):
            assert abs(a - b) <= 1e-5, f"{cls} tp=2 x dp=2 step {step}: loss {a} vs combined-batch {b}"
        _compare_weights(boosted, ref.model, f"{cls} tp=2 x dp=2")


def test_tp2_matches_single_process():
    spawn(_tp2_body, 2)


def test_tp2_dp2_matches_combined_batch():
    spawn(_tp2dp2_body, 4)
