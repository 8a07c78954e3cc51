"""ColossalAI's `checkpoint_io`: `CheckpointIO` and `GeneralCheckpointIO`, as views of the Booster's
checkpoint methods.

In ColossalAI a plugin hands the Booster a CheckpointIO and the Booster's save/load calls go to it. In
meshboost one writer does every save for every layout (`meshboost.checkpoint`), reached through the
Booster, so a CheckpointIO here is the Booster's checkpoint half with ColossalAI's method names and
keywords: `CheckpointIO(booster)` saves and loads with that booster's plugin and mesh (any layout;
the files are HF folders and name-keyed optimizer states, loadable at any other layout), and
`GeneralCheckpointIO()` is the one for a model boosted without a plugin (or not boosted: one process,
every tensor whole), ColossalAI's GeneralCheckpointIO.

Refused, naming what to use: ColossalAI's per-format hooks (`save_sharded_model`, `load_unsharded_optimizer`,
...), which a subclass would override to change how files are written: meshboost's writer is not
pluggable (`booster.save_model(shard=True)` writes the sharded form, `shard=False` the single file).
"""

from __future__ import annotations

from meshboost.booster import Booster
from meshboost.booster.checkpoint_view import CheckpointIO

__all__ = ["CheckpointIO", "GeneralCheckpointIO"]


class GeneralCheckpointIO(CheckpointIO):
    """ColossalAI's single-process checkpoint IO: a `CheckpointIO` over a Booster without a plugin (every
    tensor whole; a plain model, or one boosted by `Booster()`)."""

    def __init__(self):
        super().__init__(Booster())
