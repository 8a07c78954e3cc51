"""Packed rows: several documents in one row, `position_ids` restarting at each. Whether a call isolates
its documents is transformers' decision, and meshboost takes it from the same call at every layout.

transformers 5 isolates the documents of a row (the `find_packed_sequence_indices` mask) exactly when the
call passes `position_ids`, no `attention_mask`, and the forward holds no key/value cache
(`masking_utils._preprocess_mask_arguments`); otherwise they attend across each other, causally. The
forward holds a cache when one is passed, or when `use_cache` is on: the call's, else the config's (on in
every causal LM's config, training included), unless the base model's gradient checkpointing turns it off
in a training forward (`merge_with_config_defaults`, which also asks that gradients be enabled; the
forwards that resolve `use_cache` themselves, Falcon's or Bloom's, do not ask).

Owns: `builds_cache` (that decision, pure), `packed_documents` (transformers' detection, which regional
compile asks before it turns the cache off), `documents` (the document of every token of whole rows when
the call isolates them, for context parallelism, which masks the split rows itself), and the notice,
printed once per process on rank 0, when packed rows arrive with the cache on (`tell_hook`, a pre-hook
on the model at every layout, where the model's own forward decides). Must not change what a call does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from meshboost.shardformer.optimizations import say

# the keywords under which a call passes transformers a cache object (5.x renames past_key_values)
CACHE_KWARGS = ("past_key_values", "cache")

NOTICE = ("meshboost: packed rows (position_ids restarting, no attention_mask) arrived with the key/value cache on "
          "(use_cache: the call's, else config.use_cache): transformers then lets their documents attend across each "
          "other, and so does meshboost at every layout; pass use_cache=False to isolate them")


@functools.cache
def _defaults_code():
    """The code of `merge_with_config_defaults`'s wrapper: a forward running it takes use_cache from the config
    and keeps the cache when gradients are off, even with checkpointing on."""
    from transformers.utils.generic import merge_with_config_defaults

    return merge_with_config_defaults(lambda self: None).__code__


def builds_cache(model: nn.Module, kwargs: dict) -> bool:
    """Whether the unsharded `model` called with `kwargs` holds a key/value cache in its forward (and so does
    not isolate packed documents). Reads the call, the config, the base model's `gradient_checkpointing` and
    `training`, and whether gradients are enabled now. Pure."""
    if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
        return True
    base = getattr(model, "base_model", model)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(base, "config", None), "use_cache", None)
    if not use_cache:
        return False
    checkpointed = bool(getattr(base, "gradient_checkpointing", False)) and base.training
    if checkpointed and getattr(type(base).forward, "__code__", None) is _defaults_code():
        checkpointed = torch.is_grad_enabled()
    return not checkpointed


def packed_documents(kwargs: dict, batch: int) -> torch.Tensor | None:
    """transformers' document index of the rows ([B, S]), or None: no position_ids, a mask, or no row packed."""
    positions = kwargs.get("position_ids")
    if not torch.is_tensor(positions) or kwargs.get("attention_mask") is not None:
        return None
    from transformers.masking_utils import find_packed_sequence_indices

    return find_packed_sequence_indices(positions.reshape(-1, positions.shape[-1]).expand(batch, -1))


def documents(model: nn.Module, kwargs: dict, batch: int) -> torch.Tensor | None:
    """The document of every token of the whole rows ([B, S]) when `model` called with `kwargs` isolates packed
    documents; None when the rows attend whole (no packing, a mask, or the cache on: then told once)."""
    if builds_cache(model, kwargs):
        _tell_if_packed(kwargs, batch)
        return None
    return packed_documents(kwargs, batch)


def tell_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook (with kwargs) of a model whose own forward decides: the notice, when packed rows arrive
    with the cache on. Costs nothing once told; before, a call with position_ids, no mask and the cache on
    looks for packing (transformers does as much in every call without a cache)."""
    if _told.cache_info().currsize or not torch.is_tensor(kwargs.get("position_ids")):
        return
    rows = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    if torch.is_tensor(rows) and rows.dim() >= 2 and builds_cache(module, kwargs):
        _tell_if_packed(kwargs, rows.shape[0])


def _tell_if_packed(kwargs: dict, batch: int) -> None:
    if not _told.cache_info().currsize and packed_documents(kwargs, batch) is not None:
        _told()


@functools.cache
def _told() -> None:
    """The notice, once per process (the cache remembers that it was given), on rank 0."""
    say(NOTICE)
