"""Tiny mixture-of-experts models for tests: one config per family (the sizes HF_MODELS.md lists as
fair on CPU: 2 layers, hidden 64, 4 heads, 4 experts, top-2), the causal LM built from it with seeded
weights, batches of causal-LM inputs identical on every rank, and the two halves of every layout
comparison: single-process AdamW training on the whole batches (`train_whole`) and the same training
boosted, checked step by step and weight by weight against it (`train_boosted`). No downloads."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import transformers as tfm

from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.testing.compare import assert_close, booster_backward, gradients_checked, hf_loss, train_reference
from meshboost.testing.models import token_batches

# eps=1e-4: Adam turns a near-zero gradient (an embedding row no token used) into a +-lr step whose sign
# round-off decides; the comparisons are about the layout, not that sign (as the other plugin tests)
LR, EPS = 1e-3, 1e-4

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=160,
              max_position_embeddings=64, intermediate_size=128, use_cache=False, tie_word_embeddings=False)

# family -> (config class, its settings beyond COMMON)
_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    # shared experts and a dense first layer (first_k_dense_replace)
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)),
    # multi-head latent attention, shared experts, a dense first layer
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             rope_scaling=None)),
    # interleaved gate/up rows, expert biases, attention sinks and sliding windows (policies/gpt_oss.py)
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8)),
    # the transposed packed layout ([E, H, 2I] / [E, I, H]) and a shared expert
    "llama4_text": ("Llama4TextConfig", dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
                                             num_experts_per_tok=1, interleave_moe_layer_step=1,
                                             attention_chunk_size=8)),
}
MOE_FAMILIES = tuple(_FAMILIES)


def moe_config(family: str, **overrides):
    """The tiny config of `family` (one of MOE_FAMILIES), with `overrides` (e.g. output_router_logits=True)."""
    name, settings = _FAMILIES[family]
    return getattr(tfm, name)(**{**COMMON, **settings, **overrides})


def build_causal_lm(config, seed: int = 0) -> torch.nn.Module:
    """The causal LM of `config` with seeded random weights, fp32."""
    torch.manual_seed(seed)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def causal_batches(config, steps: int, batch: int = 4, seq: int = 8, seed: int = 5) -> list[dict]:
    """`steps` batches of input_ids and labels (a few labels ignored), the same on every rank."""
    return token_batches(config, steps, batch, seq, seed, ignored=True)


def train_whole(config, batches, replicas: int = 1, model=None, max_norm: float = 0.0, norms: list | None = None,
                first: list | None = None):
    """Single-process AdamW training on the whole batches: (per-step losses, named parameters).
    replicas > 1 (with the router's load-balancing loss): the objective data parallelism trains, DDP's
    semantics for that loss (meshboost's default, docs/moe.md): the cross-entropy of the whole batch plus
    the mean over the replicas' shares of each share's own load-balancing loss (its routing statistics
    are those of the tokens it holds). max_norm > 0: gradients clipped to it, each step's global norm
    appended to `norms`. first: the first step's gradients (`StepGradients`) appended to it."""
    model = build_causal_lm(config) if model is None else model
    loss = hf_loss if replicas == 1 else functools.partial(_replicas_loss, config=config, replicas=replicas)
    ref = train_reference(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), batches, max_norm, loss=loss)
    if max_norm > 0 and norms is not None:
        norms.extend(ref.norms)
    if first is not None and ref.first is not None:
        first.append(ref.first)
    return ref.losses, dict(model.named_parameters())


def _replicas_loss(model, batch: dict, config, replicas: int) -> torch.Tensor:
    """The objective `replicas` data-parallel replicas train (DDP's semantics for the load-balancing loss): the
    whole batch's cross-entropy plus the mean over the replicas' shares of each share's own load-balancing loss."""
    shares = [{k: v.chunk(replicas)[r] for k, v in batch.items()} for r in range(replicas)]
    items = sum(int((h["labels"][:, 1:] != -100).sum()) for h in shares)
    loss = 0
    for h in shares:
        out = model(**h)
        ce_mean = out.loss - config.router_aux_loss_coef * out.aux_loss
        loss = loss + ce_mean * int((h["labels"][:, 1:] != -100).sum()) / items \
            + config.router_aux_loss_coef * out.aux_loss / replicas
    return loss


def train_whole_with_bias(config, batches, rate: float):
    """One process: AdamW on the whole batches, then every router's correction bias moved by
    rate * sign(mean load - load), the loads its router selected over the step (DeepSeek-V3's update, the
    reference of `moe_router_bias_update_rate`). -> (losses, parameters, the biases by name)."""
    model = build_causal_lm(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    gates = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    loads = {id(g): torch.zeros(g.e_score_correction_bias.numel()) for g in gates}

    def count(module, args, out):           # the router's selected expert ids: (logits, weights, ids)
        loads[id(module)] += torch.bincount(out[2].reshape(-1), minlength=loads[id(module)].numel()).float()
    hooks = [g.register_forward_hook(count) for g in gates]
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        with torch.no_grad():
            for g in gates:
                load = loads[id(g)]
                g.e_score_correction_bias += rate * torch.sign(load.mean() - load)
                load.zero_()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    return losses, dict(model.named_parameters()), {n: b.clone() for n, b in model.named_buffers()
                                                    if n.endswith("e_score_correction_bias")}


def train_boosted(config, batches, plugin_config, ref_losses, ref_params, what, dtype=torch.float32,
                  model=None, setup=None, ref_norms=None, ref_first=None):
    """Boost `model` (default: `build_causal_lm(config)`) with AdamW under `plugin_config`, train on
    each rank's share of `batches` (its data-parallel slice), and check every step's loss (the mean
    over the replicas; without stages) and, after the last step, every weight gathered from its shards
    (the fp32 masters in half precision) against the single-process run. setup(booster, model,
    optimizer) runs after boost (loading a checkpoint). ref_norms: each step's global gradient norm of
    the clipped single-process run, which the boosted optimizer's must equal (fp32: 1e-5 relative).
    ref_first: the single-process first step's gradients (`train_whole(first=...)`), which the first
    step's reduced gradients and global norm must equal (`gradients_checked`). Returns (booster, model,
    optimizer)."""
    from meshboost.booster import Booster
    from meshboost.plugins import HybridParallelPlugin

    model = build_causal_lm(config) if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    plugin = HybridParallelPlugin(plugin_config)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    if setup is not None:
        setup(booster, model, opt)
    mesh = plugin.mesh
    for step, batch in enumerate(batches):
        mine = {k: v.chunk(mesh.dp_size)[mesh.dp_rank] for k, v in batch.items()}
        loss = booster_backward(booster, model, opt, mine).detach().float().reshape(1)
        with gradients_checked(model, opt, ref_first, f"{what} step 0", dtype) if ref_first is not None and step == 0 \
                else contextlib.nullcontext():
            opt.step()
        if ref_norms is not None:
            norm = opt.get_grad_norm()
            assert abs(norm - ref_norms[step]) <= 1e-5 * ref_norms[step], f"{what} step {step}: grad norm {norm} " \
                                                                          f"vs {ref_norms[step]}"
        opt.zero_grad()
        # the replicas' losses: their mean is the whole batch's (through a pipeline each replica reports
        # its own token mean, which is the whole batch's only with one replica)
        if plugin.pp_size == 1 or mesh.dp_size == 1:
            dist.all_reduce(loss, group=mesh.dp_group)
            got = loss.item() / mesh.dp_size
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            assert abs(got - ref_losses[step]) <= tol * abs(ref_losses[step]), \
                f"{what} step {step}: {got} vs {ref_losses[step]}"
    for n, p in model.unwrap().named_parameters():   # half precision: the fp32 masters (ZeRO: a collective)
        local = p.detach() if dtype == torch.float32 else opt.master_weight(p)
        if local is None:                       # not replica 0 (its whole tp and ep group skips alike)
            continue
        if isinstance(local, DTensor):          # ZeRO-3 (FSDP2): the dp shards gathered (a collective)
            local = local.full_tensor()
        assert_close(gather_tensor(local, get_tp_info(p)).float(), ref_params[n].detach(), dtype=dtype,
                     msg=f"{what} weight {n}")
    return booster, model, opt
