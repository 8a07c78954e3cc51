"""ModelWrapper, the boosted model a plugin returns from `boost`: it marks what was boosted and
gives one place to unwrap it. The boosted optimizer's base, `OptimizerWrapper`, lives in
`meshboost.optim` (re-exported by `meshboost.booster`). Neither holds parallel logic."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshboost.distributed.ownership import WeakAttribute


class ModelWrapper(nn.Module):
    """A boosted model: `forward` delegates; `unwrap()` returns the user's (sharded) model."""

    # the optimizer `Booster.boost` paired with it (checkpoints need both); held weakly both ways, so a
    # model and optimizer the user drops are freed at once, and either one dropped alone is freed too
    boosted_optimizer = WeakAttribute()

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        inner = self.module
        # DistributedDataParallel keeps the model under `.module` too.
        while isinstance(inner, (ModelWrapper, torch.nn.parallel.DistributedDataParallel)):
            inner = inner.module
        return inner


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's (sharded) HF model inside booster/DDP wrappers (a plain model as it is)."""
    if isinstance(model, ModelWrapper):
        return model.unwrap()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model
