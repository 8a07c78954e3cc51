"""Checkpoint IO: HF-format model saving and loading at any layout (model_io.py, load.py),
topology-free optimizer and LR-scheduler states (optimizer_io.py), all written by one sharded,
atomic writer (writer.py), and training checkpoints: one step folder committed by an atomic
pointer (step_io.py), every file's size and crc32 in its manifest (file_log.py, manifest.py),
saved synchronously or by a writer thread (async_save.py). Booster glue lives in `meshboost.booster.checkpoint_io`."""

from meshboost.checkpoint.atomic import AtomicTarget
from meshboost.checkpoint.load import load_model
from meshboost.checkpoint.model_io import checkpoint_entries, save_model
from meshboost.checkpoint.optimizer_io import load_lr_scheduler, load_optimizer, save_lr_scheduler, save_optimizer
from meshboost.checkpoint.writer import CheckpointWriter, save_roles

__all__ = ["save_model", "load_model", "checkpoint_entries", "save_optimizer", "load_optimizer", "save_lr_scheduler",
           "load_lr_scheduler", "CheckpointWriter", "AtomicTarget", "save_roles"]
