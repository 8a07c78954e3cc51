"""Falcon (`FalconModel`, `FalconForCausalLM`, `FalconFor*`), all three attention layouts, with
rotary or ALiBi positions. Paths are relative to `FalconModel`.

The fused query_key_value differs by layout (H query heads, K key/value heads, tp ranks):
  * old architecture, multi_query=False: [h0: q k v | h1: q k v | ...]: a contiguous column split
    gives each rank whole heads;
  * new_decoder_architecture: K groups [q * H/K | k | v]: contiguous when tp divides K; when K
    divides tp, each rank computes its H/tp query heads and its group's k and v (shared with the
    other tp/K ranks of the group);
  * multi_query=True (old architecture): [q * H | k | v]: each rank computes its H/tp query heads
    and the one k and v every rank shares.
The shared layouts use `ColumnSubsetLinear` (weight whole on every rank, each rank multiplying by
its rows, the gradient summed over tp): exact at any tp that divides H, at the cost of holding
that one projection unsplit. ALiBi: each rank's attention takes its heads of the bias.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.shardformer.layers import ColumnParallelLinear, ColumnSubsetLinear
from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.styles import STYLES, ShardContext, register_plain_linear, register_style


def _layout(config, tp_size: int) -> tuple[str, list[int] | None]:
    """('split', None) for a contiguous column split, ('rows', rank -> rows) otherwise; raises for a
    layout no tp_size split can give whole heads."""
    heads, hd = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    local = heads // tp_size
    if config.new_decoder_architecture:
        kv = config.num_kv_heads
        if kv % tp_size == 0:
            return "split", None
        if tp_size % kv:
            raise ValueError(f"Falcon with num_kv_heads={kv}: tp_size={tp_size} must divide {kv} or be a multiple "
                             f"of it, so each rank's query heads share one key/value head")
        per_group, ranks_per_group = heads // kv, tp_size // kv

        def rows(rank: int) -> list[int]:
            start = (rank // ranks_per_group) * (per_group + 2) * hd
            q0 = start + (rank % ranks_per_group) * local * hd
            kv0 = start + per_group * hd
            return list(range(q0, q0 + local * hd)) + list(range(kv0, kv0 + 2 * hd))
        return "rows", rows
    if config.multi_query:
        def rows(rank: int) -> list[int]:
            return list(range(rank * local * hd, (rank + 1) * local * hd)) + list(range(heads * hd, (heads + 2) * hd))
        return "rows", rows
    return "split", None


def _validate(path: str, module: nn.Module, tp_size: int) -> None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "query_key_value"):
        raise TypeError(f"{path}: style 'falcon_attention' needs a FalconAttention, found {type(module).__name__}")
    if config.num_attention_heads % tp_size:
        raise ValueError(f"{path}: num_attention_heads={config.num_attention_heads} is not divisible by "
                         f"tp_size={tp_size}")
    _layout(config, tp_size)


def _apply(ctx: ShardContext, path: str, module: nn.Module) -> None:
    kind, rows = _layout(module.config, ctx.tp_size)
    qkv = module.query_key_value
    role = ctx.regions.column_role(f"{path}.query_key_value", own_f=True)    # an f of its own
    if kind == "split":
        module.query_key_value = ColumnParallelLinear.from_native(qkv, ctx.group, role=role)
    else:
        module.query_key_value = ColumnSubsetLinear.from_native(qkv, ctx.group, rows(ctx.tp_rank), role=role)
    if hasattr(module, "num_key_value_groups"):
        # transformers >= 5.25 repeats the key/value heads by this (earlier releases broadcast them
        # themselves): this rank's query heads per key/value head it computes
        heads = module.config.num_attention_heads // ctx.tp_size
        module.num_key_value_groups = heads // _local_kv_heads(module, kind, ctx.tp_size)
    if module.config.alibi:
        STYLES["heads_bias"].apply(ctx, path, module)
    return None


def _local_kv_heads(module: nn.Module, kind: str, tp_size: int) -> int:
    """Key/value heads one rank computes: its share of a contiguous split, else the one it holds (a
    group's, or multi-query's shared head)."""
    config = module.config
    if kind == "rows":
        return 1
    if config.new_decoder_architecture:
        return config.num_kv_heads // tp_size
    return config.num_attention_heads // tp_size          # old architecture: one key/value per head


def _check(config, tp_size: int) -> None:
    if not config.new_decoder_architecture and not config.multi_query and config.num_kv_heads != \
            config.num_attention_heads:
        raise ValueError(f"Falcon (old architecture, multi_query=False) with num_kv_heads={config.num_kv_heads} != "
                         f"num_attention_heads={config.num_attention_heads} is not a layout transformers runs")


def _register() -> None:
    from transformers.models.falcon.modeling_falcon import FalconLinear
    register_plain_linear(FalconLinear)          # input @ W.T + b: exactly nn.Linear
    register_style("falcon_attention", _validate, _apply, block=True)   # under SP: gathers its input once


_register()

FALCON_POLICY = Policy(
    name="falcon",
    plan={
        "h.*.self_attention": "falcon_attention",
        "h.*.self_attention.dense": "rowwise",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    attributes={"h.*.self_attention": {"num_heads": "divide", "num_kv_heads": "kv_heads"}},
    divisible=("num_attention_heads", "ffn_hidden_size"),
    pipeline_layout={"embeddings": ("word_embeddings",), "layers": "h", "tail": ("ln_f",)},
    check=_check,
)
