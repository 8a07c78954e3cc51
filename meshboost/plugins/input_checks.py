"""What the boosted model checks about its inputs, so that bad or diverging batches end in one clear
error on every rank that shares the verdict, never in a silently wrong step or a hang.

Owns: `InputCheck` (check_inputs: the tp and pp ranks were fed bitwise the same inputs, on every
call by default; on CUDA a call's verdict is read at the next call, so the hot path never waits for
the device), `LabelledItemsGuard` (the optimizer asks it before an update whether a training
forward since the last step had no labelled token in its global batch) and `next_pipeline_batch`
(one all-reduce over the world at the start of a pipeline step: every rank has a batch, none has,
and whether the global batch holds a labelled token), `refuse_empty_batch` (expert parallelism: no
replica may be fed 0 rows, agreed over dp before the forward) and `check_positions` (positions past a
model's learned absolute position embeddings, named before any collective). Must not contain digests or collectives of
its own (distributed/agreement.py, distributed/comm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.distributed import ParallelMesh, comm
from meshboost.distributed.agreement import DeferredRead, gather_input_digests, input_mismatch, tensors_of
from meshboost.plugins.config import CHECK_INPUTS

ALWAYS, FIRST, NEVER = CHECK_INPUTS
_AGREEMENT_NUMEL = 5        # next_pipeline_batch's int64s: has a batch, labelled items, has labels, empty, too long
# bytes each rank all-reduces over the world at the start of a pipeline step, and each dp rank
# all-gathers before an expert-parallel forward (the planner's traffic reads them)
PIPELINE_AGREEMENT_BYTES = _AGREEMENT_NUMEL * torch.int64.itemsize
_EMPTY_FLAG = torch.int32         # refuse_empty_batch's one flag per dp rank
EMPTY_FLAG_BYTES = _EMPTY_FLAG.itemsize

FEED_FIX = ("Build the DataLoader with plugin.prepare_dataloader(...) (it samples over data-parallel ranks only), "
            "not a DistributedSampler over the whole world, and draw any per-step randomness (augmentation, "
            "masking) from a generator seeded alike on every rank of the group; check_inputs='never' turns this "
            "check off")

NO_LABEL_FIX = ("Every label of the global batch is -100 (ignored): its loss is 0/0 (NaN) and the step would "
                "train on nothing. Drop samples with no labelled token before batching (e.g. a prompt whose answer "
                "was truncated away), or make the batch larger")


class InputCheck:
    """Agree over the tensor- and pipeline-parallel groups that every rank was fed the same inputs.

    mode "always" (the default): every call. The first call is judged at once; later calls are
    judged at once on the CPU, and on CUDA when `immediate=True` (execute_pipeline, whose step waits
    for the host anyway); otherwise (`deferred`, the default on CUDA) the gathered digests are copied
    to pinned memory and judged at the start of the next call, which raises naming the call that
    differed. "first": the first call only. "never": off. Every rank of a group reads the same
    gathered digests at the same call, so they raise together.
    """

    def __init__(self, mesh: ParallelMesh, mode: str = ALWAYS, deferred: bool | None = None, fix: str = FEED_FIX):
        if mode not in CHECK_INPUTS:
            raise ValueError(f"check_inputs={mode!r}; expected one of {CHECK_INPUTS}")
        self.mode, self.fix = mode, fix
        context = ((mesh.group("cp"), "context-parallel"),) if getattr(mesh, "cp_size", 1) > 1 else ()
        self.groups = [(group, what) for group, what in ((mesh.tp_group, "tensor-parallel"),
                                                          (mesh.pp_group, "pipeline-parallel"), *context)
                       if dist.get_world_size(group) > 1]
        self.deferred = mesh.device.type == "cuda" if deferred is None else deferred
        self.calls = 0
        self._pending: list[tuple[int, object, str, DeferredRead]] = []

    def __call__(self, *inputs, immediate: bool = False) -> None:
        if self.mode == NEVER or not self.groups:
            return
        self.calls += 1
        self.report_pending()
        if self.mode == FIRST and self.calls > 1:
            return
        tensors = tensors_of(*inputs)
        now = immediate or not self.deferred or self.calls == 1
        for group, what in self.groups:
            rows = gather_input_digests(tensors, group)
            if now:
                message = input_mismatch(rows, group, what, self.fix, self.calls)
                if message is not None:
                    raise ValueError(message)
            else:
                self._pending.append((self.calls, group, what, DeferredRead(rows)))

    def report_pending(self) -> None:
        """Judge the digests an earlier call left (deferred): raise for the first that differ."""
        pending, self._pending = self._pending, []
        for call, group, what, read in pending:
            message = input_mismatch(read.get(), group, what, self.fix, call)
            if message is not None:
                raise ValueError(f"{message} (reported at call {self.calls}: on CUDA a call's check is read at the "
                                 "next call, so training never waits for the device)")


class LabelledItemsGuard:
    """Remembers, for each training forward since the last optimizer step, whether the labelled
    items of its global batch (the count every dp replica agreed) were 0, without waiting for the
    device (`DeferredRead`). The optimizer calls it first in `step()`; every rank of the step holds
    the same counts, so every rank raises there together and the weights stay unchanged."""

    _KEEP = 8           # pending reads beyond this are resolved (long done) into one flag

    def __init__(self):
        self._pending: list[DeferredRead] = []
        self._seen_empty = False

    def record(self, items: torch.Tensor) -> None:
        self._pending.append(DeferredRead((items == 0).reshape(1)))
        if len(self._pending) > self._KEEP:
            self._seen_empty |= bool(self._pending.pop(0).get()[0])

    def __call__(self) -> None:
        pending, self._pending = self._pending, []
        empty = self._seen_empty or any(bool(read.get()[0]) for read in pending)
        self._seen_empty = False
        if empty:
            raise ValueError(f"optimizer.step(): a training forward since the last step had no labelled token in its "
                             f"global batch (every data-parallel replica). {NO_LABEL_FIX}. The gradients were "
                             "dropped and the weights are unchanged")


@dataclass(frozen=True)
class PositionLimit:
    """A model's learned absolute position embeddings: how many positions they hold, and the config field."""

    limit: int
    field: str


