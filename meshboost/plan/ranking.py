"""The search: every enumerated layout checked, those whose state alone cannot fit set aside, the fake runs
of the rest made at once, each estimated, the fitting ones fastest first.

Owns `rank(planner, include_unfit, **candidates' keywords)`, `smallest(planner)` (the layout needing
the least memory, for the advice when none fits), `state_bound(planner, layout)` and `Progress`. A
layout whose weights, masters, optimizer states, buffers and gradients already need more than the
device holds at one of the step's instants (peak.py's instants with no activation bytes: each instant
only grows with them) cannot fit, whatever its activations: its fake runs are not made unless its
estimate is asked for (`include_unfit`), so a ranking makes the fake runs of the layouts that can fit
only (docs/planner.md's 7B on 8 GPUs: 180 of 1080 layouts set aside; its 30B MoE on 8 GPUs at sequence
8192: all 1740, and `smallest` then explains 60 of them for the advice, reading the ranking's checks
and bounds rather than making them again). `Progress` writes one line on
stderr once a ranking has taken a few seconds, then one every few more, and a last one.
Must not estimate anything itself: every figure is `Planner.explain`'s or peak.py's.
"""

from __future__ import annotations

import sys
import time

from meshboost.plan import fakecache, peak

PROGRESS_AFTER_S = 3.0          # the first progress line, once a ranking has taken this long
PROGRESS_EVERY_S = 10.0         # then one line this often
REFUSALS = (ValueError, NotImplementedError, TypeError)
SMALLEST_CHUNK = 16             # layouts whose fake runs `smallest` makes at once


class Progress:
    """Lines on `stream` (stderr) saying how far a ranking is: the fake runs made (in workers) and the
    layouts estimated, written only once it has taken `after_s` seconds."""

    def __init__(self, after_s: float | None = None, every_s: float | None = None, stream=None):
        self.start = time.monotonic()
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.stream = stream or sys.stderr
        self.written_at: float | None = None
        self.runs = self.layouts = self.checked = (0, 0)

    def update(self, runs: tuple[int, int] | None = None, layouts: tuple[int, int] | None = None,
               checked: tuple[int, int] | None = None) -> None:
        self.runs, self.layouts, self.checked = runs or self.runs, layouts or self.layouts, checked or self.checked
        now = time.monotonic()
        due = self.start + self.after_s if self.written_at is None else self.written_at + self.every_s
        if now >= due:
            self._write(now)

    def done(self) -> None:
        if self.written_at is not None:
            self._write(time.monotonic(), "done: ")

    def _write(self, now: float, prefix: str = "") -> None:
        self.written_at = now
        parts = [f"{self.checked[0]} of {self.checked[1]} layouts checked"] if self.checked[0] < self.checked[1] else []
        parts += [f"{self.runs[0]} of {self.runs[1]} fake runs"] if self.runs[1] else []
        if self.layouts[1]:
            parts.append(f"{self.layouts[0]} of {self.layouts[1]} layouts estimated")
        print(f"meshboost.plan: {prefix}{', '.join(parts) or 'checking layouts'} ({now - self.start:.0f} s)",
              file=self.stream, flush=True)


def state_bound(planner, layout) -> int:
    """A lower bound of the device bytes `layout` (checked) needs on its worst rank, from the ranks'
    states alone: the peak's instants counted with no activation bytes. ZeRO-3's instants (fsdp_peak.py)
    are not bounded this way: 0."""
    if layout.zero == 3:
        return 0
    key = _state_key(planner, layout)
    if key is not None and key in planner.state_bounds:
        return planner.state_bounds[key]
    nothing = peak.StageActivations(0, None, 0)
    tp_ranks, dp_ranks = planner.distinct_ranks(layout)
    bound = 0
    for pp_rank in range(layout.pp):
        for tp_rank in tp_ranks:
            shards = planner.shards(layout, pp_rank, tp_rank)
            for dp_rank in dp_ranks:
                mem = planner.rank_memory(layout, pp_rank, tp_rank, dp_rank, 0)
                instants = peak.stage_peak(layout, mem, mem["buffers"], nothing,
                                           peak.step_shape(layout, shards, dp_rank), planner.device)
                bound = max(bound, peak.needed_bytes(instants))
    if key is not None:
        planner.state_bounds[key] = bound
    return bound


