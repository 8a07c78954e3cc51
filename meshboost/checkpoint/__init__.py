"""Checkpoint IO: HF-format model saving (gather and unpad tensor-parallel shards, atomic writes) and
topology-free optimizer / LR-scheduler checkpoints (optimizer_io.py; Booster glue in booster_io.py)."""

from meshboost.checkpoint.booster_io import load_lr_scheduler, save_lr_scheduler
from meshboost.checkpoint.hf_format import AtomicTarget, plan_files
from meshboost.checkpoint.model_io import checkpoint_entries, save_model
from meshboost.checkpoint.optimizer_io import load_optimizer, save_optimizer

__all__ = ["save_model", "checkpoint_entries", "plan_files", "AtomicTarget", "save_optimizer", "load_optimizer",
           "save_lr_scheduler", "load_lr_scheduler"]
