"""Training a boosted model against one process, for the FSDP2 compositions' tests (ZeRO-3 with pp and ep,
HSDP): the one-process reference run, one data-parallel step returning the global batch's token-mean loss,
the whole of a sharded tensor, and the check of losses, the first step's gradients and global norm, clipped
norms and last weights."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshboost.booster import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import HybridParallelPlugin
from meshboost.testing.compare import gradients_checked, train_reference
from meshboost.testing.tolerance import assert_close
from meshboost.testing.moe import EPS, LR


def whole(tensor: torch.Tensor, param) -> torch.Tensor:
    """The whole of a parameter-shaped tensor: FSDP2's shards gathered (a collective over the
    parameter's mesh), then the tp and ep shards by its record."""
    local = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    return gather_tensor(local, get_tp_info(param)).float()


def reference_run(model, batches, max_norm=0.0):
    """One process on the whole batches: (losses, first step's gradients (`StepGradients`: by every name,
    GPT-2's LM head is its embedding and a pipeline's last stage holds it as lm_head), weights after the
    last step, each step's gradient norm before clipping to `max_norm` when > 0)."""
    ref = train_reference(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), batches, max_norm)
    weights = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    return ref.losses, ref.first, weights, ref.norms if max_norm else []


def dp_step(booster, plugin, model, opt, batch) -> float:
    """One step on this replica's share of `batch` (opt None: a forward-only pipeline step); returns the
    global batch's token-mean loss."""
    mesh = plugin.mesh
    mine = {k: v.chunk(mesh.dp_size)[mesh.dp_rank] for k, v in batch.items()}
    if plugin.pp_size > 1:      # each replica reports its own token mean: weigh it by its tokens
        loss = booster.execute_pipeline(iter([mine]), model, lambda out, _: out.loss, opt)["loss"]
        items = (mine["labels"][:, 1:] != -100).sum().float()
        pair = torch.stack([loss.detach().float() * items, items])
    else:                       # normalised by the global token count / dp: the replicas' mean is the loss
        loss = model(**mine).loss
        booster.backward(loss, opt)
        pair = torch.stack([loss.detach().float(), torch.ones(())])
    dist.all_reduce(pair, group=mesh.dp_group)
    return (pair[0] / pair[1]).item()


def boost(config, model, plugin=None):
    plugin = plugin or HybridParallelPlugin(config)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))
    return plugin, booster, model, opt


def check_held(got: dict, want: dict, what: str, dtype=torch.float32) -> None:
    """`got` (this rank's names) against `want`; every name of `want` is held by some rank."""
    for name, tensor in got.items():
        assert_close(tensor, want[name].float(), dtype=dtype, msg=f"{what}: {name}")
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(got))
    held = set().union(*map(set, names))
    assert held <= set(want) and len(held) >= len({id(t) for t in want.values()}), f"{what}: {set(want) - held}"


def whole_weights(model) -> dict:
    return {n: whole(p, p) for n, p in model.unwrap().named_parameters()}


def train_and_check(config, make_model, batches, ref, what, plugin=None, dtype=torch.float32):
    """Boost a fresh model under `config` (or `plugin`), train on `batches` and check losses, the first
    step's gradients and the last weights against `ref` = `reference_run(...)`. Returns the boosted run."""
    ref_losses, ref_grads, ref_weights, ref_norms = ref
    plugin, booster, model, opt = boost(config, make_model(), plugin)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if plugin.pp_size > 1:      # an evaluation step first: it leaves nothing gathered that training would misuse
        got = dp_step(booster, plugin, model, None, batches[0])
        assert abs(got - ref_losses[0]) <= tol * abs(ref_losses[0]), f"{what} eval: {got} vs {ref_losses[0]}"
    for step, batch in enumerate(batches):
        got = dp_step(booster, plugin, model, opt, batch)
        assert abs(got - ref_losses[step]) <= tol * abs(ref_losses[step]), f"{what} step {step}: {got} vs " \
                                                                            f"{ref_losses[step]}"
        with gradients_checked(model, opt, ref_grads, f"{what} step 0", dtype) if step == 0 \
                else contextlib.nullcontext():      # every gradient and the global norm, the fp16 scale divided out
            opt.step()
        opt.zero_grad()
        if ref_norms:               # clipped: the global norm over stages, shards and ties, as one process's
            assert ref_norms[step] > plugin.config.precision.max_norm, f"{what}: the case must clip"
            assert abs(opt.get_grad_norm() - ref_norms[step]) <= 1e-5 * ref_norms[step], \
                f"{what} step {step}: grad norm {opt.get_grad_norm()} vs {ref_norms[step]}"
    check_held(whole_weights(model), ref_weights, f"{what} weight", dtype)
    return plugin, booster, model, opt
