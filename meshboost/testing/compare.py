"""Equivalence harness: one model sharded with tensor parallelism vs the same model unsharded.

Both are built from the same seed and fed the same batch; the check compares loss, logits or
hidden states, gradients gathered along their split dim, and weights after one AdamW step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.testing.models import build_model, tiny_batch, tiny_config, vocab_edge_batch
from meshboost.testing.tolerance import LOSS_ATOL, assert_close


def model_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, main output) for any head: the model's own loss when it computes one, otherwise a
    smooth function of every output (base models)."""
    out = model(**batch)
    if getattr(out, "loss", None) is not None:
        main = out.logits if hasattr(out, "logits") else out.start_logits
        return out.loss, main
    hidden = out.last_hidden_state
    loss = hidden.float().pow(2).mean()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.float().pow(2).mean()
    return loss, hidden


def gathered(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Full unpadded view of a parameter-shaped tensor (the parameter itself by default)."""
    t = param.detach() if tensor is None else tensor
    return gather_tensor(t, get_tp_info(param))


def check_tp_equivalence(class_name: str, family: str, group, lr: float = 1e-3, shard_options: dict | None = None,
                         attention: str | None = None, device: torch.device | str | None = None,
                         vocab_edges: bool = False, **config_overrides) -> dict:
    """Assert that `class_name` sharded over `group` matches the unsharded model (fp32). Returns
    the measured maxima for reporting. shard_options: more `ShardConfig` fields (kernel switches);
    attention: both models start with this attention implementation (e.g. "eager", so that
    `enable_flash_attention` is what switches the sharded one); device: where both models and the
    batch live (None: where they are built, the CPU); vocab_edges: the batch's ids and labels are
    every vocabulary shard's first and last id (`vocab_edge_batch`) instead of `tiny_batch`'s."""
    config = tiny_config(family, **config_overrides)
    ref = build_model(class_name, copy.deepcopy(config), seed=0)
    par = build_model(class_name, copy.deepcopy(config), seed=0)
    if attention is not None:
        ref.set_attn_implementation(attention)
        par.set_attn_implementation(attention)
    batch = vocab_edge_batch(class_name, config, dist.get_world_size(group)) if vocab_edges \
        else tiny_batch(class_name, config)
    if device is not None:             # NCCL needs the tensors on the GPU
        ref.to(device), par.to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
    where = class_name
    # eps=1e-4: Adam turns a near-zero gradient into a +-lr step whose sign is decided by
    # round-off; a larger eps keeps the comparison about sharding, not about that sign.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-4)
    par_opt = torch.optim.AdamW(par.parameters(), lr=lr, eps=1e-4)   # built before sharding: must stay valid
    ShardFormer(ShardConfig(tensor_parallel_process_group=group, **(shard_options or {}))).optimize(par)

    # Evaluation (before any step) sees full-size outputs: logits trimmed to the real vocabulary.
    ref.eval(), par.eval()
    with torch.no_grad():
        _, ref_out = model_loss(ref, batch)
        _, par_out = model_loss(par, batch)
    assert par_out.shape == ref_out.shape, f"{where}: eval output shape {par_out.shape} vs {ref_out.shape}"
    assert_close(par_out, ref_out, msg=f"{where} eval output")
    ref.train(), par.train()
    ref_loss, _ = model_loss(ref, batch)
    par_loss, _ = model_loss(par, batch)
    ref_loss.backward()
    par_loss.backward()
    assert abs(ref_loss.item() - par_loss.item()) <= LOSS_ATOL[torch.float32], \
        f"{where}: loss {par_loss.item()} vs reference {ref_loss.item()}"

    ref_params = dict(ref.named_parameters())
    par_params = dict(par.named_parameters())
    assert ref_params.keys() == par_params.keys(), f"{where}: parameter names changed by sharding"
    for name, p in par_params.items():
        r = ref_params[name]
        if r.grad is None:
            assert p.grad is None, f"{where}: {name} has a grad only when sharded"
            continue
        assert_close(gathered(p, p.grad), r.grad, msg=f"{where} grad {name}")
    ref_opt.step()
    par_opt.step()
    for name, p in par_params.items():
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{where} weight after AdamW {name}")

    return {"loss": par_loss.item(), "ref_loss": ref_loss.item()}


def booster_step(booster, model, optimizer, batch: dict) -> torch.Tensor:
    """One training step of a boosted causal-LM-like model on `batch` (through the pipeline schedule
    when the plugin has stages), its loss returned; the caller zeroes gradients."""
    if getattr(booster.plugin, "pp_size", 1) > 1:
        loss = booster.execute_pipeline(iter([batch]), model, lambda out, inputs: out.loss, optimizer)["loss"]
    else:
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
    optimizer.step()
    return loss


def train_reference(model, optimizer, batches, max_norm: float = 0.0) -> tuple[list[float], list[float]]:
    """Single-process training on whole batches (the unsharded reference of the plugin tests): per step
    the model's loss and the global grad norm (clipped to `max_norm` when > 0). Returns (losses, norms)."""
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms
