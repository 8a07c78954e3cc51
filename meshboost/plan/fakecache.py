"""The planner's fake runs (activations.py), cached by their arguments and run ahead in worker processes.

Owns:
- `fake_run` and `derived`: the caches of activations.py's fake run (`_run`: one forward and backward
  on fake tensors, its arguments being everything the run reads: model class, per-rank config, layer
  count, sequences, sequence length, dtype, checkpointing mode, sequence split, vocabulary split, body or
  whole, expert split, the chunked loss's chunk) and of the figures derived from such runs (`_measured_batch`). A ranking asks each run once:
  its layouts share the runs of their per-rank config (layouts differing only in pp, dp, ZeRO or
  micro-batch count ask for the same ones);
- `prefetch(planner, layouts)`: the fake runs a ranking will ask for, found by a recording pass (every
  layout's activation models asked for with the runs answered by placeholders and noted, nothing
  cached), run at once in forked worker processes, one run per task, and stored in the cache, which
  the ranking then reads. Only a speed-up: a worker's result is the same function of the same
  arguments, and a run not prefetched (or failed in a worker) runs when asked, in this process, as
  without a prefetch. `MESHBOOST_PLAN_WORKERS` sets the worker count (default: the CPUs this
  process may use; 1: no workers, no recording pass).
Must not change any figure: the runs are independent and deterministic (fake tensors, no data).
"""

from __future__ import annotations

import functools
import os
from array import array

WORKERS_ENV = "MESHBOOST_PLAN_WORKERS"
MAX_ENTRIES = 4096          # runs kept (~16 KB each: a timeline of ~2000 ops); the oldest go first
# what a run answers while recording: a result's shape (a one-layer run's marks included: live.two_layers)
_PLACEHOLDER = (0, 0, 0, array("q", [0]), array("q", [0]), (0, 0, (), (), 0, False, False, 0, 0, (), 0, 0, 0, 0, 0, 0))

_recording: dict | None = None      # the runs noted by the recording pass (ordered), None outside it
_runs: list = []                    # the fake-run function (fake_run's argument): what workers call
_caches: list[dict] = []            # every cache below: `clear` empties them


def clear() -> None:
    """Forget every fake run and every figure derived from them (a test's fresh start)."""
    for cache in _caches:
        cache.clear()


def _bounded_store(cache: dict, key, value) -> None:
    if len(cache) >= MAX_ENTRIES:
        del cache[next(iter(cache))]
    cache[key] = value


def fake_run(fn):
    """Cache `fn` (a fake run: a pure function of its positional arguments) by its arguments; while
    recording, a run not yet cached is noted and answered by a placeholder."""
    cache: dict = {}

    @functools.wraps(fn)
    def run(*args):
        if args in cache:
            return cache[args]
        if _recording is not None:
            _recording.setdefault(args, None)
            return _PLACEHOLDER
        value = fn(*args)
        _bounded_store(cache, args, value)
        return value

    run.cache, run.uncached = cache, fn
    _runs[:] = [run]
    _caches.append(cache)
    return run


def derived(fn):
    """Cache `fn` (figures computed from fake runs) by its arguments; while recording, a figure not yet
    cached is computed from the placeholders and not stored."""
    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if args in cache:               # made from real runs, whether recording or not
            return cache[args]
        if _recording is not None:
            return fn(*args)
        _bounded_store(cache, args, fn(*args))
        return cache[args]

    wrapper.cache = cache
    _caches.append(cache)
    return wrapper


def recording() -> bool:
    """Whether a recording pass is on (the figures computed now come from placeholders)."""
    return _recording is not None


def workers() -> int:
    """Worker processes for a prefetch: MESHBOOST_PLAN_WORKERS, else the CPUs this process may use."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        if not text.isdigit():
            raise ValueError(f"{WORKERS_ENV}={text!r}: a whole number of worker processes (1: none)")
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def needed_runs(planner, layouts) -> list[tuple]:
    """The fake runs (argument tuples) not yet cached that `planner`'s estimates of `layouts` ask for:
    each layout the planner does not refuse, per pipeline stage its whole-model activations and, for a
    stage that is not the last (or any, interleaved), the body's too. A layout refused or failing here
    is left to the estimate itself."""
    global _recording
    _recording = {}
    asked: set = set()              # activation models already asked for in this pass
    try:
        for layout in layouts:
            try:
                planner.check(layout)
                for pp_rank in range(layout.pp):    # as peak.stage_activations and the planner ask (LoRA: per stage)
                    for body in {False, layout.pp > 1 and (layout.num_model_chunks > 1 or pp_rank < layout.pp - 1)}:
                        key = planner.activation_key(layout, body, pp_rank)
                        if key not in asked:
                            asked.add(key)
                            planner._activation_model(layout, body, pp_rank)
            except Exception:       # noqa: BLE001 - placeholders can fail where real runs do not
                continue
        return list(_recording)
    finally:
        _recording = None


def _compute(args: tuple):
    """A worker's task: one fake run, or the exception's text (the run then repeats when asked)."""
    try:
        return True, _runs[0].uncached(*args)
    except Exception as exc:        # noqa: BLE001 - re-raised by the run in the main process, if asked
        return False, f"{type(exc).__name__}: {exc}"


def prefetch(planner, layouts, progress=None) -> int:
    """Run the fake runs `layouts` will ask for in worker processes and cache their results; returns
    how many were stored (0 with one worker, or where fork is not available). `progress`: told the
    runs done (`update(runs=(done, of))`) as each comes back."""
    import multiprocessing

    count = workers()
    if count <= 1 or not _runs or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    keys = needed_runs(planner, layouts)
    if len(keys) < 2:
        return 0
    from concurrent.futures import ProcessPoolExecutor

    # fork: the workers start with this process's modules imported and its fake-tensor dispatch cache
    with ProcessPoolExecutor(min(count, len(keys)), mp_context=multiprocessing.get_context("fork")) as pool:
        stored = 0
        for done, (args, (ok, value)) in enumerate(zip(keys, pool.map(_compute, keys, chunksize=1)), 1):
            if ok:
                _bounded_store(_runs[0].cache, args, value)
                stored += 1
            if progress is not None:
                progress.update(runs=(done, len(keys)))
    return stored
