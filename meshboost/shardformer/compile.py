"""Regional compilation: every transformer block compiled by torch.compile after sharding (torchtitan's
per-block compile, not the whole model).

Owns: `CompileConfig` (torch.compile's arguments for the blocks) and `compile_blocks`, which makes a
sharded model's blocks compile without a graph per layer: each block runs its first call eagerly
(the first call settles what meshboost decides at a layer's first call, e.g. sequence parallelism's
classification of replicated modules, whose hook then removes itself) and is compiled with
`nn.Module.compile` right after it, so the module keeps its name, its parameters and its hooks.
Identical blocks then share one graph: dynamo inlines nn.Modules (`inline_inbuilt_nn_modules`, on by
default in torch >= 2.5), so parameters are graph inputs, not guards, and nothing meshboost leaves on a
block is read by identity. Two things that would be read per layer are taken away here:
transformers' key/value cache in training (`use_cache=False` unless the caller asks for one or the rows
are packed, whose documents the cache decides on: the cache indexes its layers by `layer_idx`, one guard
per layer, and training never reads it), and the per-tp-
rank dropout streams (shardformer/rng.py) when the model draws no dropout at all (their generator
switches are host operations dynamo cannot trace; with dropout they stay, each a graph break,
docs/compile.md). Must not compile anything but the blocks it is handed, nor fork a forward.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.shardformer import packed_rows
from meshboost.shardformer.optimizations import say
from meshboost.shardformer.shard_config import switch_config
from meshboost.shardformer.rng import get_tp_rank_rng, remove_tp_rank_rng

# torch.compile's modes (None: its default)
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileConfig:
    """How each transformer block is compiled (`torch.compile`'s arguments, see its documentation)."""

    # the compiler: "inductor" (generated kernels; on CPU C++ through the installed compiler),
    # "aot_eager" (dynamo and AOTAutograd only: the same graphs, eager kernels), or any registered backend
    backend: str = "inductor"
    mode: str | None = None
    # raise on any graph break inside a block instead of running its pieces
    fullgraph: bool = False
    # None: torch's default (static shapes first, dynamic after a size changes); False: a graph per shape
    dynamic: bool | None = None
    # inductor / backend options
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        import torch._dynamo
        if not isinstance(self.backend, str) or self.backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"CompileConfig(backend={self.backend!r}): not a torch.compile backend; expected one of "
                             f"{sorted(torch._dynamo.list_backends(exclude_tags=()))}")
        if self.mode not in MODES:
            raise ValueError(f"CompileConfig(mode={self.mode!r}); expected one of {MODES}")
        if self.mode is not None and self.options:
            raise ValueError(f"CompileConfig(mode={self.mode!r}, options=...): torch.compile takes one of them; drop one")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"CompileConfig(dynamic={self.dynamic!r}); expected None, True or False")

    @classmethod
    def of(cls, value) -> "CompileConfig | None":
        """The config for the plugin's `compile=` argument: True (the defaults), False / None (off), or a config."""
        return switch_config(cls, value, "compile")

    def kwargs(self) -> dict:
        out = dict(backend=self.backend, fullgraph=self.fullgraph, dynamic=self.dynamic)
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out


def draws_dropout(model: nn.Module) -> bool:
    """Whether training `model` draws any dropout mask: a dropout module with p > 0, or a config field
    naming a dropout probability (functional dropouts inside attention) above 0."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for name, value in vars(config).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                configs.append(value)                      # a sub-config (vision, text)
            elif ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                return True
    return False


def _no_cache_in_training(names: frozenset, module, args, kwargs):
    if module.training and "use_cache" in names and kwargs.get("use_cache") is None and not _packed(args, kwargs):
        kwargs["use_cache"] = False
    return args, kwargs


def _packed(args: tuple, kwargs: dict) -> bool:
    """Packed rows keep the caller's cache setting: it decides whether their documents attend across
    each other (packed_rows.py), so turning the cache off would change the number."""
    rows = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    return torch.is_tensor(rows) and rows.dim() >= 2 and packed_rows.packed_documents(kwargs, rows.shape[0]) is not None


def _checkpoint_compiled(checkpoint, config: CompileConfig, function, *args):
    return checkpoint(torch.compile(function, **config.kwargs()), *args)


def _run_block(block_ref, compiled, config: CompileConfig, *args, **kwargs):
    """A compiled block's forward. When transformers checkpoints the block (GradientCheckpointingLayer), its
    wrapper runs eagerly and what it checkpoints is compiled: the checkpoint stays outside the graph
    (traced inside, it would be one region in which meshboost's block hooks cannot note their inputs)."""
    block = block_ref()
    checkpoint = getattr(block, "_gradient_checkpointing_func", None)
    if checkpoint is None or not (getattr(block, "gradient_checkpointing", False) and block.training
                                  and torch.is_grad_enabled()):
        return compiled(*args, **kwargs)
    block._gradient_checkpointing_func = functools.partial(_checkpoint_compiled, checkpoint, config)
    try:
        return type(block).forward(block, *args, **kwargs)
    finally:
        block._gradient_checkpointing_func = checkpoint


def _compile_after_first_call(config: CompileConfig, handles: dict, module, args, output):
    handles.pop(id(module)).remove()
    # the block's forward, not its __call__: the hooks meshboost puts on a block (Megatron's f, sequence
    # parallelism's split and gather at the stack's ends, FSDP2's gathers) stay eager around the graph,
    # so every block of a stack is the same function to dynamo
    compiled = torch.compile(module.forward, **config.kwargs())
    module.forward = functools.partial(_run_block, weakref.ref(module), compiled, config)


def compile_blocks(model: nn.Module, blocks, config: CompileConfig) -> int:
    """Compile each of `blocks` (modules of the sharded `model`) after its first call; returns how many."""
    blocks = list(blocks)
    rng = get_tp_rank_rng(model)
    if rng is not None:
        if draws_dropout(model):
            say("meshboost: compile with tensor parallelism and dropout: the per-tp-rank dropout streams switch the "
                "random generator on the host at every column/row-parallel pair, a graph break each (docs/compile.md)")
        else:
            remove_tp_rank_rng(model)      # no mask is ever drawn: the streams change no number
    names = frozenset(inspect.signature(model.forward).parameters)
    model.register_forward_pre_hook(functools.partial(_no_cache_in_training, names), with_kwargs=True, prepend=True)
    handles: dict[int, object] = {}
    for block in blocks:
        handles[id(block)] = block.register_forward_hook(functools.partial(_compile_after_first_call, config, handles))
    return len(blocks)
