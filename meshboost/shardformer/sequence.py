"""Megatron sequence parallelism ("split_gather") around an unmodified HuggingFace layer stack.

Owns: finding the model's layer stack (the policy's single pipeline segment, else transformers'
`base_model_pp_plan`), refusing what it cannot run exactly, and the hooks that make the stack
sequence-parallel: the stack's first layer keeps this rank's chunk of the sequence (gradient
all-gathered backward), its last layer gathers the sequence again (gradient split backward), and
every replicated parameter that sees the split activations (norms, row-parallel biases) has its
gradient summed over tp. Inside, the sharder's `RegionPlan` (regions.py, not this file) gives the
parallel layers their roles and the blocks their regions: a column-parallel input (or a block
region's input) is all-gathered along the sequence forward and its gradient reduce-scattered; a
row-parallel output is reduce-scattered instead of all-reduced. Same bytes per layer as plain
tensor parallelism; norms, dropouts and residuals hold 1/tp of the sequence (docs/sequence_parallel.md).
An MoE block is not gathered: its router (and a replicated shared expert or shared-expert gate) works
token by token on this rank's chunk, so, as a norm's, its gradient is summed over tp; its experts
gather the routed tokens themselves (layers/experts.py); the routers' logits are gathered along the
sequence at the base model's output, so the load-balancing loss sees every token once, as one process.

Must not copy a HuggingFace forward: it runs on hooks and on the parallel layers' roles only.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from meshboost.distributed import comm
from meshboost.distributed.param_info import get_tp_info, grad_hooks, register_grad_hook
from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear
from meshboost.shardformer.layers.experts import check_sequence_parallel, is_packed_experts
from meshboost.shardformer.layers.linear import ColumnSubsetLinear, SequenceLayoutError, sum_grad_over_tp

SEQ_DIM = 1                      # HF layers take hidden states [batch, seq, hidden]
MODES = ("split_gather",)
# ColossalAI's "ring" is split_gather with its all-gathers and reduce-scatters done as ring exchanges over the
# same tp group: the same sums in the same layout, so it runs as split_gather
SAME_AS_SPLIT_GATHER = ("ring",)
CONTEXT_MODES = ("all_to_all", "ring_attn")             # a sequence axis of its own (cp_size): context.py


def check_mode(mode) -> str:
    """The sequence-parallel mode over the tp group (None and ColossalAI's "ring" mean split_gather); the
    context modes belong to a sequence axis of its own and are refused here, naming cp_size (ColossalAI's
    sp_size)."""
    if mode is None or mode == "split_gather" or mode in SAME_AS_SPLIT_GATHER:
        return "split_gather"
    if mode in CONTEXT_MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r} splits the sequence over a sequence axis of its own, "
                         "not over the tensor-parallel group: pass cp_size > 1 (HybridParallelConfig(cp_size=..., "
                         f"cp_mode={mode!r}), or ColossalAI's HybridParallelPlugin(sp_size=..., "
                         f"sequence_parallelism_mode={mode!r}))")
    raise ValueError(f"sequence_parallelism_mode={mode!r} is unknown; over the tensor-parallel group use "
                     f"'split_gather' (or None, or ColossalAI's 'ring', the same numbers); with cp_size (ColossalAI's "
                     f"sp_size) one of "
                     f"{CONTEXT_MODES}")


def stack_path(model: nn.Module, layout: dict | None) -> str:
    """Path (relative to the base model) of the one layer list sequence parallelism splits; a
    ValueError for a layout it cannot split exactly (several stacks, shared layer groups, none)."""
    name = type(model).__name__
    if layout is not None:
        if "segments" in layout:
            raise ValueError(f"{name}: sequence parallelism splits one layer stack; this model has several "
                             "(encoder-decoder or multimodal), whose cross-attention reads the other stack's whole "
                             "sequence. Use enable_sequence_parallelism=False for it")
        if layout.get("shared_groups"):
            raise ValueError(f"{name}: sequence parallelism does not split shared layer groups (ALBERT); "
                             "use enable_sequence_parallelism=False")
        return layout["layers"]
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    base = model.base_model
    lists = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{name}: no single layer stack found for sequence parallelism (its config has no "
                         "base_model_pp_plan and its policy no pipeline_layout); use enable_sequence_parallelism="
                         "False or pass custom_policy=Policy(..., pipeline_layout={'layers': ...})")
    return lists[0]


def check_model(model: nn.Module, tp_size: int) -> None:
    """Pure checks on the unsharded model, run on every rank before anything is modified."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{type(model).__name__}: sequence parallelism does not split layers with cross-attention "
                         "(their keys and values read another sequence); use enable_sequence_parallelism=False")
    for path, module in model.named_modules():
        if is_packed_experts(module):          # their tokens are gathered over tp: layers/experts.py
            check_sequence_parallel(path, module)


class _LayerRecord:
    """The length of this rank's chunk of the sequence in the layer's latest call (its input's), and
    the batch size."""

    local: int | None = None
    batch: int | None = None


