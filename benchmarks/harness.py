"""Runs inside each benchmark process: builds the configurations of one process group, warms them
up, counts one step, then times interleaved steps, and writes this rank's results to a JSON file.

Owns: timing (median of per-step maxima over ranks, computed by the launcher), the counted step
(meshboost's `comm_counter`, the dispatcher witness, wire bytes, memory) and the interleaving:
configurations sharing a process group take turns step by step, so machine noise (other jobs on a
shared CPU) hits them alike and their ratios stay meaningful.
"""

from __future__ import annotations

import json
import os
import resource
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from benchmarks.models import ModelSpec
from benchmarks.runners import CONFIGS, make_runner
from benchmarks.comm_wait import dispatched_wait_timer
from meshboost.distributed.profiling import comm_counter, dispatched_comm_counter, wait_timer, wire_bytes
from meshboost.optim.memory import memory_breakdown


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(run) -> tuple[float, float, float, float, float]:
    """(whole step, forward+backward, CPU time of this process over the step, blocked in meshboost's
    collectives, asynchronous collectives in flight behind compute) seconds on this rank. On a shared
    machine the wall time is what the scheduler grants; the CPU time is the work."""
    dist.barrier()                      # start together: a step's time is not a wait for the last one
    _sync(run.device)
    cpu = time.process_time()
    with wait_timer() as waits:         # two clock reads per collective: nothing measurable at this size
        start = time.perf_counter()
        run.forward_backward()
        _sync(run.device)
        middle = time.perf_counter()
        run.optimizer_step()
        run.zero_grad()
        _sync(run.device)
        end = time.perf_counter()
    return end - start, middle - start, time.process_time() - cpu, waits.blocked_s, waits.overlapped_s


def _count(run, phase):
    """Run `phase()` under meshboost's counter and the dispatcher witness; wire bytes around it."""
    mesh, names = run.mesh, run.group_names
    with comm_counter(mesh, names) as counted, dispatched_comm_counter(mesh, names) as witness:
        before = wire_bytes()
        phase()
        after = wire_bytes()
    return {"comm": counted.summary() if run.records_collectives else None, "witness": witness.summary(),
            "wire_bytes": None if before is None else after - before}


def _counted_step(run) -> dict:
    """One untimed step with every counter on, in two phases: forward+backward (where tensor
    parallelism talks: the Megatron formula covers exactly this) and the optimizer step (grad
    norm, ZeRO). Weights and grads are read after backward, masters and states after the step.
    A solo configuration's idle ranks skip it (so rank 0 meets no barrier here)."""
    if not run.config.solo:
        dist.barrier()
    fwd_bwd = _count(run, run.forward_backward)
    after_backward = memory_breakdown(run.model, run.optimizer)
    step = _count(run, run.optimizer_step)
    after_step = memory_breakdown(run.model, run.optimizer)
    run.zero_grad()
    memory = {"weights": after_backward["working_weights"], "grads": after_backward["gradients"],
              "masters": after_step["fp32_masters"], "optimizer_states": after_step["optimizer_states"]}
    out = {"fwd_bwd": fwd_bwd, "step": step, "memory": memory}
    if run.config.kind == "dtensor":
        out["dispatched_wait"] = _dispatched_wait(run)
    return out


def _dispatched_wait(run) -> dict:
    """Seconds one more (untimed) step spends in the collectives reaching torch's dispatcher, for a
    peer whose collectives meshboost's wait timer cannot see (DTensor). Not torch's CommDebugMode:
    its module tracker breaks on transformers 5.x forward wrappers (IndexError in
    `_fw_set_module_hook`), and it counts calls only; the dispatcher witness counts the bytes."""
    dist.barrier()
    with dispatched_wait_timer() as waits:
        run.forward_backward()
        run.optimizer_step()
    run.zero_grad()
    return {"blocked_s": waits.blocked_s, "overlapped_s": waits.overlapped_s}


class _Idle:
    """A rank with no part in a solo configuration: it only meets the others at each step's barrier."""

    def __init__(self, config):
        self.config, self.device = config, torch.device("cpu")

    def forward_backward(self) -> float:
        return 0.0

    def optimizer_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def run_group(keys: list[str], spec: ModelSpec, warmup: int, steps: int) -> dict:
    """This rank's results for the configurations `keys` (all of one world size)."""
    results, runs = {}, []
    for key in keys:
        if CONFIGS[key].solo and dist.get_rank() != 0:
            runs.append((key, _Idle(CONFIGS[key])))
            continue
        try:
            runs.append((key, make_runner(CONFIGS[key], spec)))
        except NotImplementedError as exc:      # a feature not built yet: a row that says so
            results[key] = {"skipped": f"{type(exc).__name__}: {exc}"}
        except (ValueError, TypeError, RuntimeError) as exc:    # e.g. a peer that cannot shard this model
            traceback.print_exc()
            results[key] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    for key, run in runs:
        losses = [run.forward_backward()]
        run.optimizer_step()
        run.zero_grad()
        for _ in range(max(warmup - 1, 0)):
            _timed_step(run)
        counted = {} if isinstance(run, _Idle) else _counted_step(run)
        results[key] = {"loss0": losses[0], **counted, "step_s": [], "fwd_bwd_s": [], "cpu_s": [],
                        "blocked_s": [], "overlapped_s": []}
    for i in range(steps):
        # Alternate the order (A B, B A, ...) so neither configuration always runs first after the barrier.
        for key, run in (runs if i % 2 == 0 else runs[::-1]):
            timings = dict(zip(("step_s", "fwd_bwd_s", "cpu_s", "blocked_s", "overlapped_s"), _timed_step(run)))
            for name, value in timings.items():
                results[key][name].append(value)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for key in results:
        results[key]["peak_rss_mb"] = rss_kb / 1024
    return results


def worker(rank: int, world: int, port: int, keys: list[str], spec_dicts: list[dict], warmup: int, steps: int,
           threads: int, outdir: str) -> None:
    """Entry point of one benchmark process (torch.multiprocessing): every model of `spec_dicts` in turn,
    in the same process group."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # torch 2.13 deprecates DDP's broadcast_buffers, which the plugin passes: noise in a table.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    torch.set_num_threads(threads)
    from meshboost.distributed.launch import launch
    launch(rank, world, "127.0.0.1", port, local_rank=rank, seed=1024)
    try:
        for index, spec_dict in enumerate(spec_dicts):
            results = run_group(keys, ModelSpec(**spec_dict), warmup, steps)
            with open(os.path.join(outdir, f"spec{index}_world{world}_rank{rank}.json"), "w") as f:
                json.dump(results, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
