"""Which modules of a HuggingFace model are its transformer layers, for the FSDP2 engine's units.

Owns: reading the layers from the model's own tables (the classes in transformers'
`_no_split_modules`, else the layer lists of its pipeline layout: policy table or
`base_model_pp_plan`), which the engine (meshboost.fsdp imports distributed/ and optim/ only) is
handed, and `shard_units` with them filled in. Must not shard anything: meshboost.fsdp does.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.fsdp import FSDPConfig, Layers
from meshboost.fsdp import shard_units as engine_shard_units
from meshboost.pipeline import get_layout
from meshboost.shardformer import pipeline_layout


def transformer_layers(model: nn.Module) -> Layers:
    """(name, module) of every transformer layer, in forward (pre-)order: modules whose class is in
    `_no_split_modules` (what transformers never splits across devices), else the layer lists of
    the pipeline layout (policy table or `base_model_pp_plan`), else none."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if classes:
        return [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in classes]
    try:
        layout = get_layout(model, pipeline_layout(model))
    except ValueError:
        return []
    base = model.base_model
    prefix = "" if base is model else next(n for n, m in model.named_modules() if m is base) + "."
    return [(f"{prefix}{s.layers}.{i}", layer) for s in layout.segments
            for i, layer in enumerate(base.get_submodule(s.layers))]


def shard_units(model: nn.Module, config: FSDPConfig, ignored: set[int]) -> list[nn.Module]:
    """The engine's `shard_units` with this model's transformer layers: the units, parents after children."""
    return engine_shard_units(model, config, ignored, transformer_layers(model))
