"""Pipeline schedules: one-forward-one-backward (1F1B) and its interleaved form, as plain code.

Owns: splitting a batch into micro-batches, the order in which each rank runs its forward (F)
and backward (B) units, and executing that order: receive, run the chunk, send, with the loss
computed by `criterion(outputs, inputs)` on the last stage, divided by the number of
micro-batches (the step's loss is their mean) and broadcast to every stage. Must not build
stages or hold process groups of its own (cut.py, grads.py, `meshboost.distributed.p2p`).

Why not torch.distributed.pipelining: see docs/pipeline.md (it fixes tensor shapes at the first
step, gives only the first stage the inputs, and calls the loss as loss_fn(output, target)).

Order (Megatron's): with P ranks, V chunks per rank and M micro-batches, rank r first runs
W forwards (W = P - r - 1 for 1F1B; 2(P - r - 1) + (V - 1)P interleaved), then alternates one
forward and one backward, then drains the remaining backwards. Interleaved, unit k runs chunk
(k // P) mod V (reversed for backwards) on micro-batch (k // PV) P + k mod P, so M must be a
multiple of P.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from meshboost.distributed.inputs import cast_floating
from meshboost.distributed.p2p import StageComm
from meshboost.pipeline.generators import generators_in_step
from meshboost.pipeline.grads import average_grads, sum_tied_grads
from meshboost.pipeline.normalization import TOKENS, batch_items, microbatch_weights
from meshboost.pipeline.stage import PipelineStages


# the step's loss, broadcast from the last stage to every stage once per step (the planner costs its bytes)
LOSS_DTYPE = torch.float32
LOSS_BROADCAST_BYTES = LOSS_DTYPE.itemsize

# Qwen-VL's flattened vision inputs: patch rows of every image in one tensor, each image's patch count
# the product of its row of the grid ([temporal, height, width])
FLATTENED_BY_GRID = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}


def split_microbatches(batch, num_microbatches: int | None = None, microbatch_size: int | None = None) -> list[dict]:
    """Split a dict batch along dim 0 into equal micro-batches (non-tensors are shared by all).
    Flattened vision inputs (`FLATTENED_BY_GRID`) split with their images, one image per sample."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"execute_pipeline needs batches that are dicts of tensors, got {type(batch).__name__}")
    flattened = {k: g for k, g in FLATTENED_BY_GRID.items() if torch.is_tensor(batch.get(k))
                 and torch.is_tensor(batch.get(g))}
    sizes = {k: v.shape[0] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0 and k not in flattened}
    if not sizes:
        raise ValueError("execute_pipeline: the batch holds no tensor with a batch dimension")
    batch_size = next(iter(sizes.values()))
    if any(s != batch_size for s in sizes.values()):
        raise ValueError(f"execute_pipeline: batch tensors disagree on the batch size: {sizes}")
    for key, grid in flattened.items():
        patches = int(batch[grid].prod(-1).sum())
        if batch[key].shape[0] != patches:
            raise ValueError(f"execute_pipeline: {key} holds {batch[key].shape[0]} patch rows but {grid} describes "
                             f"{patches}")
        if batch[grid].shape[0] != batch_size:
            raise ValueError(f"execute_pipeline: {grid} holds {batch[grid].shape[0]} images for {batch_size} samples; "
                             f"micro-batches split {key} with its images only at one image per sample")
    if num_microbatches is not None and microbatch_size is not None \
            and num_microbatches * microbatch_size != batch_size:
        raise ValueError(f"a batch of {batch_size} samples is not num_microbatches={num_microbatches} x "
                         f"microbatch_size={microbatch_size} = {num_microbatches * microbatch_size}: give batches of "
                         f"{num_microbatches * microbatch_size} samples (e.g. drop_last=True), or pass only one of "
                         "the two (the other is then derived from each batch)")
    if num_microbatches is None:
        num_microbatches = batch_size // microbatch_size if batch_size % microbatch_size == 0 else -1
    if num_microbatches < 1 or batch_size % num_microbatches:
        how = (f"num_microbatches={num_microbatches}" if microbatch_size is None
               else f"microbatch_size={microbatch_size}")
        raise ValueError(f"a batch of {batch_size} samples does not split into equal micro-batches with {how}; "
                         "use a batch size that is a multiple of the micro-batch size (e.g. drop_last=True)")
    size = batch_size // num_microbatches
    out = [{k: v[i * size:(i + 1) * size] if k in sizes else v for k, v in batch.items()}
           for i in range(num_microbatches)]
    for key, grid in flattened.items():
        ends = [0] + batch[grid].prod(-1).cumsum(0).tolist()        # patch rows of image i: ends[i]:ends[i+1]
        for i, mb in enumerate(out):
            mb[key] = batch[key][ends[i * size]:ends[(i + 1) * size]]
    return out


