"""`python -m meshboost.plan`: the command line of the planner.

Owns parsing the arguments, printing the ranked layouts (or one explained layout) as a table or as
JSON (`--json`: a list of objects with `layout`, `memory_bytes_per_rank`, `comm_bytes_per_step`,
`relative_step_time`, ...), and turning a refused layout into its message and exit status 2.

    python -m meshboost.plan --model llama --set hidden_size=4096,intermediate_size=11008,\\
        num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=32,vocab_size=32000 \\
        --gpus 8 --memory-gb 80 --seq 4096 --global-batch 64
    python -m meshboost.plan --calibrate --calibration cost.json      # measure this machine's constants
    python -m meshboost.plan --model ... --constants cost.json         # rank with them

The constants used (calibrated from a file, or which defaults) are printed with the table (`source`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshboost.plan.cost import CostConstants
from meshboost.plan.layout import parse_layout
from meshboost.shardformer.selective import CHECKPOINTING
from meshboost.plan.lora import LoraOptions
from meshboost.plan.model import parse_overrides
from meshboost.plan.advice import nothing_fits
from meshboost.plan.planner import GIB, MEMORY_KEYS, Planner, _default_batching


EXAMPLE = """example (Llama-2-7B on one node of 8 80 GiB GPUs; then one layout of the table explained):
  python -m meshboost.plan --model llama --set hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,\\
      num_attention_heads=32,num_key_value_heads=32,vocab_size=32000,max_position_embeddings=4096 \\
      --gpus 8 --memory-gb 80 --seq 4096 --global-batch 64
  python -m meshboost.plan --model llama --set ... --layout tp=2,pp=1,dp=4,zero=1,bf16,mb=2x8,ckpt
