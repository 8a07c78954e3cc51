"""ColossalAI's CheckpointIO over a Booster: `Booster.checkpoint_io`, and `meshboost.checkpoint_io`'s
`CheckpointIO` (compat/checkpoint_io.py re-exports it with `GeneralCheckpointIO`).

In ColossalAI a plugin hands the Booster a CheckpointIO and the Booster's save/load calls go to it. In
meshboost one writer does every save for every layout (`meshboost.checkpoint`), reached through the
Booster, so this CheckpointIO is the Booster's checkpoint half with ColossalAI's method names and
keywords: `CheckpointIO(booster)` saves and loads with that booster's plugin and mesh (any layout; the
files are HF folders and name-keyed optimizer states, loadable at any other layout).

Owns: the forwarding and the refusal of ColossalAI's per-format hooks (`save_sharded_model`,
`load_unsharded_optimizer`, ...), which a subclass would override to change how files are written:
meshboost's writer is not pluggable. Must not write anything itself.
"""

from __future__ import annotations

__all__ = ["CheckpointIO"]

_FORMAT_HOOKS = ("save_sharded_model", "save_unsharded_model", "load_sharded_model", "load_unsharded_model",
                 "save_sharded_optimizer", "save_unsharded_optimizer", "load_sharded_optimizer",
                 "load_unsharded_optimizer")


class CheckpointIO:
    """ColossalAI's checkpoint interface over `booster`'s save_model / load_model / save_optimizer /
    load_optimizer / save_lr_scheduler / load_lr_scheduler (the same keywords, checked there)."""

    def __init__(self, booster):
        # booster.py imports this module: a Booster is recognised by its checkpoint methods, not its class
        if not all(callable(getattr(booster, m, None)) for m in ("save_model", "load_model", "save_optimizer")):
            raise TypeError(f"CheckpointIO(booster) needs a meshboost Booster, got {type(booster).__name__}; "
                            "use GeneralCheckpointIO() for a model boosted without a plugin")
        self.booster = booster

    def save_model(self, model, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        self.booster.save_model(model, checkpoint, shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                size_per_shard=size_per_shard, use_safetensors=use_safetensors, use_async=use_async)

    def load_model(self, model, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1):
        """Load in place; returns `model`, as ColossalAI's does."""
        self.booster.load_model(model, checkpoint, strict=strict, low_cpu_mem_mode=low_cpu_mem_mode,
                                num_threads=num_threads)
        return model

    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: str | None = None, size_per_shard: int = 1024, use_async: bool = False) -> None:
        """`optimizer` must come from `booster.boost` (its states are keyed by its model's names)."""
        self.booster.save_optimizer(optimizer, checkpoint, shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                    size_per_shard=size_per_shard, use_async=use_async)

    def load_optimizer(self, optimizer, checkpoint: str, prefix: str | None = None, low_cpu_mem_mode: bool = True,
                       num_threads: int = 1) -> None:
        if prefix is not None:
            raise NotImplementedError(f"load_optimizer(prefix={prefix!r}): meshboost's optimizer files name their "
                                      "own shards (the index says where each state is); drop prefix")
        self.booster.load_optimizer(optimizer, checkpoint, low_cpu_mem_mode=low_cpu_mem_mode, num_threads=num_threads)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.booster.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.booster.load_lr_scheduler(lr_scheduler, checkpoint)

    def __getattr__(self, name: str):
        # Only reached for names the class lacks: ColossalAI's per-format hooks get a message, not "no attribute".
        if name in _FORMAT_HOOKS:
            raise NotImplementedError(
                f"CheckpointIO.{name} is not a hook in meshboost: one writer saves every layout "
                "(meshboost.checkpoint); call save_model / load_model / save_optimizer / load_optimizer "
                "(booster.save_model(..., shard=True) for the sharded form)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
