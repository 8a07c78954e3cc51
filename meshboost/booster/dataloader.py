"""Data-parallel DataLoaders that can resume mid-epoch: every plugin samples over its mesh's dp
axis only.

Owns: `ResumableSampler` (torch's DistributedSampler that can skip the first samples of an epoch)
and `ResumableDataLoader` (counts the batches it has handed out this epoch; `state_dict` /
`load_state_dict` carry the epoch and that count into a training checkpoint). The count is taken
where the user receives a batch, so worker prefetching never makes it run ahead.
"""

from __future__ import annotations

import itertools
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


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose next epoch can start after its first `skip` samples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.skip = 0          # a resumed position only holds for the epoch it was saved in
        super().set_epoch(epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableSampler` that knows how far into the epoch its user is. Its own
    generator, reseeded from (seed, epoch) at each iteration, draws the workers' base seed, so
    loading data never consumes the global random stream and a resumed epoch seeds its workers as
    the uninterrupted one did."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = seed
        self.batches_done = 0       # batches handed out in the sampler's current epoch

    def __iter__(self):
        self.batches_done = self.sampler.skip // self.batch_size
        self.generator.manual_seed(self.seed * 1_000_003 + self.sampler.epoch)
        for batch in super().__iter__():
            self.batches_done += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position: the next iteration (of that epoch) starts after the batches
        already done, so keep calling `sampler.set_epoch` with the saved epoch (`loader.sampler.epoch`)."""
        self.sampler.set_epoch(int(state["epoch"]))
        self.sampler.skip = int(state["batches_done"]) * self.batch_size
        self.batches_done = int(state["batches_done"])


def build_dataloader(dataset: Dataset, batch_size: int, num_replicas: int, rank: int, shuffle: bool = False,
                     seed: int = 1024, drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                     **kwargs) -> DataLoader:
    """A DataLoader whose DistributedSampler splits `dataset` over `num_replicas` (the data-parallel
    replicas only: tensor- and pipeline-parallel ranks of one replica get the same samples).

    `set_epoch` on `loader.sampler` reshuffles per epoch, as with torch's DistributedSampler; the
    loader's position is saved by `booster.save_checkpoint(..., dataloader=loader)`.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    for forbidden in ("sampler", "batch_sampler", "generator"):
        if forbidden in kwargs:
            raise ValueError(f"prepare_dataloader builds its own data-parallel sampler and generator (seeded from "
                             f"seed=); do not pass {forbidden}=")
    size = len(dataset) if hasattr(dataset, "__len__") else None
    if size is not None and size < num_replicas:
        effect = "some replicas get no sample" if drop_last else "samples are repeated to give every replica one"
        warnings.warn(f"the dataset has {size} samples for {num_replicas} data-parallel replicas: {effect}; use a "
                      "larger dataset or fewer data-parallel ranks", stacklevel=3)
    sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                               pin_memory=pin_memory, num_workers=num_workers, seed=seed,
                               worker_init_fn=_seed_worker(seed + rank * max(num_workers, 1)),
                               generator=torch.Generator(), **kwargs)