"""


class _Parser(argparse.ArgumentParser):
    """argparse's conventions (exit status 2) with every error on one line: `meshboost.plan: error: ...`."""

    def error(self, message):
        self.exit(2, f"meshboost.plan: error: {' '.join(str(message).split())}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m meshboost.plan", description=__doc__.split("\n\n")[0], epilog=EXAMPLE,
                        formatter_class=_Formatter)
    p.add_argument("--model", default=None, help="HF model folder, config.json path, or model type (llama, gpt2, ...)")
    p.add_argument("--set", default="", help="config overrides key=value,key=value")
    p.add_argument("--architecture", default=None, help="transformers class (default: the config's, else causal LM)")
    p.add_argument("--gpus", type=int, default=8, help="devices in the world")
    p.add_argument("--nodes", type=int, default=1, help="nodes (each holds gpus / nodes devices)")
    p.add_argument("--memory-gb", type=float, default=80.0, help="device memory in GiB")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"),
                   help="whose temporaries and allocator the peak predicts: the --gpus planned (cuda), or cpu")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"), help="training precision")
    p.add_argument("--layout", default=None, help="explain one layout: tp=2,pp=2,zero=1,mb=4,ckpt=1,... or a table "
                   "row (tp=2,pp=1,dp=4,zero=1,bf16,mb=2x8,ckpt); context parallelism cp=2,cp_mode=ring_attn "
                   "(ColossalAI's sp=2,sp_mode=ring_attn accepted), Megatron sequence parallelism split_gather")
    p.add_argument("--checkpointing", default="full", choices=CHECKPOINTING,
                   help="the recomputation the ranking tries beside none: full (every block's forward again) or "
                   "selective (the matmuls' outputs kept, the cheap ops recomputed); --layout: ckpt=selective")
    p.add_argument("--loss-chunk", type=int, default=None, metavar="N",
                   help="every layout with the chunked loss, N tokens at a time (ShardConfig(loss_chunk_tokens=N)); "
                   "--layout: loss_chunk=N")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R on the frozen model (booster.enable_lora; peft's LoraConfig r)")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-rank: the modules adapted (peft's target_modules: q_proj,v_proj or all-linear)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="with --lora-rank: peft's lora_dropout")
    p.add_argument("--quantize", default=None, choices=("nf4",),
                   help="with --lora-rank: QLoRA, the adapted bases in NF4 (enable_lora(quantize='nf4'))")
    p.add_argument("--reference", nargs="?", const="device", default=None, metavar="MODE",
                   help="preference training: add a frozen reference model on the policy's mesh (boost_reference; "
                        "with --lora-rank the base, no second copy) as the memory row 'reference' and the peak's "
                        "instant 'reference'; '--reference offload': in host memory between uses (boost_reference("
                        "offload=True): 'reference_host', and the copies' time)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to print (table output)")
    p.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    p.add_argument("--json", action="store_true", help="print a JSON list of estimates")
    p.add_argument("--flops", type=float, default=None, help="achieved flop/s of one device (cost model)")
    p.add_argument("--intra-bw", type=float, default=None, help="bytes/s per GPU inside a node")
    p.add_argument("--inter-bw", type=float, default=None, help="bytes/s per GPU across nodes")
    p.add_argument("--constants", default=None, metavar="FILE",
                   help="cost constants JSON (from --calibrate --calibration FILE); default: a known GPU's or H100-class")
    p.add_argument("--calibrate", action="store_true",
                   help="measure flop/s, collective bandwidths and latencies, overheads on this machine and print them")
    p.add_argument("--calibration", default=None, metavar="FILE", help="with --calibrate: write the constants here")
    p.add_argument("--world", type=int, default=2, help="with --calibrate: processes to spawn")
    return p


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option; the example kept as written."""


def _check_numbers(parser, args) -> None:
    """The numbers argparse's types let through that no plan can use (one-line errors, exit 2)."""
    for flag, value in (("--top", args.top), ("--world", args.world)):
        if value < 1:
            parser.error(f"{flag} {value}: pass 1 or more")
    for flag, value in (("--flops", args.flops), ("--intra-bw", args.intra_bw), ("--inter-bw", args.inter_bw)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value:g}: pass a positive rate (or leave it out for the constants' own)")
    if args.lora_rank is not None and args.lora_rank < 1:
        parser.error(f"--lora-rank {args.lora_rank}: pass 1 or more (the adapters' rank, peft's r)")
    if args.lora_rank is None and (args.lora_targets != "all-linear" or args.lora_dropout or args.quantize):
        parser.error("--lora-targets / --lora-dropout / --quantize adapt nothing without --lora-rank R")
    for flag, path in (("--constants", args.constants),):
        if path is not None and not os.path.isfile(path):
            parser.error(f"{flag} {path}: no such file (write one with --calibrate --calibration {path})")


def _constants(args) -> CostConstants:
    from meshboost.plan import calibrate
    c = calibrate.load(args.constants) if args.constants else calibrate.default_constants()
    changes = {}
    if args.flops:
        changes.update(flops_half=args.flops, flops_fp32=args.flops)
    if args.intra_bw:
        changes.update({f"{op}_bytes_s": args.intra_bw for op in ("intra_node", "all_reduce", "reduce_scatter",
                                                                  "all_gather", "send")})
    if args.inter_bw:
        changes["inter_node_bytes_s"] = args.inter_bw
    if changes:
        changes["source"] = c.source + "; overridden on the command line: " + ", ".join(sorted(changes))
    return CostConstants(**{**c.__dict__, **changes})


COLUMNS = (*MEMORY_KEYS, "peak", "reserved")
LABELS = {"optimizer_states": "optimizer"}          # the other columns are headed by their key
WIDTH = 56         # the layout column: tp=1,pp=2,dp=2,cp=2(ring_attn),zero=2,bf16,mb=128x1,ckpt
NUMBER = 11        # a figure's column: "activations"


def _gib(n: float) -> str:
    return f"{n / GIB:{NUMBER}.2f}"


def _columns(estimates) -> tuple:
    """COLUMNS, with the reference model's after the buffers where the estimates have one (--reference)."""
    if not any("reference" in e.memory_bytes_per_rank for e in estimates):
        return COLUMNS
    at = COLUMNS.index("buffers") + 1
    return (*COLUMNS[:at], "reference", *COLUMNS[at:])


def _table(estimates) -> str:
    """The rows of `estimates`: the worst rank's state after backward by kind, then its peak and what the
    device reserves (fits compares that with --memory-gb; the kinds' sum is no instant of the step)."""
    columns = _columns(estimates)
    head = (f"{'layout':{WIDTH}s} " + " ".join(f"{LABELS.get(k, k):>{NUMBER}s}" for k in columns)
            + "   rel.time  fits")
    lines = [head, f"{'':{WIDTH}s} (GiB per rank, worst rank: its state after backward by kind, activations the bytes "
                   "saved for backward; peak: allocated at the step's worst instant; reserved: + allocator margin and "
                   "what lies outside it, which fits compares with --memory-gb)"]
    for e in estimates:
        m = {**e.memory_bytes_per_rank, "reserved": e.memory_bytes_per_rank["reserved"]
             + e.memory_bytes_per_rank["outside"]}
        lines.append(f"{e.layout.describe():{WIDTH}s} " + " ".join(_gib(m[k]) for k in columns)
                     + f"   {e.relative_step_time:8.2f}  {'yes' if e.fits else 'no'}")
    return "\n".join(lines)


def _quant_config():
    from meshboost.booster.qlora import QuantConfig
    return QuantConfig()


def _explained(e, constants=None, lora=None) -> str:
    lines = [f"layout {e.layout.describe()}  (fits: {'yes' if e.fits else 'no'}, predicted step "
             f"{e.step_seconds:.3f} s)", _table([e]), "per stage (worst tp/dp rank of each):"]
    if lora is not None:
        lines.insert(0, f"training {lora.describe()}, the base weights frozen")
    for s in e.per_stage:
        m = s["memory_bytes"]
        lines.append(f"  pp_rank {s['pp_rank']}: {s['layers']} layers, peak {m['peak'] / GIB:.2f} GiB at its "
                     f"{m['instant']}, reserved {(m['reserved'] + m['outside']) / GIB:.2f}; after backward "
                     + ", ".join(f"{k} {m[k] / GIB:.2f}" for k in (*MEMORY_KEYS, "reference", "reference_host")
                                 if k in m))
    lines.append("communication per step (payload bytes, worst stage): "
                 + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in e.comm_bytes_per_step.items()))
    lines += [f"note: {n}" for n in e.notes]
    lines.append(f"peak predicted for device: {e.memory_bytes_per_rank.get('device', '?')}")
    lines.append(f"cost constants: {constants.source}" if constants is not None else "")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # A bad input is one line: transformers' config warnings (token ids outside a --set vocabulary, ...)
    # are not the planner's to print, and they come only on a process's first config, so not always.
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    if args.calibrate:
        from dataclasses import asdict

        from meshboost.plan import calibrate
        constants = calibrate.calibrate(args.world, args.precision)
        if args.calibration:
            calibrate.save(constants, args.calibration)
        print(json.dumps(asdict(constants), indent=1))
        if args.calibration:
            print(f"written to {args.calibration} (read it with --constants {args.calibration})", file=sys.stderr)
        return 0
    if args.model is None:
        parser.error("--model is required (unless --calibrate): an HF model folder, its config.json, or a model type")
    _check_numbers(parser, args)
    try:
        lora = LoraOptions(args.lora_rank, args.lora_targets, args.lora_dropout,
                           _quant_config() if args.quantize else None) if args.lora_rank else None
        planner = Planner(args.model, parse_overrides(args.set), architecture=args.architecture, gpus=args.gpus,
                          nodes=args.nodes, memory_gb=args.memory_gb, seq=args.seq, global_batch=args.global_batch,
                          precision=args.precision, constants=_constants(args), device=args.device, lora=lora,
                          reference=args.reference)
    except (ValueError, TypeError, NotImplementedError, OSError) as exc:
        parser.error(str(exc))
    if args.layout is not None:
        try:
            layout = parse_layout(args.layout, precision=args.precision, loss_chunk=args.loss_chunk,
                                  **_default_batching(planner, args.layout))
            estimate = planner.explain(layout)
        except (ValueError, NotImplementedError, TypeError) as exc:
            parser.error(f"--layout {args.layout}: refused: {type(exc).__name__}: {exc}")
        print(json.dumps([estimate.as_dict()], indent=1) if args.json else _explained(estimate, planner.constants, planner.lora))
        return 0
    return _ranking(parser, args, planner)


