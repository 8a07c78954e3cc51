"""The peer: PyTorch's own DTensor tensor parallelism (`parallelize_module` with ColwiseParallel /
RowwiseParallel) applied to the same HF model, as a user following the PyTorch TP tutorial would.

Owns: the per-family plans and the few model edits DTensor needs on transformers 5.x:
- GPT-2's Conv1D leaves become nn.Linear (DTensor styles accept only nn.Linear / nn.Embedding);
  c_attn's output rows [all q | all k | all v] are reordered rank-major so that a contiguous
  Shard(0) gives each rank its own q, k and v heads, and `attn.split_size` becomes E/P.
- BERT's `num_attention_heads` / `all_head_size` become per-rank values (HF_MODELS.md).
- Tied embeddings are re-tied after sharding (parallelize_module makes new Parameters).
The LM head keeps vocab-split logits (Shard(-1)) and the loss runs under `loss_parallel()`, the
counterpart of meshboost's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _conv1d_to_linear(conv: nn.Module) -> nn.Linear:
    """GPT-2 Conv1D (weight [in, out]) as an equivalent nn.Linear (weight [out, in])."""
    nx, nf = conv.weight.shape
    linear = nn.Linear(nx, nf, bias=conv.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


def _rank_major_qkv(linear: nn.Linear, tp: int) -> None:
    """Reorder [q | k | v] output rows to [q0 k0 v0 | q1 k1 v1 | ...] (a chunk of heads each)."""
    out = linear.weight.shape[0]
    e = out // 3
    idx = torch.arange(out).view(3, tp, e // tp).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx])


def _lm_head_style():
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)


def _embedding_style():
    return RowwiseParallel(input_layouts=Replicate())


def _plan(model: nn.Module, family: str) -> dict:
    if family == "gpt2":
        plan = {"transformer.wte": _embedding_style(), "lm_head": _lm_head_style()}
        for i in range(len(model.transformer.h)):
            p = f"transformer.h.{i}"
            plan |= {f"{p}.attn.c_attn": ColwiseParallel(), f"{p}.attn.c_proj": RowwiseParallel(),
                     f"{p}.mlp.c_fc": ColwiseParallel(), f"{p}.mlp.c_proj": RowwiseParallel()}
        return plan
    if family == "llama":
        plan = {"model.embed_tokens": _embedding_style(), "lm_head": _lm_head_style()}
        for i in range(len(model.model.layers)):
            p = f"model.layers.{i}"
            plan |= {f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
            plan |= {f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
            plan |= {f"{p}.self_attn.o_proj": RowwiseParallel(), f"{p}.mlp.down_proj": RowwiseParallel()}
        return plan
    if family == "bert":
        plan = {"bert.embeddings.word_embeddings": _embedding_style()}
        for i in range(len(model.bert.encoder.layer)):
            p = f"bert.encoder.layer.{i}"
            plan |= {f"{p}.attention.self.{n}": ColwiseParallel() for n in ("query", "key", "value")}
            plan |= {f"{p}.attention.output.dense": RowwiseParallel(),
                     f"{p}.intermediate.dense": ColwiseParallel(), f"{p}.output.dense": RowwiseParallel()}
        return plan
    raise ValueError(f"no DTensor plan for family {family!r}")


def parallelize_hf(model: nn.Module, family: str, tp_mesh) -> nn.Module:
    """Shard `model` in place over the 1-D DeviceMesh `tp_mesh` with DTensor; returns it."""
    tp = tp_mesh.size()
    if family == "gpt2":
        for block in model.transformer.h:
            for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                                 (block.mlp, "c_proj")):
                setattr(parent, name, _conv1d_to_linear(getattr(parent, name)))
            _rank_major_qkv(block.attn.c_attn, tp)
            block.attn.split_size //= tp
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, tp_mesh, _plan(model, family))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if family == "bert":
        for layer in model.bert.encoder.layer:
            layer.attention.self.num_attention_heads //= tp
            layer.attention.self.all_head_size //= tp
    return model
