"""Data-parallel DataLoader construction: every plugin samples over its mesh's dp axis only."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def _seed_worker(base_seed: int):
    def init(worker_id: int) -> None:
        seed = base_seed + worker_id
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)
    return init


def build_dataloader(dataset: Dataset, batch_size: int, num_replicas: int, rank: int, shuffle: bool = False,
                     seed: int = 1024, drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                     **kwargs) -> DataLoader:
    """A DataLoader whose DistributedSampler splits `dataset` over `num_replicas` (the data-parallel
    replicas only: tensor- and pipeline-parallel ranks of one replica get the same samples).

    `set_epoch` on `loader.sampler` reshuffles per epoch, as with torch's DistributedSampler.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    for forbidden in ("sampler", "batch_sampler"):
        if forbidden in kwargs:
            raise ValueError(f"prepare_dataloader builds its own data-parallel sampler; do not pass {forbidden}=")
    size = len(dataset) if hasattr(dataset, "__len__") else None
    if size is not None and size < num_replicas:
        effect = "some replicas get no sample" if drop_last else "samples are repeated to give every replica one"
        warnings.warn(f"the dataset has {size} samples for {num_replicas} data-parallel replicas: {effect}; use a "
                      "larger dataset or fewer data-parallel ranks", stacklevel=3)
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                      num_workers=num_workers, worker_init_fn=_seed_worker(seed + rank * max(num_workers, 1)),
                      **kwargs)
