"""Preference fine-tuning (DPO, IPO, SimPO, ORPO, KTO) of a causal LM through the meshboost Booster, at any layout.

    torchrun --nproc_per_node 2 examples/language/preference/finetune.py --model-config llama --size tiny --tp 2 \
        --objective dpo

Model flags are the causal-LM example's (examples/language/causal_lm/model_setup.py: --model or --model-config x
--size, the layout flags, --lora). Data: `--data` JSONL rows {"prompt", "chosen", "rejected"} (a prompt may be
chat messages), by default pairs built offline from the BBC News corpus (pairs.py says how). The reference is a
frozen copy of the starting model boosted like the policy (`--ref-model` loads another), or with --lora the policy's
own base weights (no second copy). Per-step records (loss, rewards, margins, accuracy, log-probs) go to
<output-dir>/metrics.jsonl and TensorBoard (`--report-to`); `--save-every N` writes training checkpoints (the
policy, its optimizer, the schedule, the loader's position, the generators; the frozen reference is rebuilt from
its source) that `--resume` continues exactly; the last line says how the run ended.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "causal_lm"), str(HERE.parents[1])]
import lm_data as data  # noqa: E402  (examples/language/causal_lm)
import model_setup  # noqa: E402
import pairs as pair_data  # noqa: E402  (beside this script)
from common import flags, train_log, train_loop  # noqa: E402  (examples/common)
from common.train_loop import UsageError  # noqa: E402

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
NEEDS_REFERENCE = ("dpo", "ipo", "kto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def arg(name, **kw):
        train_loop.add_flag(p, name, **kw)

    arg("--objective", default="dpo", choices=OBJECTIVES)
    arg("--beta", type=float, default=None, help="temperature (default: 0.1; SimPO 2.0)")
    arg("--label-smoothing", type=float, default=0.0, help="DPO and SimPO: the probability a preference is flipped")
    arg("--gamma", type=float, default=0.5, help="SimPO's target margin")
    arg("--model", default=None, help="HF folder or hub id of a causal LM (its weights are loaded)")
    arg("--ref-model", default=None, help="HF folder of the reference (default: the starting policy's weights)")
    arg("--model-config", default="llama", choices=sorted(model_setup.FAMILIES))
    arg("--size", default="tiny", choices=sorted(model_setup.SIZES))
    arg("--tokenizer", default=None, help="tokenizer folder or id (default: --model's, else all-MiniLM-L6-v2's)")
    arg("--data", default=None, help="JSONL of {prompt, chosen, rejected}; default: pairs from the BBC News corpus")
    arg("--seq", type=int, default=64, help="tokens per sequence (prompt + response), the sequence limit")
    arg("--max-samples", type=int, default=0, help="use the first N pairs; 0 = all")
    for name in ("--tp", "--pp", "--sp", "--ep", "--dp-replicate"):
        arg(name, type=int, default=1, help="as in examples/language/causal_lm/finetune.py")
    arg("--sp-mode", default="all_to_all", choices=("all_to_all", "ring_attn", "split_gather"))
    arg("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    arg("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    arg("--microbatch-size", type=int, default=1, help="pairs per pipeline micro-batch (--pp > 1)")
    arg("--checkpointing", action="store_true")
    flags.add_lora_flags(arg, "train LoRA adapters; the reference is the base (adapters disabled)")
    arg("--batch-size", type=int, default=4, help="pairs per data-parallel replica and step")
    arg("--lr", type=float, default=None, help="peak learning rate (default 5e-5, with --lora 1e-3)")
    arg("--warmup-steps", type=int, default=0)
    arg("--max-grad-norm", type=float, default=1.0)
    arg("--max-steps", type=int, default=0, help="stop after this many steps; 0 = one epoch")
    arg("--save-every", type=int, default=0, help="booster.save_checkpoint every N steps into <output-dir>/checkpoints")
    arg("--resume", action="store_true", help="continue from <output-dir>/checkpoints (exactly: the same records)")
    arg("--stop-after", type=int, default=0, help="stop at this step (the schedule still plans --max-steps)")
    arg("--output-dir", default="outputs/preference")
    arg("--seed", type=int, default=42)
    train_log.add_report_arguments(p)
    args = p.parse_args(argv)
    # what model_setup reads and this script does not offer
    args.plugin, args.fp8, args.compile, args.lora_experts, args.memory_gb = "hybrid_parallel", False, False, False, 0
    args.quantize = None
    return args


def check_args(args) -> None:
    """Pure checks, the same on every rank, before any collective."""
    for name in ("tp", "pp", "sp", "ep", "dp_replicate", "seq", "batch_size", "microbatch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("max_steps", "save_every", "stop_after"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0 (0: off)")
    if args.resume and not (Path(args.output_dir) / "checkpoints").is_dir():
        raise UsageError(f"--resume: no checkpoints under {args.output_dir}/checkpoints (write them with --save-every)")
    if args.pp > 1 and args.batch_size % args.microbatch_size:
        raise UsageError(f"--batch-size {args.batch_size} pairs must be a multiple of --microbatch-size "
                         f"{args.microbatch_size} (every micro-batch holds whole pairs)")
    if args.pp > 1 and args.sp > 1:
        raise UsageError("--pp > 1 with --sp > 1: the preference losses under pipeline x context parallelism are not "
                         "supported (the last stage would hold a piece of every sequence)")
    if args.lora and args.ref_model:
        raise UsageError("--lora uses the policy's base as the reference: drop --ref-model")
    train_log.check_report_to(args.report_to)


def hyper(args) -> dict:
    beta = args.beta if args.beta is not None else (2.0 if args.objective == "simpo" else 0.1)
    out = {"beta": beta}
    if args.objective in ("dpo", "simpo"):
        out["label_smoothing"] = args.label_smoothing
    if args.objective == "simpo":
        out["gamma"] = args.gamma
    return out


def kto_batches(batch: dict) -> tuple[dict, dict, torch.Tensor]:
    """KTO's unpaired rows from the pairs: the chosen responses desirable, the rejected ones not; the KL rows."""
    rows = {k: torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask", "labels")}
    kl = {k: batch[f"kl_{k}"] for k in ("input_ids", "attention_mask", "labels")}
    n = batch["chosen_input_ids"].shape[0]
    return rows, kl, torch.arange(2 * n, device=rows["input_ids"].device) < n


def step(args, booster, model, optimizer, batch, reference):
    from meshboost.post_training import kto_step, preference_step
    if args.objective == "kto":
        rows, kl, desirable = kto_batches(batch)
        return kto_step(booster, model, optimizer, rows, kl, desirable, reference, **hyper(args))
    return preference_step(booster, model, optimizer, batch, args.objective, reference=reference,
                           pad_token_id=args.pad_token_id, max_length=args.seq, **hyper(args))


def boost(args, booster, config):
    """(policy, optimizer, schedule, reference): the reference boosted first, frozen, from the same init."""
    from transformers import get_linear_schedule_with_warmup

    from meshboost.post_training import BASE, boost_reference
    policy = model_setup.build_model(args, config)
    reference = None
    if args.objective in NEEDS_REFERENCE and not args.lora:
        reference = boost_reference(booster, model_setup.build_model(args, copy.deepcopy(config)))
        if args.ref_model or args.model:
            booster.load_model(reference, args.ref_model or args.model)
    if args.lora:
        policy = booster.enable_lora(policy, lora_config=model_setup.lora_config(args))
        reference = BASE if args.objective in NEEDS_REFERENCE else None
    args.lr = args.lr if args.lr is not None else (1e-3 if args.lora else 5e-5)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr)
    schedule = get_linear_schedule_with_warmup(optimizer, min(args.warmup_steps, args.max_steps), args.max_steps)
    model, optimizer, _, _, schedule = booster.boost(policy, optimizer, lr_scheduler=schedule)
    if args.model:
        booster.load_model(model, args.model)
    return model, optimizer, schedule, reference


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        check_args(args)
        tokenizer = data.load_tokenizer(args.tokenizer or args.model or data.default_tokenizer_path())
        pairs = pair_data.read_pairs(args.data) if args.data else pair_data.bbc_pairs()
        rows = pair_data.pair_rows(pairs[:args.max_samples] if args.max_samples else pairs, tokenizer, args.seq)
    except (UsageError, data.DataError) as e:
        say(f"finetune.py: {e}", file=sys.stderr)
        return 2
    args.pad_token_id = tokenizer.pad_token_id
    torch.set_num_threads(train_loop.local_threads())
    from meshboost import Booster
    device = train_loop.launch(args.seed)
    config = model_setup.model_config(args, len(tokenizer))
    layout = copy.copy(args)
    layout.microbatch_size = 2 * args.microbatch_size            # the pipeline's micro-batches count rows
    try:
        plugin, _ = model_setup.build_plugin(layout, config, world_size)
    except (ValueError, NotImplementedError, TypeError) as e:
        say(f"finetune.py: this layout cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    mesh, booster = plugin.mesh, Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(rows, batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    if len(loader) == 0:
        say(f"finetune.py: {len(rows)} pairs make no batch of {args.batch_size} x {mesh.dp_size}", file=sys.stderr)
        return 2
    args.max_steps = min(args.max_steps, len(loader)) if args.max_steps else len(loader)
    try:
        model, optimizer, schedule, reference = boost(args, booster, config)
    except (ValueError, NotImplementedError, TypeError) as e:
        say(f"finetune.py: this layout cannot train this model: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    train_loop.track_grad_norm(optimizer)
    reporter = mesh.dp_rank == 0 and mesh.pp_rank == mesh.pp_size - 1 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    log = print if reporter else (lambda *a, **k: None)
    log(f"layout: tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size} sp={args.sp} zero={args.zero} "
        f"{args.precision} | {args.objective}{' (lora, reference: the base)' if args.lora else ''}, {len(rows)} pairs "
        f"of {args.seq} tokens, batch {args.batch_size} pairs x {mesh.dp_size} replicas, {args.max_steps} steps",
        flush=True)
    ckpt_dir, done, saved = str(Path(args.output_dir) / "checkpoints"), 0, None
    stop = min(args.max_steps, args.stop_after) if args.stop_after else args.max_steps
    if args.resume:
        try:
            done = train_loop.resume_step(booster, ckpt_dir, (model, optimizer, schedule, loader), stop, log)
        except UsageError as e:
            say(f"finetune.py: {e}", file=sys.stderr)
            return 2
    logger = train_log.StepLogger(args.output_dir, args.report_to, reporter, device, args.precision, world_size,
                                  resume_step=done if args.resume else None)
    model.train()
    metrics = {}
    for batch in loader:
        if done >= stop:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        out = step(args, booster, model, optimizer, batch, reference)
        optimizer.step()
        optimizer.zero_grad()
        lr = schedule.get_last_lr()[0]
        schedule.step()
        done += 1
        metrics = out.metrics
        tokens = int(sum(batch[f"{s}_attention_mask"].sum() for s in ("chosen", "rejected"))) * mesh.dp_size
        logger.log(done, metrics["loss"], lr, tokens, grad_norm=optimizer.get_grad_norm(),
                   **{k: v for k, v in metrics.items() if k != "loss"})
        if args.save_every and done % args.save_every == 0:
            booster.save_checkpoint(ckpt_dir, model, optimizer, schedule, loader, step=done)
            saved = done
    logger.close()
    accuracy = metrics.get("rewards/accuracies")
    stopped = done < args.max_steps
    log(f"{'stopped' if stopped else 'done'}: {done} steps of {args.objective}, last loss "
        f"{metrics.get('loss', float('nan')):.6f}" + (f", reward accuracy {accuracy:.3f}" if accuracy is not None else "")
        + (f" | checkpoints: {ckpt_dir} (latest step {saved})" if saved else "")
        + ("; continue with the same command and --resume" if stopped and saved else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
