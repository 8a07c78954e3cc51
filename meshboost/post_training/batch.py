"""What a preference batch must hold, checked on every rank before any collective, and its one layout.

Owns: `pair_batch` (a batch of pairs, `chosen_*` and `rejected_*` fields per example, as one dataset row
holds both: a data loader that splits the rows over dp or micro-batches can never separate a pair) ->
one forward's batch laid out [chosen; rejected], right-padded to one length (with M pipeline micro-batches:
[chosen; rejected] of each micro-batch's pairs in turn, so the schedule's equal split keeps every pair in one
micro-batch); the sequence limit (a prompt, or a whole row, longer than `max_length`); `agree` (a refusal found on
one rank's data raised on every rank of the group, with one all-gather of an integer, so no rank waits
in a collective for a rank that stopped). Must not run a model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshboost.distributed import comm
from meshboost.post_training.logprobs import IGNORE_INDEX

SIDES = ("chosen", "rejected")


class PreferenceBatchError(ValueError):
    """A batch the preference objectives cannot score exactly (raised on every rank of the group)."""


def agree(problem: str | None, group=None, device=None, error=PreferenceBatchError, what="preference batch") -> None:
    """Raise `problem` on this rank and an `error` naming the rank(s) on every other rank of `group` (None: the
    world), when any rank found one. One all-gather of one integer per rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if problem:
            raise error(problem)
        return
    flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=device)
    flags = comm.all_gather(flag, group, dim=0).tolist()
    if problem:
        raise error(problem + " (raised on every rank before any collective)")
    if any(flags):
        bad = [dist.get_global_rank(group, r) if group is not None else r for r, f in enumerate(flags) if f]
        raise error(f"the {what} of rank(s) {bad} was refused (see the error there); "
                    "raised on every rank before any collective")


def _too_long(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, side: str, max_length: int | None):
    """A row longer than `max_length` (its attended tokens): the prompt alone, or with its response."""
    if max_length is None or ids.shape[1] <= max_length:
        return None
    lengths = mask.sum(dim=1)
    labelled = labels != IGNORE_INDEX
    prompts = torch.where(labelled.any(dim=1), labelled.int().argmax(dim=1), lengths)
    for row in (prompts >= max_length).nonzero().flatten().tolist():
        return (f"the prompt of {side} row {row} holds {int(prompts[row])} tokens, the sequence limit "
                f"max_length={max_length}: no response token would fit. Drop the example or shorten the prompt "
                "(truncate it from the left) when the data is prepared")
    for row in (lengths > max_length).nonzero().flatten().tolist():
        return (f"{side} row {row} holds {int(lengths[row])} tokens, past the sequence limit max_length={max_length}: "
                "truncate its response when the data is prepared (the log-prob of a cut sequence is another number)")
    return None


def _side(batch: dict, side: str, max_length: int | None = None) -> tuple[dict, str | None]:
    ids, labels = batch.get(f"{side}_input_ids"), batch.get(f"{side}_labels")
    if not torch.is_tensor(ids) or not torch.is_tensor(labels):
        missing = [k for k in (f"{side}_input_ids", f"{side}_labels") if not torch.is_tensor(batch.get(k))]
        return {}, (f"a preference batch needs {missing} (chosen_input_ids, chosen_labels, rejected_input_ids, "
                    f"rejected_labels, optional *_attention_mask; labels -100 on prompt and padding); got keys "
                    f"{sorted(batch)}")
    if ids.dim() != 2 or labels.shape != ids.shape:
        return {}, f"{side}_input_ids {tuple(ids.shape)} and {side}_labels {tuple(labels.shape)} must be one [rows, length]"
    mask = batch.get(f"{side}_attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    if mask.shape != ids.shape:
        return {}, f"{side}_attention_mask {tuple(mask.shape)} does not match {side}_input_ids {tuple(ids.shape)}"
    long = _too_long(ids, labels, mask, side, max_length)
    if long:
        return {}, long
    empty = ((labels[:, 1:] != IGNORE_INDEX).sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        return {}, (f"{side} response(s) of row(s) {empty} hold no labelled token after the causal shift (an empty "
                    "response, or a prompt that fills the sequence): its log-prob would be 0, the pair meaningless")
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, None


def _problem(batch: dict, max_length: int | None, microbatches: int) -> tuple[dict, str | None]:
    if not isinstance(batch, dict):
        return {}, f"a preference batch is a dict of tensors; got {type(batch).__name__}"
    sides = {}
    for side in SIDES:
        sides[side], problem = _side(batch, side, max_length)
        if problem:
            return {}, problem
    rows = [sides[s]["input_ids"].shape[0] for s in SIDES]
    if rows[0] != rows[1]:
        return {}, (f"{rows[0]} chosen and {rows[1]} rejected rows: every pair keeps its chosen and rejected together "
                    "in one row of the dataset, so no data-parallel replica or micro-batch holds half a pair")
    if rows[0] == 0:
        return {}, "a preference batch of 0 pairs: give every data-parallel replica at least one pair (drop_last=True)"
    if rows[0] % microbatches:
        return {}, (f"{rows[0]} pairs do not split into {microbatches} pipeline micro-batches of whole pairs: give each "
                    f"replica a multiple of {microbatches} pairs per step (or an even microbatch_size: rows, two per pair)")
    return sides, None


def pair_batch(batch: dict, pad_token_id: int = 0, group=None, max_length: int | None = None,
               microbatches: int = 1) -> dict:
    """One forward's batch for `batch`'s pairs: rows [chosen_0..chosen_{P-1}; rejected_0..], right-padded
    (pad_token_id, attention 0, labels -100) to one length; with `microbatches` M > 1 (a pipeline step), M
    blocks of P/M pairs, each [chosen; rejected]. Checked on every rank of `group` (None: the world) before
    anything else runs (`agree`), `max_length` the sequence limit (None: none)."""
    sides, problem = _problem(batch, max_length, microbatches)
    device = next((v.device for v in batch.values() if torch.is_tensor(v)), None) if isinstance(batch, dict) else None
    agree(problem, group, device)
    length = max(sides[s]["input_ids"].shape[1] for s in SIDES)
    pads = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = {}
    for key, value in pads.items():
        padded = [F.pad(sides[s][key], (0, length - sides[s][key].shape[1]), value=value) for s in SIDES]
        blocks = [p.chunk(microbatches) for p in padded]          # per side: M blocks of P/M pairs
        out[key] = torch.cat([part for m in range(microbatches) for part in (blocks[0][m], blocks[1][m])])
    return out