def _state_key(planner, layout) -> tuple | None:
    """What `state_bound` reads of `layout` (ZeRO-1/2 or none): the ranks' holdings (tp, pp, chunks,
    ep), their states and buffers (ZeRO stage, precision, the gradient replicas, cpu offload) and the
    step's shape (the same); not the micro-batching, checkpointing or how the sequence is split, which
    change only activations. Layouts sharing it share the bound (the 64-GPU MoE: 4710 layouts, 219
    keys). None where the planner adds rows beyond these (a reference model's): no sharing."""
    if getattr(planner, "reference", None) is not None:
        return None
    return (layout.tp, layout.pp, layout.num_model_chunks, layout.ep, layout.zero, layout.precision,
            layout.grad_replicas, layout.cpu_offload)


def _checked(planner, progress=None, **kwargs) -> tuple[list, list]:
    """([(layout, state_bound)] of the candidates (`kwargs`: `Planner.candidates`') `planner` accepts,
    [(layout, why refused)]), made once per planner and keywords: `smallest` after a ranking that
    found none fitting reads the ranking's (copies: the caller may extend them). `progress`: told the
    layouts checked."""
    key = tuple(sorted(kwargs.items()))
    if key not in planner.checked_candidates:
        kept, refused = [], []
        candidates = planner.candidates(**kwargs)
        for done, layout in enumerate(candidates, 1):
            if progress is not None:
                progress.update(checked=(done - 1, len(candidates)))
            try:
                planner.check(layout)
                kept.append((layout, state_bound(planner, layout)))
            except REFUSALS as exc:
                refused.append((layout, f"{type(exc).__name__}: {exc}"))
        if progress is not None:
            progress.update(checked=(len(candidates), len(candidates)))
        planner.checked_candidates[key] = (kept, refused)
    kept, refused = planner.checked_candidates[key]
    return list(kept), list(refused)


def smallest(planner, **kwargs):
    """The estimate of the valid layout needing the least device memory (None: every one is refused),
    found without estimating the layouts whose state alone needs more than one already estimated."""
    kept, _ = _checked(planner, **kwargs)
    ordered = [layout for layout, _ in sorted(kept, key=lambda c: c[1])]
    bounds = dict(kept)
    best = None
    for start in range(0, len(ordered), SMALLEST_CHUNK):       # the next few, their fake runs made at once
        chunk = [layout for layout in ordered[start:start + SMALLEST_CHUNK]
                 if best is None or bounds[layout] <= peak.needed_bytes(best.memory_bytes_per_rank)]
        if not chunk:
            break
        fakecache.prefetch(planner, chunk)
        for layout in chunk:
            try:
                estimate = planner.explain(layout)
            except REFUSALS:
                continue
            if best is None or estimate.memory_bytes_per_rank["peak"] < best.memory_bytes_per_rank["peak"]:
                best = estimate
    return best


def rank(planner, include_unfit: bool = False, **kwargs) -> tuple[list, list]:
    """`Planner.rank`: (the estimates of the layouts that fit, fastest first, then with `include_unfit`
    every other valid one, smallest peak first; [(layout, why refused)])."""
    progress = Progress()
    checked, refused = _checked(planner, progress, **kwargs)
    todo = [layout for layout, bound in checked if include_unfit or bound <= planner.memory_bytes]
    fakecache.prefetch(planner, todo, progress)          # the fake runs they share, in worker processes
    estimates = []
    for done, layout in enumerate(todo, 1):
        try:
            estimates.append(planner.explain(layout))
        except REFUSALS as exc:
            refused.append((layout, f"{type(exc).__name__}: {exc}"))
        progress.update(layouts=(done, len(todo)))
    progress.done()
    fitting = [e for e in estimates if e.fits]
    best = min((e.step_seconds for e in (fitting or estimates)), default=1.0)
    for e in estimates:
        e.relative_step_time = e.step_seconds / best
    ordered = sorted(fitting, key=lambda e: (e.step_seconds, e.memory_bytes_per_rank["peak"],
                                             e.memory_bytes_per_rank["total"]))
    if include_unfit:
        ordered += sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_bytes_per_rank["peak"])
    return ordered, refused
