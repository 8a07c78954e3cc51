"""Data-parallel DataLoaders that can resume mid-epoch: every plugin samples over its mesh's dp
axis only.

Owns: `ResumableSampler` (torch's DistributedSampler that can skip the first samples of an epoch;
`set_start_index` is ColossalAI's examples' name for that skip)
and `ResumableDataLoader` (counts the batches it has handed out this epoch; `state_dict` /
`load_state_dict` carry the epoch and the *global* sample position into a training checkpoint).
The count is taken where the user receives a batch, so worker prefetching never makes it run ahead.

Why a global position resumes at any layout: DistributedSampler draws one permutation of the whole
dataset per epoch from (seed, epoch), independent of the number of replicas, and replica r takes
positions r, r + R, r + 2R, ... of it. After k batches of b samples on each of R replicas the run
has consumed exactly the first k * b * R positions of that permutation, whatever R and b are. A
run with R' replicas resumes there by skipping that many / R' samples of its own share; when the
count is not a multiple of R', the few samples past the last multiple are trained again, and the
warning names them.
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
        return max(super().__len__() - self.skip, 0)

    def set_start_index(self, start_index: int) -> None:
        """ColossalAI examples' `StatefulDistributedSampler.set_start_index`: the next iteration (of this
        epoch) starts after the first `start_index` samples of this replica's own share."""
        if not isinstance(start_index, int) or start_index < 0:
            raise ValueError(f"set_start_index({start_index!r}): a count of this replica's samples, an int >= 0")
        self.skip = start_index


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableSampler` that knows how far into the epoch its user is. Its own
    generator, reseeded from (seed, epoch) at each iteration, draws the workers' base seed, so
    loading data never consumes the global random stream and a resumed epoch seeds its workers as
    the uninterrupted one did."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = seed
        self.batches_done = 0       # batches handed out in the sampler's current epoch
        self.samples_done = 0       # samples of this replica's share consumed this epoch (skipped ones included)

    def __iter__(self):
        self.samples_done = self.sampler.skip
        self.batches_done = self.sampler.skip // self.batch_size
        self.generator.manual_seed(self.seed * 1_000_003 + self.sampler.epoch)
        for batch in super().__iter__():
            self.batches_done += 1
            self.samples_done = min(self.samples_done + self.batch_size, self.sampler.num_samples)
            yield batch

    def _order(self) -> dict:
        """What fixes the epoch's permutation of the whole dataset (not the replica count)."""
        s = self.sampler
        return {"dataset_len": len(s.dataset), "shuffle": bool(s.shuffle), "seed": int(s.seed)}

    def state_dict(self) -> dict:
        """The epoch and the global position in its sample order (equal on every rank of a run whose
        replicas step together), plus this replica's own batch count."""
        s = self.sampler
        return {"epoch": s.epoch, "samples_done": self.samples_done * s.num_replicas, "num_replicas": s.num_replicas,
                "batch_size": self.batch_size, "batches_done": self.batches_done, **self._order()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position, saved at this or any other data-parallel layout: the next
        iteration (of that epoch) starts after the samples already consumed, so keep calling
        `sampler.set_epoch` with the saved epoch (`loader.sampler.epoch`)."""
        s, epoch = self.sampler, int(state["epoch"])
        s.set_epoch(epoch)
        if "samples_done" not in state:           # an older checkpoint: this replica's own count (same layout)
            s.skip = int(state["batches_done"]) * self.batch_size
        else:
            changed = {k: (state[k], v) for k, v in self._order().items() if state.get(k) != v}
            if changed:
                detail = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
                warnings.warn(f"the checkpoint's data order differs from this loader's ({detail}): epoch {epoch} "
                              f"restarts from its first sample in this loader's order (the "
                              f"{state['samples_done']} samples the checkpoint had consumed may be trained again); "
                              "build the loader with the same dataset, shuffle and seed to resume exactly",
                              stacklevel=3)
                s.skip = 0
            else:
                consumed = int(state["samples_done"])
                s.skip = consumed // s.num_replicas
                resumed = s.skip * s.num_replicas
                if resumed != consumed:
                    warnings.warn(f"the checkpoint is {consumed} samples into epoch {epoch}'s order (saved with "
                                  f"{state['num_replicas']} data-parallel replicas); with {s.num_replicas} replicas "
                                  f"this run resumes at sample {resumed}, so samples {resumed}..{consumed - 1} of "
                                  f"that order ({consumed - resumed}) are trained again; resume with a "
                                  f"data-parallel size that divides {consumed} to avoid it", stacklevel=3)
        self.samples_done = s.skip
        self.batches_done = s.skip // self.batch_size


def build_dataloader(dataset: Dataset, batch_size: int, num_replicas: int, rank: int, shuffle: bool = False,
                     seed: int = 1024, drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                     sampler_cls=None, **kwargs) -> DataLoader:
    """A DataLoader whose DistributedSampler splits `dataset` over `num_replicas` (the data-parallel
    replicas only: tensor- and pipeline-parallel ranks of one replica get the same samples).

    `set_epoch` on `loader.sampler` reshuffles per epoch, as with torch's DistributedSampler; the
    loader's position is saved by `booster.save_checkpoint(..., dataloader=loader)`.
    `sampler_cls`: the caller's own sampler class instead, built as ColossalAI's prepare_dataloader builds
    it (`sampler_cls(dataset, num_replicas=, rank=, shuffle=)`, nothing else passed), under a plain DataLoader.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    for forbidden in ("sampler", "batch_sampler", "generator"):
        if forbidden in kwargs:
            raise ValueError(f"prepare_dataloader builds its own data-parallel sampler and generator (seeded from "
                             f"seed=); do not pass {forbidden}=")
    if sampler_cls is not None and not callable(sampler_cls):
        raise TypeError(f"distributed_sampler_cls={sampler_cls!r} must be a sampler class (called as "
                        "cls(dataset, num_replicas=, rank=, shuffle=))")
    size = len(dataset) if hasattr(dataset, "__len__") else None
    if size is not None and size < num_replicas:
        effect = "some replicas get no sample" if drop_last else "samples are repeated to give every replica one"
        warnings.warn(f"the dataset has {size} samples for {num_replicas} data-parallel replicas: {effect}; use a "
                      "larger dataset or fewer data-parallel ranks", stacklevel=3)
    worker_init_fn = _seed_worker(seed + rank * max(num_workers, 1))
    if sampler_cls is not None:
        sampler = sampler_cls(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          num_workers=num_workers, worker_init_fn=worker_init_fn,
                          generator=torch.Generator().manual_seed(seed), **kwargs)
    sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                               pin_memory=pin_memory, num_workers=num_workers, seed=seed,
                               worker_init_fn=worker_init_fn, generator=torch.Generator(), **kwargs)
