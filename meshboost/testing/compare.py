"""Equivalence harness: one model sharded with tensor parallelism vs the same model unsharded.

Both are built from the same seed and fed the same batch; the check compares loss, logits or
hidden states, gradients gathered along their split dim, and weights after one AdamW step.
`StepGradients` / `gradients_checked` give every layout test the same comparison of one step's
reduced gradients and global norm with one process's: AdamW largely cancels a uniform gradient
scale, so losses and weights after AdamW steps alone pass a reducer off by a constant factor.
`train_reference` is the one-process training run the layout tests compare with (a `Reference`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshboost.distributed.param_info import gather_tensor, get_tp_info, is_dtensor
from meshboost.optim import ZeroOptimizer
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


def booster_backward(booster, model, optimizer, batch: dict) -> torch.Tensor:
    """Forward and backward of a boosted causal-LM-like model on `batch` (through the pipeline schedule
    when the plugin has stages), its loss returned; the caller steps."""
    if getattr(booster.plugin, "pp_size", 1) > 1:
        return booster.execute_pipeline(iter([batch]), model, lambda out, inputs: out.loss, optimizer)["loss"]
    loss = model(**batch).loss
    booster.backward(loss, optimizer)
    return loss


def booster_step(booster, model, optimizer, batch: dict) -> torch.Tensor:
    """One training step (`booster_backward`, then the optimizer's step), its loss returned; the caller
    zeroes gradients."""
    loss = booster_backward(booster, model, optimizer, batch)
    optimizer.step()
    return loss


def hf_loss(model, batch: dict) -> torch.Tensor:
    """The model's own loss on `batch` (a HuggingFace model with labels in the batch)."""
    return model(**batch).loss


@dataclass
class Reference:
    """One process's training run, the unsharded truth a layout's run is compared with."""

    losses: list[float]                 # each step's loss (accumulating: the sum of its pieces' loss / pieces)
    norms: list[float]                  # each step's global gradient norm, before clipping
    first: "StepGradients"              # the first step's gradients, before clipping and the step
    model: torch.nn.Module              # after the last step

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters after the last step, by every name (each name of a tied weight)."""
        return dict(self.model.named_parameters(remove_duplicate=False))


def train_reference(model, optimizer, batches, max_norm: float = 0.0, *, scheduler=None, loss=hf_loss,
                    pieces: int = 1) -> Reference:
    """Single-process training on whole batches, the unsharded reference of the layout tests: per step
    `loss(model, batch)` backward (`pieces` > 1: the batch's rows cut in `pieces` run one after another, each
    loss divided by `pieces`: gradient accumulation), the global grad norm (clipped to `max_norm` when > 0;
    clipping to infinity leaves every gradient bitwise as it was), `optimizer.step()`, zero_grad, then
    `scheduler.step()` when given."""
    losses, norms, first = [], [], None
    for batch in batches:
        parts = [batch] if pieces == 1 else [{k: v.chunk(pieces)[i] for k, v in batch.items()} for i in range(pieces)]
        total = 0.0
        for part in parts:
            part_loss = loss(model, part) / pieces
            part_loss.backward()
            total += part_loss.item()
        if first is None:
            first = StepGradients.of(model)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return Reference(losses, norms, first, model)


@dataclass(frozen=True)
class StepGradients:
    """One step's gradients on one process, which every layout's must equal: by HF name (each name of a
    tied weight) and their global 2-norm (each parameter once)."""

    by_name: dict[str, torch.Tensor]
    norm: float

    @classmethod
    def of(cls, model) -> "StepGradients":
        """The gradients `model` holds now (after the backward, before the step)."""
        by_name = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
                   if p.grad is not None}
        grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
        return cls(by_name, torch.nn.utils.get_total_norm(grads).item() if grads else 0.0)


def held_gradients(model, optimizer) -> dict[str, torch.Tensor] | None:
    """Each reduced gradient this rank's stage holds, whole (tp shards gathered by their records, FSDP2's
    dp shards, ZeRO's partitions gathered over their group: collectives every rank joins), fp32, the fp16
    loss scale divided out, by HF name. None while ZeRO has not reduced them (stage 1 reduces at step
    under a pipeline or without overlap). Not for weights the optimizer averages at step (experts beside
    DDP): their `.grad` is not reduced yet."""
    inner = model.unwrap() if hasattr(model, "unwrap") else model
    scale = float(getattr(optimizer, "loss_scale", 1.0))
    placed = {}
    if isinstance(optimizer, ZeroOptimizer):
        if all(b.grad_shard is None for b in optimizer.buckets):
            return None
        placed = {id(p): (b, i) for b in optimizer.buckets for i, p in enumerate(b.params)}
    out = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        if id(p) in placed:
            b, i = placed[id(p)]
            if b.grad_shard is None:     # a bucket of weights no forward used
                continue
            grad = b.gather_param(i, [b.grad_shard], b.group)[0]
        elif p.grad is None:
            continue
        else:
            grad = p.grad.detach().full_tensor() if is_dtensor(p.grad) else p.grad.detach()
        out[name] = gather_tensor(grad, get_tp_info(p)).float() / scale
    return out


def _held_mismatch(held: dict | None, want: StepGradients, what: str, dtype: torch.dtype) -> str | None:
    """Why this rank's held gradients differ from `want`'s (None: they do not)."""
    for name, grad in sorted((held or {}).items()):
        if name not in want.by_name:
            if grad.any():                      # no gradient on one process: at most a zero one here
                return f"{what}: {name} has a gradient only in this layout"
            continue
        try:
            assert_close(grad, want.by_name[name].float(), dtype=dtype, msg=f"{what}: gradient {name}")
        except AssertionError as e:
            return str(e)
    return None


def _check_held(model, optimizer, want: StepGradients, what: str, dtype: torch.dtype) -> None:
    """`held_gradients` against `want`, judged on every rank together (a stage alone failing would leave
    the others waiting in the step), and every name with a gradient held (reduced) by some rank."""
    held = held_gradients(model, optimizer)
    mine = (sorted(held) if held is not None else None, _held_mismatch(held, want, what, dtype))
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    failed = [(rank, why) for rank, (_, why) in enumerate(everyone) if why is not None]
    assert not failed, f"rank {failed[0][0]}: {failed[0][1]}"
    if all(names is not None for names, _ in everyone):
        missing = set(want.by_name) - set().union(*(set(names) for names, _ in everyone))
        assert not missing, f"{what}: no rank holds a gradient for {sorted(missing)}"


@contextlib.contextmanager
def gradients_checked(model, optimizer, want: StepGradients, what: str, dtype: torch.dtype = torch.float32):
    """Around one `optimizer.step()` (after its backward): on entry every reduced gradient the ranks hold
    (`held_gradients`) against one process's `want`, on exit the step's global gradient norm (tracked
    for this step), within the tolerance of `dtype` (fp32: 1e-5 relative for the norm). A reducer
    scaling gradients by a constant passes losses and weights after AdamW steps, not these."""
    _check_held(model, optimizer, want, what, dtype)
    tracks = hasattr(optimizer, "track_grad_norm")
    if tracks:
        tracked, optimizer.track_grad_norm = optimizer.track_grad_norm, True
    yield
    if tracks:
        optimizer.track_grad_norm = tracked
        norm, rel = optimizer.get_grad_norm(), 1e-5 if dtype == torch.float32 else 2e-2
        assert norm is not None and abs(norm - want.norm) <= rel * max(want.norm, 1e-6), \
            f"{what}: global gradient norm {norm} vs one process's {want.norm}"


def assert_metric_steps_close(got: list[dict], want: list[dict], what: str, rtol: float) -> None:
    """Per-step metric records (a preference objective's loss, rewards, margins, ...) of a layout against one
    process's: the same keys, each value within `rtol` relative (of at least 0.05), and the run's loss moved
    between its first two steps by more than that (a wrong gradient scale shows). A step's accuracy is skipped
    where its margin is rounding (the policy is still its reference)."""
    assert abs(want[1]["loss"] - want[0]["loss"]) > 1e-3 * abs(want[0]["loss"]), f"{what}: the step moved nothing"
    assert len(got) == len(want), (what, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), what
        for key in w:
            if key == "rewards/accuracies" and abs(w.get("rewards/margins", 1.0)) < 1e-4:
                continue
            assert abs(g[key] - w[key]) <= rtol * max(abs(w[key]), 0.05), f"{what} step {step} {key}: {g[key]} vs {w[key]}"