def _record_layer_input(record: _LayerRecord, tp_size: int, module, args, kwargs):
    """Pre-hook of every layer: the chunk length; a boolean per-token mask handed to the layer (other than
    the attention mask) is refused, since the layer would index its split hidden states with it."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    record.local = hidden.shape[SEQ_DIM] if torch.is_tensor(hidden) and hidden.dim() > SEQ_DIM else None
    record.batch = hidden.shape[0] if record.local is not None else None
    for key, value in kwargs.items():
        if torch.is_tensor(value) and value.dtype == torch.bool and "attention_mask" not in key and \
                record.local is not None and value.dim() == 2 and value.shape[1] == record.local * tp_size:
            raise SequenceLayoutError(f"sequence parallelism: the layer receives a per-token mask {key!r} of shape "
                                      f"{tuple(value.shape)}, which it would apply to hidden states holding this "
                                      "rank's chunk of the sequence; use enable_sequence_parallelism=False")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


class _Replicated:
    """A module with replicated parameters in a sequence-parallel layer: whether its gradient is partial
    (summed over tp), decided at its first call by the pre-hook `handle`, which then removes itself, so
    later calls (and torch.compile's graphs of the layer) see no per-module state."""

    partial: bool | None = None
    handle = None


def _classify(record: _LayerRecord, tp_size: int, path: str, decided: _Replicated, token_wise: bool, module, args,
              kwargs):
    """Pre-hook, first call only, of a module with replicated parameters in a sequence-parallel layer:
    fed this rank's chunk of the sequence (outside the gathered blocks) it must be a normalization,
    or a module of an MoE block (`token_wise`: a router, a shared expert, which see tokens flattened to
    [tokens, H], counted here by tokens), whose gradient is then partial (summed over tp); fed the whole
    sequence (inside a block, after the gather) its gradient is whole already. Anything else fed the
    chunk (an attention or a mixer the plan leaves whole) would mix only this rank's tokens, and a
    length that is neither is ambiguous: both refused before they run."""
    if decided.partial is not None:
        return
    t = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()), None)
    length, local = (t.shape[SEQ_DIM] if t is not None and t.dim() > SEQ_DIM else None), record.local
    if token_wise and t is not None and t.dim() >= 2 and local is not None:
        # tokens in the chunk, or in the whole sequence, as the tokens the module sees
        length, local = t.numel() // t.shape[-1], local * record.batch
    if local is not None and length == local and (token_wise or _is_norm(module)):
        decided.partial = True
    elif local is not None and length == local * tp_size:
        decided.partial = False
    elif local is not None and length == local:
        raise SequenceLayoutError(
            f"sequence parallelism: {path} ({type(module).__name__}) has parameters the tensor-parallel plan leaves "
            "whole and is fed this rank's chunk of the sequence; if it mixes tokens (attention, convolution) it "
            "would see only this rank's. Use enable_sequence_parallelism=False for this model")
    else:
        whole = None if local is None else local * tp_size
        raise SequenceLayoutError(f"sequence parallelism: {path} ({type(module).__name__}) was fed a sequence of "
                                  f"length {length} where its layer's chunk is {local} of {whole}; meshboost cannot "
                                  "tell whether its gradient is partial. Use enable_sequence_parallelism=False")
    decided.handle.remove()


def _replicated_grad(group, decided: _Replicated, grad: torch.Tensor) -> torch.Tensor:
    """Gradient hook of a replicated parameter in a sequence-parallel layer: summed over tp when its
    module was fed this rank's chunk of the sequence (see `_classify`)."""
    if not decided.partial:
        return grad
    grad = grad.contiguous()
    return comm.all_reduce(grad, group, out=torch.empty_like(grad))


def install(model: nn.Module, layers_path: str, group, tp_size: int) -> None:
    """Make the (already tensor-parallel) stack at `layers_path` (base-model relative) sequence-parallel."""
    layers = model.base_model.get_submodule(layers_path)
    prefix = next((n for n, m in model.named_modules() if m is layers), layers_path)
    layers[0].register_forward_pre_hook(partial(_split_sequence, group, tp_size), with_kwargs=True)
    for i, layer in enumerate(layers):
        record = _LayerRecord()
        moe_blocks = [n.rpartition(".")[0] for n, m in layer.named_modules() if is_packed_experts(m)]
        # after the split on layer 0; after the pipeline's received hidden states, which it prepends
        layer.register_forward_pre_hook(partial(_record_layer_input, record, tp_size), with_kwargs=True)
        for module in layer.modules():
            if isinstance(module, RowParallelLinear) and module.bias is not None and module.bias.requires_grad:
                register_grad_hook(module.bias, partial(sum_grad_over_tp, group))      # added after the reduce-scatter
        for name, module in layer.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ColumnSubsetLinear)):
                continue
            params = [p for p in module.parameters(recurse=False) if p.requires_grad and get_tp_info(p) is None
                      and not grad_hooks(p)]               # hooked: already summed over tp (q/k norms)
            if not params:
                continue
            path = f"{prefix}.{i}.{name}" if name else f"{prefix}.{i}"
            decided = _Replicated()
            token_wise = any(name.startswith(b + ".") for b in moe_blocks)   # the router, a shared expert
            decided.handle = module.register_forward_pre_hook(
                partial(_classify, record, tp_size, path, decided, token_wise), with_kwargs=True)
            for p in params:
                register_grad_hook(p, partial(_replicated_grad, group, decided))
    layers[len(layers) - 1].register_forward_hook(partial(_gather_sequence, group))
    model.register_forward_pre_hook(_refuse_hidden_states_output, with_kwargs=True)
    model.base_model.register_forward_hook(partial(_gather_router_logits, group, tp_size))


