"""The frozen reference model of a preference objective, on the policy's mesh.

Owns: `boost_reference` (the reference boosted by the policy's own booster with no optimizer: sharded like the
policy by the same plugin, so its vocab shards, sequence pieces and replicas line up with the policy's; frozen
before boost, so no gradient, no optimizer state, no ZeRO bucket and no DDP reducer is ever built for it; eval
mode) and `adapters_disabled` (with LoRA the reference is the policy's own base weights: peft's
`disable_adapter()`, no second copy). Must not reach into a plugin's internals.
"""

from __future__ import annotations

import contextlib

import torch


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
