"""Calibrating the cost model's constants on this machine: `python -m meshboost.plan --calibrate`.

Owns: `calibrate(world, precision, launcher)` (a short run, about 20 s on a 2-core CPU: starts `world`
processes with `launcher`, by default `meshboost.distributed.local.spawn`, unless a process group is
already up, each on the device the environment gives, gloo on CPU and NCCL on CUDA as
`meshboost.distributed.launch` picks) measuring (with timings.py's measurements), on every rank at
once (so that ranks sharing a machine share it as they do in training):
    flops_half / flops_fp32 and layer_overhead_s: transformers' Llama decoder layer (hidden 256 on
        CPU, 2048 on CUDA) forward+backward timed at two token counts, in the precision asked for; a
        line through them gives the achieved flop/s (its flops counted as cost.py counts them) and the
        fixed cost per layer per micro-batch (Python, autograd, kernel launches: what dominates small
        models); the other precision's rate is scaled by square matmuls' ratio of the two;
    microbatch_overhead_s: the same for the ends (an embedding, a norm and a tiny vocab head + loss);
    optimizer_elements_s: AdamW's elements per second over the same decoder layer's fp32 parameters;
    fresh_bytes_s: bytes per second a clone of a 64 MiB tensor writes into newly allocated memory
        (on a CPU its pages fault on first touch; ZeRO's per-step buffers pay it);
    solo_speedup: the layer's speed with the other ranks idle over its speed with all computing (ranks
        that share cores: a pipeline's bubble runs at the solo speed);
    pipeline_overhead_s: meshboost's 1F1B schedule's own cost per micro-batch slot (a tiny Llama over
        pp=world stages at 2 and 16 micro-batches, less the layers' and ends' fixed cost);
    for all_reduce, reduce_scatter, all_gather, all_to_all and send/recv over the world group: latency (seconds per call) and
    bus bandwidth (bytes/s, after the ring factor), a least-squares line through a few message sizes;
`known_gpu_constants(name)` (defaults for H100 / H200 / A100 by `torch.cuda.get_device_name`: datasheet
peak x an efficiency factor, each said in `source`), `default_constants()` (the known GPU's when CUDA
is present, else CostConstants()), and the JSON file (`save` / `load`) the planner reads with
`--constants FILE`. Must not model time (cost.py does).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, fields, replace

from meshboost.plan.cost import CostConstants
from meshboost.plan.timings import (MEASURED_OPS, collectives, ends_overhead, fresh_rate, layer_timings,
                                    matmul_flops, optimizer_rate, pipeline_overhead)

# datasheet dense peaks (no sparsity): flop/s bf16, flop/s fp32 (no TF32), NVLink bytes/s per direction
_GPUS = {
    "H200": (989e12, 67e12, 450e9, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 67 TFLOPS fp32, "
             "NVLink 900 GB/s (450 per direction)"),
    "H100": (989e12, 67e12, 450e9, "NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense, 67 TFLOPS fp32, "
             "NVLink 900 GB/s (450 per direction)"),
    "A100": (312e12, 19.5e12, 300e9, "NVIDIA A100 SXM datasheet: 312 TFLOPS bf16 dense, 19.5 TFLOPS fp32, "
             "NVLink 600 GB/s (300 per direction)"),
}
EFFICIENCY = {"flops_half": 0.4, "flops_fp32": 0.75, "intra_node_bytes_s": 0.45}
INTER_NODE_BYTES_S = 25e9 * 0.8      # 200 Gb/s InfiniBand per GPU x 0.8


def known_gpu_constants(name: str) -> CostConstants | None:
    """CostConstants for a GPU named like `torch.cuda.get_device_name()` (H200, H100, A100), else None."""
    for key, (half, fp32, nvlink, sheet) in _GPUS.items():
        if key in name.upper():
            bus = nvlink * EFFICIENCY["intra_node_bytes_s"]
            return CostConstants(
                flops_half=half * EFFICIENCY["flops_half"], flops_fp32=fp32 * EFFICIENCY["flops_fp32"],
                intra_node_bytes_s=bus, all_reduce_bytes_s=bus, reduce_scatter_bytes_s=bus, all_gather_bytes_s=bus,
                send_bytes_s=bus, inter_node_bytes_s=INTER_NODE_BYTES_S,
                source=f"defaults for {key} ({name}): {sheet}; x efficiency {EFFICIENCY['flops_half']} (bf16), "
                       f"{EFFICIENCY['flops_fp32']} (fp32), {EFFICIENCY['intra_node_bytes_s']} (NVLink); "
                       "across nodes 200 Gb/s InfiniBand x 0.8; latencies and overheads CostConstants' defaults")
    return None


def default_constants() -> CostConstants:
    """The known GPU's defaults when CUDA is present and named, else CostConstants() (H100-class)."""
    import torch
    if torch.cuda.is_available():
        return known_gpu_constants(torch.cuda.get_device_name()) or CostConstants()
    return CostConstants()


def save(constants: CostConstants, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(constants), f, indent=1)


def load(path: str) -> CostConstants:
    """CostConstants from a JSON file `save` (or `--calibrate --calibration FILE`) wrote; unknown keys are
    an error, missing ones keep their defaults."""
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in fields(CostConstants)}
    if unknown := set(data) - known:
        raise ValueError(f"{path}: unknown cost constants {sorted(unknown)} (expected some of {sorted(known)})")
    constants = CostConstants(**data)
    for f in fields(CostConstants):
        value = getattr(constants, f.name)
        if f.name != "source" and value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{path}: cost constant {f.name}={value!r} must be a finite number >= 0")
    return constants


