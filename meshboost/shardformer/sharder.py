"""Apply a Policy to a model: match module paths, swap leaves in place, fix attributes, tag
parameters.

Owns: validation (every check runs before anything is modified or communicated, so every rank
raises the same error), leaf replacement, block-input hooks, and the loss-function swap for
vocab-parallel LM heads. Must not copy or fork any HuggingFace forward.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn

from meshboost.shardformer import comm
from meshboost.shardformer.layers import (
    ColumnParallelConv1D,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    make_causal_lm_loss,
)
from meshboost.shardformer.layers.linear import _is_conv1d
from meshboost.shardformer.policies import Policy, get_policy
from meshboost.shardformer.policies.base import BLOCK_INPUT, COLWISE, ROWWISE, parse_style, pattern_to_regex
from meshboost.shardformer.shard_config import ShardConfig


def _copy_block_input(group, module, args, kwargs):
    """Megatron f once at a block's input: identity forward, one all-reduce of its grad backward."""
    args = tuple(comm.copy_to_tp(a, group) if torch.is_tensor(a) and a.requires_grad else a for a in args)
    for key in ("hidden_states", "encoder_hidden_states"):
        value = kwargs.get(key)
        if torch.is_tensor(value) and value.requires_grad:
            kwargs[key] = comm.copy_to_tp(value, group)
    return args, kwargs


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)


def _module_path(root: nn.Module, target: nn.Module) -> str | None:
    for name, module in root.named_modules():
        if module is target:
            return name
    return None


def _uses_loss_function(model: nn.Module) -> bool:
    """True when the model's forward computes a causal-LM loss through `self.loss_function` (so
    the loss can be swapped for the vocab-parallel one without touching the forward)."""
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return False
    try:
        return "self.loss_function(" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False


class ShardFormer:
    """Shards a HuggingFace model in place with 1D tensor parallelism.

    >>> model, shared = ShardFormer(ShardConfig(tensor_parallel_process_group=mesh.tp_group)).optimize(model)
    """

    def __init__(self, shard_config: ShardConfig):
        self.shard_config = shard_config

    def optimize(self, model: nn.Module, policy: Policy | None = None) -> tuple[nn.Module, list]:
        """Shard `model` in place; returns (model, shared_params).

        shared_params lists parameters shared across pipeline stages ({stage: param} per tied
        group), empty without pipeline parallelism.
        """
        tp_size = self.shard_config.tensor_parallel_size
        if tp_size == 1:
            return model, []
        policy = policy or get_policy(model)
        matches = self._validate(model, policy, tp_size)
        self._apply(model, policy, matches)
        return model, []

    # -- validation: pure, identical on every rank ---------------------------------------------
    def _validate(self, model: nn.Module, policy: Policy, tp_size: int) -> list[tuple[str, str, int]]:
        config = getattr(model, "config", None)
        for field_name in policy.divisible:
            value = getattr(config, field_name, None)
            if value is not None and value % tp_size:
                raise ValueError(
                    f"{type(model).__name__}: config.{field_name}={value} is not divisible by tp_size={tp_size}; "
                    f"choose a tp_size that divides {value}")
        base = model.base_model
        prefix = _module_path(model, base) or ""
        compiled = [(pattern_to_regex(p), *parse_style(s)) for p, s in policy.plan.items()]
        matches = []
        for name, module in base.named_modules():
            for regex, style, fused in compiled:
                if name and regex.match(name):
                    full_name = f"{prefix}.{name}" if prefix else name
                    if style in (COLWISE, ROWWISE):
                        self._check_leaf(full_name, module, style, fused, tp_size)
                    matches.append((full_name, style, fused))
                    break
        if not any(style != BLOCK_INPUT for _, style, _ in matches):
            raise ValueError(f"policy {policy.name!r} matched no module of {type(model).__name__}; check the "
                             "plan's paths against model.base_model.named_modules()")
        return matches

    @staticmethod
    def _check_leaf(name: str, module: nn.Module, style: str, fused: int, tp_size: int) -> None:
        if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
            raise TypeError(f"{name}: style {style!r} needs nn.Linear or Conv1D, found {type(module).__name__}")
        conv1d = _is_conv1d(module)
        out_dim = 1 if conv1d else 0
        dim = out_dim if style == COLWISE else 1 - out_dim
        size = module.weight.shape[dim]
        if size % (tp_size * fused):
            raise ValueError(f"{name}: {'output' if style == COLWISE else 'input'} features {size} are not "
                             f"divisible by tp_size={tp_size}" + (f" x {fused} fused blocks" if fused > 1 else ""))

    # -- application ---------------------------------------------------------------------------
    def _apply(self, model: nn.Module, policy: Policy, matches) -> None:
        group = self.shard_config.tensor_parallel_process_group
        block_inputs = [name for name, style, _ in matches if style == BLOCK_INPUT]
        for name, style, fused in matches:
            module = model.get_submodule(name)
            if style == BLOCK_INPUT:
                module.register_forward_pre_hook(partial(_copy_block_input, group), with_kwargs=True)
            elif style == COLWISE:
                inside_block = any(name.startswith(b + ".") for b in block_inputs)
                cls = ColumnParallelConv1D if _is_conv1d(module) else ColumnParallelLinear
                _set_submodule(model, name, cls.from_native(module, group, copy_input=not inside_block,
                                                            num_fused=fused))
            else:
                cls = RowParallelConv1D if _is_conv1d(module) else RowParallelLinear
                _set_submodule(model, name, cls.from_native(module, group))
        self._fix_attributes(model, policy)
        if policy.vocab_parallel:
            self._shard_vocab(model, group)

    def _fix_attributes(self, model: nn.Module, policy: Policy) -> None:
        tp_size = self.shard_config.tensor_parallel_size
        base = model.base_model
        for pattern, attrs in policy.attributes.items():
            regex = pattern_to_regex(pattern)
            for name, module in base.named_modules():
                if not regex.match(name):
                    continue
                for attr, rule in attrs.items():
                    if rule != "divide":
                        raise ValueError(f"attribute rule {rule!r} for {pattern}.{attr}: only 'divide' exists")
                    if hasattr(module, attr):
                        setattr(module, attr, getattr(module, attr) // tp_size)

    def _shard_vocab(self, model: nn.Module, group) -> None:
        cfg = self.shard_config
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if isinstance(embedding, nn.Embedding):
            path = _module_path(model, embedding)
            _set_submodule(model, path, VocabParallelEmbedding.from_native(
                embedding, group, cfg.make_vocab_size_divisible_by))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, nn.Linear):
            parallel_loss = cfg.parallel_output and _uses_loss_function(model)
            path = _module_path(model, head)
            new_head = VocabParallelLMHead.from_native(head, group, cfg.make_vocab_size_divisible_by,
                                                       parallel_output=parallel_loss)
            _set_submodule(model, path, new_head)
            if parallel_loss:
                model.loss_function = make_causal_lm_loss(new_head)
