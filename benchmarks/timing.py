"""Timing helpers shared by the one-process kernel benchmarks (optimizations.py, jit_fused.py): one
forward+backward step, and medians over rounds that alternate the variants so they share the
machine's noise."""

from __future__ import annotations

import statistics
import time


def step_time(model, batch) -> float:
    """Seconds of one forward + backward of `model` on `batch` (its own loss); gradients dropped."""
    start = time.perf_counter()
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def alternate_times(variants: dict, run, steps: int, warmup: int = 3) -> dict[str, list[float]]:
    """The `steps` values of `run(variant)` (seconds) per variant, rounds alternating the variants after
    `warmup` rounds, so round i of every variant shares that moment's noise (paired differences)."""
    times = {label: [] for label in variants}
    for i in range(steps + warmup):
        for label, variant in variants.items():
            t = run(variant)
            if i >= warmup:
                times[label].append(t)
    return times


def timed(fn) -> float:
    """Seconds one call of `fn()` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(variants: dict, run, steps: int, warmup: int = 3) -> dict:
    """Median milliseconds of `run(variant)` per variant, over `steps` alternating rounds after `warmup`."""
    return {label: statistics.median(v) * 1e3 for label, v in alternate_times(variants, run, steps, warmup).items()}