def _gather_router_logits(group, tp_size: int, module, args, output):
    """Hook on the base model: each MoE layer's router logits ([tokens, experts], this rank's chunk of
    every sequence, flattened batch-major) gathered along the sequence into the whole batch's order,
    as one process holds them (the load-balancing loss may mask them by the attention mask). Every
    rank then computes the same loss from them, so the gradient keeps this rank's chunk backward."""
    logits = getattr(output, "router_logits", None)
    hidden = getattr(output, "last_hidden_state", None)
    if not logits or not torch.is_tensor(hidden) or hidden.dim() != 3:
        return output
    batch, seq = hidden.shape[:2]
    whole = []
    for layer in logits:
        if layer.shape[0] == batch * seq:                 # routed on the whole sequence already
            whole.append(layer)
        elif layer.shape[0] * tp_size == batch * seq:
            chunk = layer.reshape(batch, seq // tp_size, *layer.shape[1:])
            whole.append(comm.gather_from_tp(chunk, group, dim=SEQ_DIM).reshape(batch * seq, *layer.shape[1:]))
        else:
            raise SequenceLayoutError(f"sequence parallelism: router logits of shape {tuple(layer.shape)} for a batch "
                                      f"of {batch} x {seq} tokens over tp_size={tp_size}; meshboost cannot tell whose "
                                      "tokens they hold. Use enable_sequence_parallelism=False for this model")
    output.router_logits = tuple(whole)
    return output


def _split_sequence(group, tp_size: int, module, args, kwargs):
    """Pre-hook on the stack's first layer: keep this rank's chunk of the sequence."""
    args, kwargs = list(args), dict(kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not torch.is_tensor(hidden) or hidden.dim() != 3:
        # a layout refusal found at the first call (DeepSeek-V4's [batch, seq, streams, hidden] hyper-connections)
        raise SequenceLayoutError("sequence parallelism needs the layers' hidden states as [batch, seq, hidden]; got "
                                  f"{type(hidden).__name__ if not torch.is_tensor(hidden) else tuple(hidden.shape)}; "
                                  "use enable_sequence_parallelism=False for this model")
    check_length(hidden.shape[SEQ_DIM], tp_size)
    local = comm.split_to_tp(hidden, group, dim=SEQ_DIM)
    if args:
        args[0] = local
    else:
        kwargs["hidden_states"] = local
    return tuple(args), kwargs


def check_length(seq: int, tp_size: int) -> None:
    """A sequence of `seq` tokens splits over the tp ranks: divisible, at least 2 tokens each."""
    if seq % tp_size:
        raise ValueError(f"sequence length {seq} is not divisible by tp_size={tp_size}, which sequence parallelism "
                         f"splits it over: pad every batch to a multiple of {tp_size} (e.g. tokenizer(..., "
                         f"padding=True, pad_to_multiple_of={tp_size}) with an attention mask)")
    if seq // tp_size < 2:
        # a chunk of one token would broadcast silently against a whole sequence if a model mixed them
        raise ValueError(f"sequence length {seq} over tp_size={tp_size} leaves {seq // tp_size} token per rank; "
                         "sequence parallelism needs at least 2 (use longer batches, or enable_sequence_parallelism="
                         "False, e.g. for token-by-token generation)")


def _gather_sequence(group, module, args, output):
    """Hook on the stack's last layer: the whole sequence again, on every rank."""
    if torch.is_tensor(output):
        return comm.gather_from_tp(output, group, dim=SEQ_DIM)
    if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        return (comm.gather_from_tp(output[0], group, dim=SEQ_DIM), *output[1:])
    raise TypeError(f"sequence parallelism: the last layer returned {type(output).__name__}, not hidden states")


def _refuse_hidden_states_output(module, args, kwargs):
    if kwargs.get("output_hidden_states") or (kwargs.get("output_hidden_states") is None and
                                              getattr(module.config, "output_hidden_states", False)):
        raise ValueError("output_hidden_states=True with sequence parallelism: the layers' hidden states are "
                         "split by sequence over the tensor-parallel ranks; use enable_sequence_parallelism=False to "
                         "get them whole")
