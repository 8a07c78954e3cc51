"""ColossalAI's `interface` package: the types `Booster.boost` returns.

`ModelWrapper` is `meshboost.booster.ModelWrapper` (every plugin's boosted model is one; `unwrap()` gives
the user's model), `OptimizerWrapper` is `meshboost.optim.OptimizerWrapper` (every boosted optimizer is
one), the same classes (`is`), so `isinstance` checks in ColossalAI scripts and tests hold.
`AMPModelMixin` is ColossalAI's marker for models with fp16 masters; `pretrained` holds the
pretrained-path helpers.
"""

from meshboost.booster import ModelWrapper
from meshboost.optim import OptimizerWrapper


class AMPModelMixin:
    """ColossalAI's mixin for models whose optimizer keeps fp32 masters. `update_master_params()` does
    nothing here: meshboost's optimizers refresh their masters themselves when a model is loaded
    (`booster.load_model`)."""

    def update_master_params(self) -> None:
        """Nothing to do (see the class docstring)."""


__all__ = ["ModelWrapper", "OptimizerWrapper", "AMPModelMixin"]
