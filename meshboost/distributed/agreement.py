"""Agreement across ranks: the checks that turn "ranks silently disagree" into one clear error.

Owns: `agree_settings` (every rank passed the same configuration: one all-gather of an 8-byte
digest, details exchanged only on a mismatch) and `check_same_inputs` (every rank of a group was
fed bitwise the same batch: one all-gather of a 6-number digest of the bytes, `gather_input_digests`
and `input_mismatch` to judge it later; `DeferredRead` reads such a verdict without waiting for the
device) and `agree_model` (every rank built the same model before boost: names, shapes, dtypes, HF
config). Each raises on every rank of the group
at once, naming what differs. Must not know plugins or parallel layouts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib

import torch
import torch.distributed as dist

from meshboost.distributed import comm
from meshboost.distributed.launch import get_current_device

_DIGEST_NUMEL = 6
# bytes each rank contributes to an input check's all-gather (the planner's traffic reads it)
INPUT_DIGEST_BYTES = _DIGEST_NUMEL * torch.float64.itemsize


def _stable(value) -> str:
    """A description of `value` that is equal on every rank exactly when the values are equal
    (no memory addresses: functions by qualified name, process groups by their ranks)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{_stable(k)}: {_stable(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(map(_stable, value)) if isinstance(value, (set, frozenset)) else map(_stable, value)
        return f"{type(value).__name__}[" + ", ".join(items) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}(" + ", ".join(
            f"{f.name}={_stable(getattr(value, f.name))}" for f in dataclasses.fields(value)) + ")"
    if isinstance(value, dist.ProcessGroup):
        return f"ProcessGroup{dist.get_process_group_ranks(value)}"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return type(value).__name__


def _differences(described: dict[str, str]) -> list[str]:
    """Every rank's `described` (str -> str) compared over the world: [] when all are equal (one
    all-gather of an 8-byte digest), else "key is A on rank 0, B on rank 1" for each key that differs
    (the descriptions are exchanged only then), keys in order of first appearance, rank 0's first.
    A no-op ([]) without a process group or with one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    digest = hashlib.sha256("\n".join(f"{k}={v}" for k, v in described.items()).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=get_current_device())
    everyone = comm.all_gather(mine, None, dim=0)
    if bool((everyone == everyone[0]).all()):
        return []
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, described)
    keys = list(dict.fromkeys(k for v in views for k in v))
    return [f"{k} is " + ", ".join(f"{v.get(k, '(absent)')} on rank {r}" for r, v in enumerate(views))
            for k in keys if len({v.get(k) for v in views}) > 1]


def agree_settings(settings: dict, what: str) -> None:
    """Raise on every rank, naming each setting that differs and its value on each rank, unless
    every rank passed equal `settings`: one all-gather of an 8-byte digest (the details are only
    exchanged on a mismatch). Ranks that disagree would otherwise build different groups and hang.
    A no-op without a process group or with one rank."""
    differing = _differences({str(k): _stable(v) for k, v in settings.items()})
    if not differing:
        return
    detail = "; ".join(sorted(differing))
    raise ValueError(f"ranks disagree on the {what}: {detail}. Every rank must pass the same settings (the same "
                     "script and arguments on every node)")


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as float64 integers: 16-bit words (bytes for one-byte dtypes)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16).to(torch.float64)


def _input_digest(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Six float64 numbers that equal inputs always share and different inputs almost never do: the
    count of tensors, their elements, a digest of their shapes and dtypes, the sum and a
    position-weighted sum of their bytes (so a permutation of the same values differs), and the
    count of non-finite elements. Digesting bytes, not values, makes bitwise-equal inputs agree
    even where they hold NaN (NaN != NaN as a value), and keeps every sum an exact integer in
    float64 (below 2**53 up to ~2.7e8 16-bit words a call), independent of summation order. No
    host sync: the scalars are written into a device tensor, the sums stay on the device."""
    digest = torch.zeros(_DIGEST_NUMEL, dtype=torch.float64, device=device)
    digest[0] = len(tensors)
    digest[1] = sum(t.numel() for t in tensors)
    digest[2] = sum((zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode()) % 1000003) * (i + 1)
                    for i, t in enumerate(tensors))
    for i, t in enumerate(tensors):
        words = _words(t)
        weights = torch.arange(words.numel(), device=words.device, dtype=torch.float64).remainder_(1009).add_(1 + i)
        nonfinite = (~torch.isfinite(t.detach())).sum() if t.is_floating_point() or t.is_complex() \
            else words.new_zeros(())
        digest[3:] += torch.stack([words.sum(), (words * weights).sum(), nonfinite.to(torch.float64)]).to(device)
    return digest