def _ranking(parser, args, planner) -> int:
    knobs = dict(checkpointing=(None, args.checkpointing), loss_chunk=args.loss_chunk)
    estimates, refused = planner.rank(include_unfit=args.all, **knobs)
    fitting = [e for e in estimates if e.fits]
    shown = estimates if args.all else fitting
    if not fitting:
        from meshboost.plan.ranking import smallest
        least = (min(estimates, key=lambda e: e.memory_bytes_per_rank["peak"]) if estimates
                 else smallest(planner, **knobs))
        if least is None:
            reasons = sorted({why for _, why in refused})
            parser.error(f"every one of {len(refused)} layouts is refused, e.g. {reasons[0] if reasons else '?'}")
        advice = nothing_fits(planner, [least])
        print("\n".join(advice.lines(planner)) if not args.json else json.dumps([], indent=1))
        parser.error(f"no layout fits --memory-gb {args.memory_gb:g} on --gpus {args.gpus}: the smallest, "
                     f"{advice.smallest.layout.describe()}, needs {advice.need_gib(planner):.2f} GiB per device; "
                     f"fix: {advice.fix(planner)}")
    if args.json:
        print(json.dumps([e.as_dict() for e in shown], indent=1))
        return 0
    print(f"{type(planner.config).__name__} ({planner.cls.__name__}), {planner.num_layers} layers, "
          f"{args.gpus} GPUs of {args.memory_gb:g} GiB, seq {args.seq}, global batch {args.global_batch}: "
          f"{len(fitting)} layouts fit, {len(refused)} refused" + (f"; {planner.lora.describe()}" if planner.lora else ""))
    print(_table(shown[:args.top]))
    print(f"peak predicted for device: {planner.device}; cost constants: {planner.constants.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
