"""The speed features HybridParallelPlugin composes at their points of `configure`: float8 linears
(shardformer/float8.py) right after sharding, regional compile (shardformer/compile.py) on the blocks
this rank runs once everything else is in place.

Owns: finding those blocks (this rank's pipeline layers, or every layer list of the model's pipeline
layout) and handing them over. Must not compile or convert anything itself.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.distributed.param_info import attach_records, records_of
from meshboost.pipeline import get_layout
from meshboost.shardformer import pipeline_layout
from meshboost.shardformer.compile import CompileConfig, compile_blocks
from meshboost.shardformer.float8 import Float8Config, ShardGroups, convert_float8


def transformer_blocks(model: nn.Module, stages=None, custom_policy=None, feature: str = "compile") -> list[nn.Module]:
    """The transformer blocks of `model` this rank runs: its stages' layers, or every layer of the
    layout's layer lists (the same lists the pipeline cuts); `feature` names the setting that asked
    (compile, activation_offload) in the refusal."""
    if stages is not None:
        return [stages.kept[i] for i in sorted(stages.kept)]
    try:
        layout = get_layout(model, pipeline_layout(model, custom_policy))
    except (ValueError, NotImplementedError) as e:
        raise NotImplementedError(f"{feature}: meshboost applies it to each transformer block and cannot find the "
                                  f"blocks of {type(model).__name__} ({e}); pass a custom_policy with a "
                                  f"pipeline_layout naming its layer list, or drop {feature}") from e
    base = getattr(model, "base_model", model)
    return [layer for segment in layout.segments for layer in base.get_submodule(segment.layers)]


def apply_compile(model: nn.Module, config: CompileConfig | None, stages=None, custom_policy=None) -> None:
    """Compile `model`'s blocks when `config` says so (after sharding, staging, casting and wrapping)."""
    if config is not None:
        compile_blocks(model, transformer_blocks(model, stages, custom_policy), config)


def apply_float8(model: nn.Module, config: Float8Config | None, mesh, fully_sharded: bool, optimizer=None) -> None:
    """Swap `model`'s linears for torchao's float8 ones when `config` says so (after tp sharding, before
    staging and FSDP2, whose all-gather then moves float8), their amaxes agreed over the tp and cp ranks
    that hold the other pieces of their tensors."""
    if config is None:
        return
    cp, tp = mesh.cp_size > 1, mesh.tp_size > 1
    groups = ShardGroups(tp=mesh.tp_group if tp else None, cp=mesh.group("cp") if cp else None,
                         weights=mesh.group(*mesh.dims.grad_axes(), "tp") if fully_sharded and tp else None)
    convert_float8(model, config, mesh.device.type, fsdp_all_gather=fully_sharded, optimizer=optimizer, groups=groups)


def to_device(model: nn.Module, device) -> nn.Module:
    """`model.to(device)`, in place, keeping meshboost's parameter records: for a tensor-subclass parameter
    (torchao's float8 all-gather wrapper, ZeRO-3 under tp) torch swaps in a new tensor's contents, its
    attributes included, which would drop the tp record that checkpoints and the grad norm read."""
    records = {name: records_of(p) for name, p in model.named_parameters()}
    model = model.to(device)
    for name, p in model.named_parameters():
        attach_records(p, records[name])
    return model
