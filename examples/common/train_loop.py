"""The pieces of a training script that every example shares, so each script keeps only its task.

Owns: the usage error every script reports in one message (exit code 2), flags taken in either spelling
(`--output-dir` / `--output_dir`), the process group of a launch (torchrun's, or a one-process group for
plain `python script.py`) and this process's share of the cores, one optimizer step (through the pipeline
schedule when the layout has stages), the figures a step record needs from the step (the loss averaged
over data-parallel replicas, the global token count, the gradient norm, the loss scale under fp16), the
flops per token MFU is measured against, and the final save (the HF folder, or peft's adapter folder).
Everything parallel is the Booster's; the per-step records are train_log.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class UsageError(Exception):
    """A flag combination or environment that cannot run, said in one message (exit code 2) on every rank."""


def add_flag(parser, name: str, **kw) -> None:
    """`parser.add_argument` for `--name-with-dashes` and `--name_with_underscores` alike."""
    body = name[2:]
    flags = [name] + [f"--{alt}" for alt in {body.replace("_", "-"), body.replace("-", "_")} if alt != body]
    parser.add_argument(*flags, **kw)


def local_threads() -> int:
    """This process's share of the machine's cores (N processes on a node: 2 on 2 cores get 1 each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def launch(seed: int) -> torch.device:
    """The process group (torchrun's environment; plain `python script.py`: a one-process group) and
    this process's device."""
    import meshboost
    if "RANK" not in os.environ:
        from meshboost.testing import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    meshboost.launch_from_torch(seed=seed)
    return meshboost.get_current_device()


def resume_step(booster, ckpt_dir: str, objects: tuple, stop: int, log) -> int:
    """--resume: the step `ckpt_dir`'s latest checkpoint holds (0 without one), restored into the boosted `objects`
    (model, optimizer, schedule[, loader]); UsageError when this run would stop there already (every rank read
    the same committed step: all refuse together)."""
    meta = booster.load_checkpoint(ckpt_dir, *objects)
    step = meta["step"] if meta else 0
    log(f"resumed from {ckpt_dir} at step {step}", flush=True)
    if step >= stop:
        raise UsageError(f"--resume: the checkpoint is at step {step}, and this run stops at step {stop} "
                         "(--max-steps / --stop-after); raise them to train on")
    return step


def own_loss(outputs, inputs):
    """The criterion: the HF head's own loss (a causal LM shifts its labels inside)."""
    return outputs.loss


def train_step(booster, model, optimizer, batch: dict, pp: int, criterion=own_loss):
    """One optimizer step on `batch`; its loss on the ranks that have it (None on earlier pipeline stages)."""
    if pp > 1:
        loss = booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True).get("loss")
    else:
        loss = criterion(model(**batch), batch)
        booster.backward(loss, optimizer)
    if not hasattr(optimizer, "track_grad_norm"):   # gradients final after backward (torch DDP): measure them
        optimizer.clip_grad_by_norm(float("inf"))     # max_norm inf: the norm for get_grad_norm, no clipping
    optimizer.step()
    optimizer.zero_grad()
    return loss


def step_figures(loss, batch: dict, mesh, device) -> tuple[float | None, int]:
    """(the loss averaged over the data-parallel replicas, the tokens the whole step trained on: the
    attention mask's ones): one all-reduce over dp on the ranks that hold a loss."""
    import torch.distributed as dist
    mask = batch.get("attention_mask")
    tokens = float(mask.sum()) if mask is not None else float(batch["input_ids"].numel())
    if loss is None:
        return None, int(tokens * mesh.dp_size)
    t = torch.tensor([loss.detach().float().item(), tokens], device=device)
    if mesh.dp_size > 1:
        dist.all_reduce(t, group=mesh.dp_group)
        t[0] /= mesh.dp_size
    return t[0].item(), int(t[1].item())


def track_grad_norm(optimizer) -> None:
    """Ask the boosted optimizer for the global gradient norm on every step (its step computes it once,
    over every rank that holds a piece); optimizers without the switch (torch DDP's) are measured by
    `train_step`."""
    if hasattr(optimizer, "track_grad_norm"):
        optimizer.track_grad_norm = True


def loss_scale(optimizer, precision: str) -> float | None:
    """The loss scale of the last step under fp16 (meshboost's mixed precision, or the Booster's autocast
    scaler); None without loss scaling."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:
        return float(scaler.get_scale()) if scaler.is_enabled() else None
    if precision == "fp16" and hasattr(optimizer, "get_loss_scale"):
        return float(optimizer.get_loss_scale())
    return None


def flops_per_token(model) -> float:
    """Training flops per token, 6 x the parameters a token passes through: every dense weight, and of
    each experts module the top-k share (the embedding's lookup is not a matmul and is left out)."""
    from meshboost.shardformer.layers.expert_parallel import experts_modules
    config = model.config
    experts = {id(p) for _, m in experts_modules(model) for p in m.parameters()}
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    total = sum(p.numel() for p in model.parameters() if id(p) not in experts and id(p) not in embedding)
    if experts:
        n_experts = next(getattr(config, f) for f in ("num_experts", "num_local_experts", "n_routed_experts")
                         if isinstance(getattr(config, f, None), int))
        expert_params = sum(p.numel() for _, m in experts_modules(model) for p in m.parameters())
        total += expert_params * config.num_experts_per_tok / n_experts
    return 6.0 * total


def save_trained(booster, model, folder: Path, lora: bool, tokenizer, write_tokenizer: bool) -> None:
    """The trained model as an HF folder `from_pretrained` loads (sharded safetensors), or with `lora` the
    adapters as a peft folder; every rank calls it, `write_tokenizer` on one."""
    if lora:
        booster.save_lora_as_pretrained(model, str(folder), use_safetensors=True)
    else:
        booster.save_model(model, str(folder), shard=True, use_safetensors=True)
    if write_tokenizer:
        tokenizer.save_pretrained(folder)