def tensors_of(*values) -> list[torch.Tensor]:
    """Every tensor in `values` (nested in lists, tuples and dicts, dicts in key order)."""
    out: list[torch.Tensor] = []
    for v in values:
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, dict):
            out += tensors_of(*(v[k] for k in sorted(v, key=str)))
        elif isinstance(v, (list, tuple)):
            out += tensors_of(*v)
    return out


def gather_input_digests(tensors: list[torch.Tensor], group) -> torch.Tensor:
    """Every rank's input digest, one row per rank of `group` in rank order, left on the device (one
    all-gather of 6 numbers; nothing waits for the host)."""
    return comm.all_gather(_input_digest(tensors, get_current_device()).unsqueeze(0), group, dim=0)


def input_mismatch(rows: torch.Tensor, group, what: str, fix: str, call: int | None = None) -> str | None:
    """The error for gathered digests `rows` (`gather_input_digests`) that differ, or None when
    every rank of `group` was fed the same inputs (NaN and all: bitwise equal). When they differ, it
    names the ranks whose inputs hold non-finite values too. `call` numbers the call it judges."""
    rows = rows.cpu()
    if torch.equal(rows, rows[:1].expand_as(rows)):
        return None
    ranks = dist.get_process_group_ranks(group)
    differing = [ranks[i] for i in range(len(ranks)) if not torch.equal(rows[i], rows[0])]
    when = f" at call {call}" if call is not None else ""
    detail = f"ranks {differing} differ from rank {ranks[0]}"
    nonfinite = {ranks[i]: int(rows[i, 5]) for i in range(len(ranks)) if rows[i, 5] > 0}
    if nonfinite:
        detail += (f"; ranks {sorted(nonfinite)} were fed non-finite inputs: NaN/inf in "
                   + ", ".join(f"{n} elements on rank {r}" for r, n in nonfinite.items()))
    return (f"the {what} ranks {ranks} were fed different inputs{when} ({detail}): they must see the same batch, "
            f"or the result is silently wrong. {fix}")


def check_same_inputs(tensors: list[torch.Tensor], group, what: str, fix: str) -> None:
    """Raise on every rank of `group` unless every rank passed bitwise-equal `tensors` (one
    all-gather of a 6-number digest, read at once). `what` names the group ("tensor-parallel"),
    `fix` says how to feed it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    message = input_mismatch(gather_input_digests(tensors, group), group, what, fix)
    if message is not None:
        raise ValueError(message)


def _model_description(model) -> dict:
    """What every rank's copy of a model must share before it is boosted: each parameter's and
    buffer's name, shape and dtype in order, and the HF config (when there is one)."""
    tensors = [("parameter", n, p) for n, p in model.named_parameters()]
    tensors += [("buffer", n, b) for n, b in model.named_buffers()]
    described = {f"{kind} {name}": f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
                 for kind, name, t in tensors}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        described.update({f"config.{k}": _stable(v) for k, v in config.to_dict().items()
                          if k not in ("_name_or_path", "transformers_version")})
    return described


def agree_model(model, what: str) -> None:
    """Raise on every rank, naming the first differences, unless every rank holds the same model
    (parameter and buffer names, shapes and dtypes, HF config): one all-gather of an 8-byte digest;
    the descriptions are only exchanged on a mismatch. Ranks that built different models (another
    layer count, another width) would otherwise abort inside a collective (gloo: "collective
    mismatch") or hang. A no-op without a process group or with one rank."""
    differing = _differences(_model_description(model))         # in model order, rank 0's first
    if not differing:
        return
    differing.sort(key=lambda line: not line.startswith("config."))      # the cause first, then the tensors
    shown = "; ".join(differing[:3])
    more = f" (and {len(differing) - 3} more differences)" if len(differing) > 3 else ""
    raise ValueError(f"ranks built different models for {what}: {shown}{more}. Every rank must build the same "
                     "model (the same config, code and arguments) before boost; the plugin shards it")


class DeferredRead:
    """A small device tensor read on the host later, without waiting for the rest of the device's
    queue: on CUDA a non-blocking copy into pinned memory and an event recorded right after it, so
    `get()` waits only until the stream has passed that point (long passed, typically, one call
    later); elsewhere the tensor itself (a CPU read is immediate)."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host.cpu()