# -- the measurements (on every rank, inside a process group) ----------------------------------------
def measure(precision: str = "bf16") -> dict:
    """This rank's figures (call on every rank of an initialised process group, or with none at all:
    then no collective is measured)."""
    import torch
    import torch.distributed as dist

    from meshboost.distributed.launch import get_current_device
    device = get_current_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 4096 if device.type == "cuda" else 384
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    dtype = torch.float32 if precision == "fp32" else half
    matmul = {"flops_half": matmul_flops(half, device, n, 5, sync),
              "flops_fp32": matmul_flops(torch.float32, device, n, 5, sync)}
    # a transformer layer's achieved rate in the precision asked for (the other scaled by the matmuls')
    hidden, tokens = (2048, (512, 4096)) if device.type == "cuda" else (256, (64, 512))
    asked = "flops_fp32" if precision == "fp32" else "flops_half"
    overhead, rate = layer_timings(device, sync, dtype, hidden, tokens, matmul[asked])
    other = "flops_half" if asked == "flops_fp32" else "flops_fp32"
    out = {asked: rate, other: rate * matmul[other] / matmul[asked], "layer_overhead_s": overhead,
           "matmul_flops": matmul, "layer_hidden": hidden}
    out["microbatch_overhead_s"] = ends_overhead(device, sync)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the same layer with the other ranks idle (as in a pipeline's bubble): ranks that share a CPU's
        # cores (or a GPU's) run faster alone; 1 when they do not share
        solo = torch.zeros(1, dtype=torch.float64, device=device)
        dist.barrier()
        if dist.get_rank() == 0:
            solo[0] = layer_timings(device, sync, dtype, hidden, tokens, matmul[asked])[1]
        dist.barrier()
        dist.broadcast(solo, 0)
        out["solo_speedup"] = max(1.0, float(solo[0]) / rate)
        # the schedule's own cost per slot: the pipeline's slot less its layer's time (the line fitted
        # above; a Llama layer holds 16 hidden^2 weights) and the ends' fixed cost
        layer_s = overhead + (6 * 16 * hidden ** 2 * tokens[0] + 12 * tokens[0] ** 2 * hidden) / rate
        slot = pipeline_overhead(dist.get_world_size(), sync, hidden, tokens[0], precision)
        out["pipeline_overhead_s"] = max(0.0, slot - layer_s - out["microbatch_overhead_s"])
        out["pipeline_slot_s"] = slot
    out["optimizer_elements_s"] = optimizer_rate(device, sync, hidden)
    out["fresh_bytes_s"] = fresh_rate(device, sync)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        out["collectives"] = collectives(device, sync, world, hidden, tokens[0])
        out["backend"] = dist.get_backend()
    out.update(device=str(device), world=world, precision=precision,
               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return out


def constants_from(measured: dict, base: CostConstants | None = None) -> CostConstants:
    """CostConstants from `measure`'s figures (the across-node ones stay `base`'s: one machine cannot
    measure them)."""
    base = base or default_constants()
    changes = {k: measured[k] for k in ("flops_half", "flops_fp32", "layer_overhead_s", "microbatch_overhead_s",
                                        "optimizer_elements_s", "solo_speedup", "pipeline_overhead_s", "fresh_bytes_s")
               if k in measured}
    coll = measured.get("collectives")
    if coll:
        for op in MEASURED_OPS:
            if op in coll:                # (constants files written before all_to_all was measured)
                changes[f"{op}_latency_s"], changes[f"{op}_bytes_s"] = coll[op]
        changes["intra_node_bytes_s"] = coll["all_reduce"][1]
    what = (f"calibrated on {measured['device_name']} ({measured['device']}, {measured['world']} processes"
            + (f", {measured['backend']}" if coll else ", no collectives: the bandwidths and latencies are the defaults'")
            + f", {measured['precision']}; flop/s of a hidden-{measured['layer_hidden']} Llama layer, square matmuls "
            + ", ".join(f"{k} {v:.3g}" for k, v in measured["matmul_flops"].items())
            + f"); across nodes: {base.source}")
    return replace(base, **changes, source=what)


def _calibrate_worker(rank: int, world: int, precision: str, outdir: str) -> None:
    result = measure(precision)
    if rank == 0:
        with open(os.path.join(outdir, "measured.json"), "w") as f:
            json.dump(result, f)


def calibrate(world: int = 2, precision: str = "bf16", launcher=None) -> CostConstants:
    """Measure this machine's constants: in the running process group when there is one, else in
    `world` processes started by `launcher(fn, world, *args)` (runs `fn(rank, world, *args)` in each
    over one process group; default `meshboost.distributed.local.spawn`) (on CUDA at most one per
    device; world 1: no collectives measured, their constants stay the defaults')."""
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():
        world = min(world, torch.cuda.device_count())     # NCCL: one process per device
    if dist.is_initialized() or world <= 1:
        return constants_from(measure(precision))
    if launcher is None:
        from meshboost.distributed.local import spawn as launcher
    with tempfile.TemporaryDirectory() as outdir:
        launcher(_calibrate_worker, world, precision, outdir)
        with open(os.path.join(outdir, "measured.json")) as f:
            return constants_from(json.load(f))
