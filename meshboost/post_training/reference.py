"""The frozen reference model of a preference objective, on the policy's mesh.

Owns: `boost_reference` (the reference boosted by the policy's own booster with no optimizer: sharded like the
policy by the same plugin, so its vocab shards, sequence pieces and replicas line up with the policy's; frozen
before boost, so no gradient, no optimizer state, no ZeRO bucket and no DDP reducer is ever built for it; eval
mode), `adapters_disabled` (with LoRA the reference is the policy's own base weights: peft's
`disable_adapter()`, no second copy) and `check_reference` (a reference boosted with another layout than the
policy is refused: under pp its log-probs would sit on other ranks than the policy's loss, and no other
pairing of layouts is checked against one process). Must not reach into a plugin's internals.
"""

from __future__ import annotations

import contextlib

import torch

from meshboost.plugins.hybrid_parallel import HybridParallelModule


def boost_reference(booster, model: torch.nn.Module):
    """`model` frozen and boosted by `booster` for inference only (the boosted wrapper, in eval mode). Call it
    with the same booster (the same plugin and layout) as the policy."""
    model.requires_grad_(False)
    boosted, *_ = booster.boost(model)
    boosted.eval()
    return boosted


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Inside: `model` (a boosted peft model) runs its base weights, no gradient; the adapters come back after."""
    from peft import PeftModel

    peft = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft is None:
        raise TypeError(f"{type(model).__name__} holds no peft model: adapters_disabled is the LoRA reference "
                        "(pass a reference model built with boost_reference otherwise)")
    with peft.disable_adapter(), torch.no_grad():
        yield model


def check_reference(policy: torch.nn.Module, reference) -> None:
    """Refuse (alike on every rank: it reads the layouts only, before any collective) a reference whose
    log-probs would not line up with the policy's: boosted with other dims (dp, pp, tp, cp, ep), or, under
    pipeline stages, not boosted at all."""
    if reference is None or isinstance(reference, str):
        return
    mine = policy.mesh.dims if isinstance(policy, HybridParallelModule) else None
    theirs = reference.mesh.dims if isinstance(reference, HybridParallelModule) else None
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"the reference model was boosted with {theirs}, the policy with {mine}: its log-probs would "
                         "not line up with the policy's rows and stages. Boost it with the policy's booster: "
                         "boost_reference(booster, reference_model)")
    if mine is not None and mine.pp > 1 and theirs is None:
        raise ValueError(f"with pp_size={mine.pp} the reference must be boosted like the policy (its log-probs are "
                         "read on the policy's last stage): boost_reference(booster, reference_model)")
