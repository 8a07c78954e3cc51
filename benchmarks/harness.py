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
from meshboost.distributed.profiling import comm_counter, dispatched_comm_counter, wire_bytes
from meshboost.optim.memory import memory_breakdown


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(run) -> tuple[float, float, float]:
    """(whole step, forward+backward, CPU time of this process over the step) seconds on this rank.
    On a shared machine the wall time is what the scheduler grants; the CPU time is the work."""
    dist.barrier()                      # start together: a step's time is not a wait for the last one
    _sync(run.device)
    cpu = time.process_time()
    start = time.perf_counter()
    run.forward_backward()
    _sync(run.device)
    middle = time.perf_counter()
    run.optimizer_step()
    run.zero_grad()
    _sync(run.device)
    return time.perf_counter() - start, middle - start, time.process_time() - cpu


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
    norm, ZeRO). Weights and grads are read after backward, masters and states after the step."""
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
        out["comm_debug_mode_calls"] = _comm_debug_mode_calls(run)
    return out


def _comm_debug_mode_calls(run) -> int:
    """Collectives of one more step as torch's own CommDebugMode counts them (calls only): a
    cross-check of the dispatcher witness on the DTensor rows."""
    from torch.distributed.tensor.debug import CommDebugMode

    dist.barrier()
    with CommDebugMode() as mode:
        run.forward_backward()
        run.optimizer_step()
    run.zero_grad()
    return mode.get_total_counts()


def run_group(keys: list[str], spec: ModelSpec, warmup: int, steps: int) -> dict:
    """This rank's results for the configurations `keys` (all of one world size)."""
    results, runs = {}, []
    for key in keys:
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
        results[key] = {"loss0": losses[0], **_counted_step(run), "step_s": [], "fwd_bwd_s": [], "cpu_s": []}
    for i in range(steps):
        # Alternate the order (A B, B A, ...) so neither configuration always runs first after the barrier.
        for key, run in (runs if i % 2 == 0 else runs[::-1]):
            seconds, fwd_bwd, cpu = _timed_step(run)
            results[key]["step_s"].append(seconds)
            results[key]["cpu_s"].append(cpu)
            results[key]["fwd_bwd_s"].append(fwd_bwd)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for key in results:
        results[key]["peak_rss_mb"] = rss_kb / 1024
    return results


def worker(rank: int, world: int, port: int, keys: list[str], spec_dict: dict, warmup: int, steps: int,
           threads: int, outdir: str) -> None:
    """Entry point of one benchmark process (torch.multiprocessing)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # torch 2.13 deprecates DDP's broadcast_buffers, which the plugin passes: noise in a table.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    torch.set_num_threads(threads)
    from meshboost.distributed.launch import launch
    launch(rank, world, "127.0.0.1", port, local_rank=rank, seed=1024)
    try:
        results = run_group(keys, ModelSpec(**spec_dict), warmup, steps)
        with open(os.path.join(outdir, f"world{world}_rank{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