def learned_position_limit(model: nn.Module) -> PositionLimit | None:
    """The limit of `model`'s learned absolute position embeddings (GPT-2's `wpe`, BERT's
    `position_embeddings`): an nn.Embedding other than the input embedding with one row per position of the
    config's max_position_embeddings / n_positions and the hidden width; None for rotary or relative
    positions (no table to run past)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit, width = getattr(text, "max_position_embeddings", None), getattr(text, "hidden_size", None)
    if not isinstance(limit, int) or not hasattr(model, "get_input_embeddings"):
        return None
    try:
        words = model.get_input_embeddings()
    except NotImplementedError:     # transformers' default raises for some composites (BLIP-2)
        return None
    for module in model.modules():
        if (isinstance(module, nn.Embedding) and module is not words and module.num_embeddings == limit
                and width in (None, module.embedding_dim)):
            return PositionLimit(limit, text.attribute_map.get("max_position_embeddings", "max_position_embeddings"))
    return None


def check_positions(limit: PositionLimit | None, args: tuple, kwargs: dict) -> None:
    """Refuse a call whose positions run past the learned position embeddings, naming the limit (the
    unsharded model raises a bare IndexError from the lookup). Pure: every rank of a replica holds the same
    inputs and raises alike, before any collective. Given position_ids on an accelerator are checked by a
    device-side assert (no host sync), as the vocab check does."""
    if limit is None:
        return
    positions = kwargs.get("position_ids")
    if torch.is_tensor(positions) and positions.numel():
        if positions.device.type != "cpu":
            torch._assert_async(positions.max() < limit.limit, f"position ids must lie below config.{limit.field}="
                                                               f"{limit.limit} (learned absolute position embeddings)")
            return
        last = int(positions.max())
        what = f"position id {last}"
    else:
        given = (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])   # input_ids may come first
        tokens = next((t for t in given if torch.is_tensor(t)), None)
        if tokens is None or tokens.dim() < 2:
            return
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        last = past + tokens.shape[1] - 1
        what = f"a sequence of {tokens.shape[1]} tokens" + (f" after {past} cached ones" if past else "")
    if last >= limit.limit:
        raise IndexError(f"{what} runs past the model's learned absolute position embeddings (config.{limit.field}="
                         f"{limit.limit}: positions 0 to {limit.limit - 1}). Truncate or split the inputs to at most "
                         f"{limit.limit} tokens (tokenizer(..., truncation=True, max_length={limit.limit}))")


def _main_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor whose rows are the batch: input_ids, else inputs_embeds, else the first tensor given."""
    tensors = [kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args, *kwargs.values()]
    return next((t for t in tensors if torch.is_tensor(t)), None)


def _replicas(mesh: ParallelMesh, ranks: list[int]) -> list[int]:
    grid = mesh.device_mesh.mesh
    return sorted({int((grid == r).nonzero()[0][0]) for r in ranks})


def _past_positions(limit: PositionLimit | None, batch) -> IndexError | None:
    """`check_positions`'s error for a pipeline batch (a dict of model inputs), or None."""
    if limit is None or not isinstance(batch, dict):
        return None
    try:
        check_positions(limit, (), batch)
    except IndexError as error:
        return error
    return None