def schedule_order(num_ranks: int, rank: int, num_microbatches: int, num_chunks: int = 1,
                   forward_only: bool = False) -> list[tuple[str, int, int]]:
    """The units ("F" or "B", local chunk, micro-batch) rank `rank` runs, in order."""
    P, V, M = num_ranks, num_chunks, num_microbatches
    total = M * V

    def unit(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // P) % V
        if kind == "B":
            chunk = V - 1 - chunk
        return kind, chunk, (k // (P * V)) * P + k % P if V > 1 else k

    if forward_only:
        return [unit("F", k) for k in range(total)]
    warmup = P - rank - 1 if V == 1 else 2 * (P - rank - 1) + (V - 1) * P
    warmup = min(warmup, total)
    order = [unit("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit("F", warmup + k), unit("B", k)]
    order += [unit("B", k) for k in range(total - warmup, total)]
    return order


class PipelineSchedule:
    """Runs one pipeline step over the stages of this rank.

    reductions: [(params, group)] whose gradients are averaged over `group` after the schedule (dense
    weights over dp, expert weights over their own replicas); empty when something else reduces them
    (the plugin decides, see `meshboost.plugins.config.dp_reducer`). tied: (group of the pipeline
    ranks holding a tied weight, the tied weights this rank holds) pairs, e.g. GPT-2's embedding and
    LM head on the first and last stage. sharding: zero_stage=3's hooks around the step (below).
    """

    def __init__(self, stages: PipelineStages, comm: StageComm, num_microbatches: int | None = None,
                 microbatch_size: int | None = None, reductions=(), tied=(),
                 loss_normalization: str = TOKENS, count_group=None, count_size: int = 1, shifted_labels: bool = False,
                 input_dtype: torch.dtype | None = None, context=None, sharding=None):
        self.stages, self.comm = stages, comm
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.reductions, self.tied = list(reductions), list(tied)
        # normalization.py: the mode, the data-parallel group its item count is agreed over, and
        # whether the model shifts its labels (causal LM).
        self.loss_normalization, self.count_group, self.count_size = loss_normalization, count_group, count_size
        self.shifted_labels = shifted_labels
        self.input_dtype = input_dtype            # floating inputs take the weights' precision (inputs.py)
        # cp_size > 1: a `ContextInputs` (shardformer/context.py) cuts each micro-batch into this cp rank's
        # piece of every sequence and turns the last stage's output into the whole sequences' loss
        self.context = context
        # zero_stage=3: FSDP2's `StepSharding` (meshboost/fsdp/pipeline.py): gradients kept unreduced and
        # weights gathered through the step, reduce-scattered and resharded once at its end
        self.sharding = sharding

    def count_items(self, batch) -> torch.Tensor | None:
        """The labelled items of this rank's `batch` that mode "tokens" normalises by (None without
        labels, or in mode "microbatch"), counted as the model counts them."""
        return batch_items(batch, self.shifted_labels) if self.loss_normalization == TOKENS else None

    def run(self, batch, criterion, optimizer=None, return_loss: bool = True, return_outputs: bool = False,
            items: float | None = None) -> dict:
        """Forward (and backward when `optimizer` is given) every micro-batch of `batch`. `items`: the
        labelled items of the whole global batch when the caller agreed them (execute_pipeline does),
        else the last stage counts them with one all-reduce over dp."""
        stages = self.stages
        if isinstance(batch, Mapping):
            batch = cast_floating({k: v.to(self.comm.device) if torch.is_tensor(v) else v for k, v in batch.items()},
                                  self.input_dtype)
        microbatches = split_microbatches(batch, self.num_microbatches, self.microbatch_size)
        M, P, V = len(microbatches), stages.pp_size, stages.num_chunks
        if V > 1 and M % P:
            raise ValueError(f"the interleaved schedule needs the number of micro-batches ({M}) to be a multiple "
                             f"of pp_size={P}")
        training = optimizer is not None
        if (training or return_loss) and criterion is None:
            raise ValueError("execute_pipeline needs a criterion(outputs, inputs) to compute the loss")
        if self.context is not None and (training or return_loss):
            self.context.check_criterion(criterion, microbatches[0])      # on every rank, before the schedule
        weights = None
        if self.loss_normalization == TOKENS and stages.pp_rank == P - 1 and (training or return_loss):
            weights = microbatch_weights(microbatches, self.shifted_labels, self.count_group, self.count_size,
                                         total=items)
        step = _Step(self, microbatches, criterion, optimizer, return_loss, return_outputs, weights)
        if self.sharding is not None:
            self.sharding.begin(training)
        # stages draw different random numbers (generators.py): every rank leaves the step in one state
        with generators_in_step(self.comm.device), contextlib.nullcontext() if training else torch.no_grad():
            for kind, chunk, mb in schedule_order(P, stages.pp_rank, M, V, forward_only=not training):
                step.forward(chunk, mb) if kind == "F" else step.backward(chunk, mb)
        self.comm.wait_sends()
        if self.sharding is not None:     # before the tied sums: they add the reduced shards
            self.sharding.finish(training)
        if training:
            for group, params in self.tied:
                sum_tied_grads(params, group)
            average_grads(self.reductions)
        loss = None
        if return_loss:
            loss = torch.zeros((), dtype=LOSS_DTYPE, device=self.comm.device)
            if step.losses:
                loss += step.replica_loss()
            loss = self.comm.broadcast_from_last(loss)
        outputs = _merge(step.outputs) if return_outputs and step.outputs else None
        return {"loss": loss, "outputs": outputs}


class _Step:
    """State of one `run`: what each unit saved for its backward, the losses and outputs."""

    def __init__(self, schedule: PipelineSchedule, microbatches, criterion, optimizer, return_loss, return_outputs,
                 weights: torch.Tensor | None = None):
        self.stages, self.comm = schedule.stages, schedule.comm
        self.microbatches, self.criterion, self.optimizer = microbatches, criterion, optimizer
        self.return_loss, self.return_outputs = return_loss, return_outputs
        self.weights = weights                    # per micro-batch weight (normalization.py), or None
        self.context = schedule.context
        self.pieces: dict[int, dict] = {}       # context: mb -> this rank's piece, its ContextCall inside
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: list = []

    def share(self, mb: int, loss: torch.Tensor) -> torch.Tensor:
        """Micro-batch `mb`'s part of the step's loss (normalization.py)."""
        if self.weights is None:
            return loss / len(self.microbatches)            # mean of micro-batch means
        return loss * self.weights[mb].to(loss.dtype)      # its share of every labelled item

    def replica_loss(self) -> torch.Tensor:
        """The loss this data-parallel replica reports: the mean over its labelled items (mode
        "tokens": sum_m mean_m * items_m / items, the weights being proportional to items_m), else
        the mean of its micro-batch losses."""
        losses = torch.stack(self.losses).double()
        if self.weights is None:
            return losses.mean().float()
        weights = self.weights.to(losses.device)
        # A micro-batch without a labelled item has the mean 0/0 and weighs 0: it adds nothing (a
        # replica without any reports NaN, the mean over no item, as the model itself would).
        losses = torch.where(weights > 0, losses, 0.0)
        return ((losses * weights).sum() / weights.sum()).float()

    def _inputs(self, mb: int) -> dict:
        """Micro-batch `mb`'s inputs to the model: whole, or under context parallelism this rank's
        piece, cut once (interleaved, a rank runs several chunks of it); the piece carries its own
        masks' state (context.py's `ContextCall`), so nothing is put back between units."""
        if self.context is None:
            return self.microbatches[mb]
        if mb not in self.pieces:
            self.pieces[mb] = self.context.shard_microbatch(self.microbatches[mb])
        return self.pieces[mb]

    def forward(self, chunk: int, mb: int) -> None:
        stages, virtual = self.stages, self.stages.virtual(chunk)
        training = self.optimizer is not None
        received = None
        if not stages.is_first(chunk):
            received = self.comm.recv_activation(virtual)
            for t in received:
                t.requires_grad_(training)
        inputs = self._inputs(mb)
        out = stages.forward_chunk(chunk, inputs, received)
        if not stages.is_last(chunk):
            self.comm.send_activation(out, virtual + 1)
            if training:
                self.saved[(chunk, mb)] = (received, out)
            return
        if self.context is not None:
            out = self.context.combine(out, inputs, training)
        if self.return_outputs:
            self.outputs.append(_detach(out))
        if training or self.return_loss:
            loss = self.criterion(out, self.microbatches[mb])
            self.losses.append(loss.detach())
            if training:
                self.saved[(chunk, mb)] = (received, self.share(mb, loss))

    def backward(self, chunk: int, mb: int) -> None:
        stages, virtual = self.stages, self.stages.virtual(chunk)
        received, out = self.saved.pop((chunk, mb))
        if stages.is_last(chunk):
            self.optimizer.backward(out)          # the optimizer wrapper scales the loss (fp16)
        else:
            grads = self.comm.recv_grad(virtual, like=out)
            # A tensor passed on unchanged (the encoder output through decoder stages) is a leaf here:
            # its upstream gradient adds to what this stage's own layers give it.
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
            outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
            by_grad = getattr(self.optimizer, "backward_by_grad", None)
            by_grad(outs, grads) if by_grad is not None else torch.autograd.backward(outs, grads)
        if not stages.is_first(chunk):
            self.comm.send_grad([t.grad if t.grad is not None else torch.zeros_like(t) for t in received],
                                virtual - 1)


def _detach(out):
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, Mapping):
        return type(out)(**{k: v.detach() if torch.is_tensor(v) else v for k, v in out.items()})
    return out


def _merge(outputs: list):
    """Concatenate micro-batch outputs along the batch dim (scalars such as a loss are averaged)."""
    first = outputs[0]
    if torch.is_tensor(first):
        return torch.cat(outputs) if first.dim() > 0 else torch.stack(outputs).mean()
    if isinstance(first, Mapping):
        return type(first)(**{k: _merge([o[k] for o in outputs]) if torch.is_tensor(v) else v
                              for k, v in first.items()})
    return outputs
