"""ZeRO-3 across a pipeline step: when FSDP2 gathers a stage's weights and reduce-scatters its gradients.

Owns: `StepSharding`, what a pipeline schedule calls at the start and the end of one step when the
stage's model is sharded by FSDP2 (`fully_shard` over the data-parallel ranks of the stage). A
pipeline step runs many forwards and backwards of the same units (one per micro-batch), and FSDP2 on
its own would reduce-scatter every unit's gradient after each backward and reshard after it. So, as
torch's own pipelining does (torch.distributed.pipelining.stage: `backward_maybe_with_nosync` and
`perform_reduce_grad`), the step starts with gradient synchronisation and resharding after backward
off (gradients accumulate unreduced in the gathered parameters' `.grad`), and ends by running every
unit's post-backward with them on: one reduce-scatter per unit and step, then the weights are
resharded. With `reshard_after_forward=False` (the pipeline default) a unit's first forward
all-gathers its weights and they stay gathered until the step ends: one all-gather per unit and step.

A stage's forward ends by an exception raised in a hook (pipeline/run.py), so the root unit's
post-forward does not run on a stage that is not the last, and its pre-backward is never hooked: the
explicit post-backward at the end is what reduces the root's gradients there, and FSDP2's final
callback (which resets its per-iteration state) is run by hand for the same reason.
Must not know about schedules, micro-batches or ties: the schedule calls `begin` and `finish`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from meshboost.fsdp.wrap import reshard_all


@dataclass
class StepSharding:
    """The FSDP2 root of one pipeline rank's stages (`model`, sharded by `apply_fsdp`)."""

    model: nn.Module

    def begin(self, training: bool) -> None:
        """Before the step's first unit: keep gradients unreduced and weights gathered through backward."""
        if training:
            self._set(last=False)

    def finish(self, training: bool) -> None:
        """After the step's last unit: reduce-scatter every gradient once (averaged over the unit's mesh)
        and reshard every unit; a forward-only step just reshards (nothing is left gathered that an
        optimizer step or a checkpoint would read stale)."""
        if not training:
            # a stage that is not the last never ran its root's post-forward (module docstring): the root stays
            # in its forward state, where reshard() keeps the gathered weights (reshard_after_forward=False), and
            # its next forward skips the root's pre-forward. FSDP2's reset for an aborted forward ends both.
            reset = getattr(self.model, "reset_iter_state", None)       # torch >= 2.13
            if reset is not None:
                reset()
            reshard_all(self.model)
            return
        self._set(last=True)
        # FSDP2's own post-backward per parameter group (idempotent, a no-op for a group with no
        # gradient), then its root callback; torch's pipelining calls the same two (see the module docstring).
        state = fully_shard.state(self.model)
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def _set(self, last: bool) -> None:
        root: FSDPModule = self.model
        root.set_is_last_backward(last)
        root.set_reshard_after_backward(last)
        root.set_requires_gradient_sync(last)