def refuse_empty_batch(mesh: ParallelMesh, args: tuple, kwargs: dict) -> None:
    """Expert parallelism: each MoE layer exchanges tokens with the ep peers, so a rank whose batch is empty
    (no row: transformers' forward cannot run it, it fails reshaping 0 rows) would leave its peers waiting in
    the exchange. One all-gather of one integer over the data-parallel group, read on the host (the ep
    layers sync the host anyway), before the forward: a replica fed an empty batch raises on every rank of
    the group, naming the replicas. (Training it exactly would need the model to run 0 rows, which the
    unsharded model cannot do either.)"""
    main = _main_input(args, kwargs)
    empty = torch.tensor([int(main is not None and main.numel() == 0)], dtype=_EMPTY_FLAG, device=mesh.device)
    flags = comm.all_gather(empty, mesh.dp_group, dim=0).tolist()
    if any(flags):
        replicas = [r for r, f in enumerate(flags) if f]
        ranks = [dist.get_global_rank(mesh.dp_group, r) for r in replicas] if mesh.dp_size > 1 else replicas
        shape = f" (here: {tuple(main.shape)})" if empty.item() else ""
        raise ValueError(f"ep_size={mesh.ep_size}: the batch of data-parallel replica(s) {replicas} (global ranks "
                         f"{ranks}) is empty{shape}; under expert parallelism every replica exchanges tokens with its "
                         "ep peers in each MoE layer, and the model cannot run 0 rows. Give every replica at least one "
                         "row: plugin.prepare_dataloader(dataset, batch_size=..., drop_last=True) splits the dataset "
                         "evenly over the data-parallel replicas. Raised on every data-parallel rank before the forward")


def next_pipeline_batch(data_iter, mesh: ParallelMesh, count_items, training: bool,
                        position_limit: PositionLimit | None = None) -> tuple[object, float | None]:
    """`next(data_iter)` on every rank of a pipeline step, agreed over the world with one all-reduce
    of 5 integers (has a batch, labelled items, has labels, its batch is empty, its positions run past
    `position_limit`, which the stage holding the position table knows), read on the host: every
    rank has a batch (returns it, with the labelled items of the global batch, or None without labels),
    none has (StopIteration on every rank: the end of an epoch), or some ran out (RuntimeError on
    every rank naming them: the others would wait in the schedule); a batch of 0 rows on some rank
    (the model cannot run it) is a ValueError on every rank naming them, positions past the limit an
    IndexError on every rank (`check_positions`'s, naming the limit, where it is known). When `training`, a global batch
    whose labels are all ignored raises ValueError on every rank before any forward (evaluated, its
    loss is NaN, the mean over no item). `count_items(batch)`: this rank's labelled items (a
    tensor), or None."""
    try:
        batch = next(data_iter)
    except StopIteration:
        batch = None
    items = count_items(batch) if batch is not None else None
    mine = torch.zeros(_AGREEMENT_NUMEL, dtype=torch.int64, device=mesh.device)
    mine[0] = int(batch is not None)
    if items is not None:
        mine[1] = items.to(mine.device)
        mine[2] = 1
    main = _main_input(batch if isinstance(batch, (tuple, list)) else (batch,),
                       batch if isinstance(batch, dict) else {}) if batch is not None else None
    mine[3] = int(main is not None and main.numel() == 0)
    too_long = _past_positions(position_limit, batch)
    mine[4] = int(too_long is not None)
    have, total, labelled, empties, past = comm.all_reduce(mine.clone(), mesh.world_group).tolist()
    if have == 0:
        raise StopIteration
    if have < mesh.world_size:
        flags = comm.all_gather(mine[:1], mesh.world_group, dim=0).tolist()
        ran_out = [r for r, f in enumerate(flags) if f == 0]
        replicas = _replicas(mesh, ran_out)
        raise RuntimeError(
            f"execute_pipeline: the data iterators of ranks {ran_out} (data-parallel replicas {replicas}) ran out "
            f"while the other {have} ranks still had a batch; every rank of a pipeline step needs one, or the others "
            "wait in the schedule. Give every replica the same number of batches (plugin.prepare_dataloader(dataset, "
            "batch_size=..., drop_last=True) splits the dataset evenly over the data-parallel replicas) and run the "
            "same number of steps on every rank")
    if empties:
        flags = comm.all_gather(mine[3:4], mesh.world_group, dim=0).tolist()
        empty = [r for r, f in enumerate(flags) if f]
        raise ValueError(f"execute_pipeline: the batches of ranks {empty} (data-parallel replicas "
                         f"{_replicas(mesh, empty)}) are empty (0 rows), which the model cannot run, while the other "
                         "replicas' would wait for them in the schedule. Give every replica at least one row "
                         "(plugin.prepare_dataloader(dataset, batch_size=..., drop_last=True)). Nothing was run")
    if past:
        raise too_long or IndexError("execute_pipeline: this step's inputs run past the model's learned absolute "
                                     "position embeddings (the ranks of the first stage name the limit)")
    if labelled < mesh.world_size:
        return batch, None
    if total == 0 and training:
        raise ValueError(f"execute_pipeline: the global batch of this step holds no labelled token on any "
                         f"data-parallel replica. {NO_LABEL_FIX}. Nothing was run; the weights are unchanged")
    # every rank of a replica (its tp, pp and cp ranks) counted the same batch (the input check holds them to it)
    return batch, total / (mesh.world_size // mesh.dp_size)
