"""Per-step training records that a person can watch, shared by the examples.

Owns: `StepLogger` (one JSON record per optimizer step appended to `metrics.jsonl`, the same scalars
as TensorBoard event files when `tensorboard` is installed, the tqdm bar's postfix), the switch that
says where records go (`--report-to`, shaped like HF Trainer's `report_to`), and the figures a step
record holds beyond the loss: tokens/s, MFU (on a CUDA device whose peak meshboost's planner knows),
allocated and peak memory. It does not train and never calls a collective: the training script
computes the step's figures (the loss averaged over data-parallel replicas, the global token count)
and hands them over on the one rank that reports.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

REPORT_TO = ("all", "jsonl", "tensorboard", "none")
MIB = 2**20


def add_report_arguments(parser) -> None:
    """`--report-to`, as HF Trainer's report_to: where the per-step records go."""
    parser.add_argument("--report-to", "--report_to", dest="report_to", default="all", choices=REPORT_TO,
                        help="per-step records: jsonl (<output-dir>/metrics.jsonl), tensorboard (event files in "
                             "<output-dir>/tensorboard, needs `pip install tensorboard`), all (both; tensorboard "
                             "only when installed) or none")


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The datasheet peak flop/s of this CUDA device for `precision` (dense), from the table meshboost's
    planner keeps (H200, H100, A100); None on the CPU and on devices it does not name."""
    if device.type != "cuda":
        return None
    from meshboost.plan.calibrate import EFFICIENCY, known_gpu_constants
    constants = known_gpu_constants(torch.cuda.get_device_name(device))
    if constants is None:
        return None
    if precision == "fp32":
        return constants.flops_fp32 / EFFICIENCY["flops_fp32"]
    return constants.flops_half / EFFICIENCY["flops_half"]


def memory_mib(device: torch.device) -> dict:
    """Allocated and peak memory of this process: the CUDA caching allocator's on a GPU; on the CPU the
    process's peak resident set (there is no allocator count: `allocated_mib` is None)."""
    if device.type == "cuda":
        return {"allocated_mib": torch.cuda.memory_allocated(device) / MIB,
                "peak_mib": torch.cuda.max_memory_allocated(device) / MIB}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # Linux: KiB
    return {"allocated_mib": None, "peak_mib": peak_kib / 1024 if sys.platform != "darwin" else peak_kib / MIB}


class StepLogger:
    """Writes one record per step on the reporting rank; a no-op elsewhere.

    `flops_per_token`: training flops per token of the whole model (6 x active parameters; None: no
    MFU). `world_size`: the processes whose peak the MFU divides by. `resume_step`: records after it in
    an existing metrics.jsonl are dropped (a resumed run rewrites them); without it the file starts
    empty."""

    def __init__(self, output_dir: str, report_to: str, enabled: bool, device: torch.device, precision: str,
                 world_size: int, flops_per_token: float | None = None, resume_step: int | None = None):
        self.reporter = enabled                            # this rank shows the bar and writes the records
        self.enabled = enabled and report_to != "none"
        self.device, self.world_size, self.flops_per_token = device, world_size, flops_per_token
        self.peak = peak_flops(device, precision)
        self.path = Path(output_dir) / "metrics.jsonl"
        self.jsonl = self.enabled and report_to in ("all", "jsonl")
        self.writer = None
        self.t_last = time.perf_counter()
        if not self.enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if self.jsonl:
            kept = []
            if resume_step is not None and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        if report_to in ("all", "tensorboard"):
            self.writer = _tensorboard_writer(Path(output_dir) / "tensorboard", required=report_to == "tensorboard")

    def restart_clock(self) -> None:
        """Start timing the next step now (after set-up, a checkpoint save or evaluation)."""
        self.t_last = time.perf_counter()

    def log(self, step: int, loss: float | None, lr: float, tokens: int, grad_norm: float | None = None,
            loss_scale: float | None = None, **extra) -> dict:
        """The record of `step` (global tokens trained in it: `tokens`), written where --report-to says;
        returns it (for the progress bar)."""
        now = time.perf_counter()
        seconds, self.t_last = now - self.t_last, now
        tokens_per_s = tokens / seconds if seconds > 0 else None
        mfu = None
        if self.peak and self.flops_per_token and tokens_per_s:
            mfu = self.flops_per_token * tokens_per_s / (self.peak * self.world_size)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                  "step_time_s": seconds, "tokens_per_s": tokens_per_s, "mfu": mfu, **memory_mib(self.device),
                  **({"loss_scale": loss_scale} if loss_scale is not None else {}), **extra}
        if not self.enabled:
            return record
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, step)
        return record

    def where(self, report_to: str) -> str:
        """The closing line's part saying where the records went."""
        records = [str(p) for p, on in ((self.path, self.jsonl), (self.path.parent / "tensorboard",
                                                                  self.writer is not None)) if on]
        return "per-step records: " + (" and ".join(records) if records else f"none (--report-to {report_to})")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def postfix(record: dict) -> dict:
    """The tqdm postfix of a step record: loss, tokens/s, and MFU and memory where known."""
    out = {"loss": f"{record['loss']:.4f}" if record["loss"] is not None else "-"}
    if record.get("tokens_per_s"):
        out["tok/s"] = f"{record['tokens_per_s']:.0f}"
    if record.get("mfu") is not None:
        out["mfu"] = f"{100 * record['mfu']:.1f}%"
    if record.get("allocated_mib") is not None:
        out["mem"] = f"{record['allocated_mib'] / 1024:.1f}/{record['peak_mib'] / 1024:.1f}G"
    return out


def _tensorboard_writer(folder: Path | None, required: bool, probe: bool = False):
    """torch's SummaryWriter (it needs the `tensorboard` package: `pip install -e ".[tensorboard]"`);
    None when it is missing and --report-to all asked for it only as an extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if required:
            raise RuntimeError(f"--report-to tensorboard needs the tensorboard package ({e}); install it with "
                               "`pip install tensorboard` (or meshboost's extra: pip install -e \".[tensorboard]\"), "
                               "or use --report-to jsonl") from e
        print(f"note: tensorboard is not installed ({e}); writing metrics.jsonl only", file=sys.stderr)
        return None
    if probe:
        return None
    return SummaryWriter(log_dir=str(folder), flush_secs=10)


def check_report_to(report_to: str) -> None:
    """Raise on every rank (call it before any collective) when --report-to tensorboard cannot write."""
    if report_to == "tensorboard":
        _tensorboard_writer(None, required=True, probe=True)
