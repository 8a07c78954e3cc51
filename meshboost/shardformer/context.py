"""Context parallelism: every sequence split over the cp ranks everywhere. Two modes:
`"all_to_all"` (Ulysses): attention runs on whole sequences for a slice of the heads;
`"ring_attn"` (keys and values all-gathered): every rank attends for its own queries over all keys,
so the attention scores ([S/cp, S] per rank) are never whole on any rank.

Owns: which models and settings the mode can run exactly (`check_context`, pure), the attention
function registered in transformers' attention interface (`UlyssesAttention`: no copied forward; it
wraps the model's own SDPA or eager implementation), the split of one replica's batch into this cp
rank's contiguous piece of every sequence (`ContextInputs.shard`, which returns the call's mask state
with the pieces: a `ContextCall`), and what the model returns: the loss of the whole sequences on every
cp rank, whole-sequence logits in eval.

Around attention: one all-to-all turns this rank's sequence piece of all heads ([B, H, S/cp, D]) into
the whole sequence of H/cp heads ([B, H/cp, S, D]), the wrapped implementation runs with the whole
sequence's causal and padding mask, and one all-to-all turns the output back. Key/value heads fewer
than cp (or not dividing into cp groups) are repeated to the query heads first, exactly as the GQA
kernels would. Both exchanges are differentiable (`comm.all_to_all`). Rotary positions are the
global ones: every rank passes its piece of `position_ids`.

The loss: labels are shifted on the whole sequence before the split (`shift_labels`: the last token of
a piece predicts the first of the next), the loss is normalised by the labelled tokens of every
replica's whole sequences (training; in eval the replica's own), and each rank's backward reaches its
own tokens only; its value is then averaged over the cp ranks (identity backward), so every rank
reports its replica's loss and the gradients, averaged over dp x cp, are the single-process ones.

ring_attn: the sequence is cut into 2 cp chunks and rank r holds chunks r and 2cp-1-r (zig-zag), so
under the causal mask every rank has the same work; keys and values are all-gathered over cp
(their gradients reduce-scattered back, `comm.gather_from_seq`), and the wrapped implementation runs
this rank's queries against every key with the mask of their global positions: the same softmax as
one process, no approximation. Costs the whole sequence's keys and values per rank (not its scores).

Per-call state travels with the inputs, never on a module (torchtitan's habit): `shard` puts the call's
`ContextCall` (key padding, packed rows' documents, this rank's and every rank's token positions) into
the sharded inputs under `CALL_KWARG`; transformers hands a model's extra keyword arguments down to every
attention call (`**kwargs` through the model, its layers and the attention interface), where the
attention function reads it. Under pipeline stages each micro-batch is cut the same way
(`shard_microbatch`) and carries its own record, so interleaved micro-batches and a layer recomputed in
backward (activation checkpointing keeps the layer's keyword arguments) mask as their own forward did,
with nothing for the schedule to save or put back.

Packed rows (position_ids restarting, no attention_mask): their documents are isolated exactly when the
unsharded model isolates them for the same call (packed_rows.py: no cache, i.e. use_cache off or turned off
by gradient checkpointing in training), and attend across each other otherwise; the split rows are never
given a cache (a cache of a sequence piece would serve nothing), so the decision is taken before the split.

Refused with the reason (every rank, before any collective): the tp group's modes with cp_size
("split_gather", ColossalAI's "ring": sequence.py runs them over tp), a cache object passed in (it would hold
pieces), chunked attention, recurrent mixers, attention
implementations other than sdpa and eager, heads not divisible by cp (all_to_all), a sequence length
not divisible by cp (2 cp for ring_attn), models that are not causal LMs, a pipeline criterion other
than the model's loss (`check_criterion`); the model checks are context_checks.py's. Must not know a model
family.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.distributed import comm
from meshboost.distributed.inputs import count_items
from meshboost.shardformer import packed_rows
from meshboost.shardformer.context_checks import ALL_TO_ALL, RING_ATTN, WRAPPED, check_length

ATTENTION_NAME = "meshboost_ulysses"
# the keyword under which the sharded inputs carry their `ContextCall` down to the attention function
CALL_KWARG = "meshboost_context"


@dataclass(frozen=True)
class ContextCall:
    """What one call's attention masks are made of, returned by `ContextInputs.shard` with the pieces
    (the inputs hold it under `CALL_KWARG`): nothing of a call is stored on a module or on the attention."""

    padding: torch.Tensor | None        # [B, S] key padding of the whole rows, natural order; None: none
    documents: torch.Tensor | None      # [B, S] document of each token of packed rows; None: rows whole
    positions: torch.Tensor             # the token indices this rank holds (its queries)
    order: torch.Tensor                 # every rank's token indices, rank by rank (ring_attn's keys; eval logits)


def call_of(kwargs: dict) -> ContextCall:
    """The `ContextCall` an attention call received with its keyword arguments; refused when missing
    (a call that did not go through `ContextInputs.shard`: its masks would be unknown)."""
    call = kwargs.pop(CALL_KWARG, None)
    if not isinstance(call, ContextCall):
        raise RuntimeError("context-parallel attention was called without the inputs' ContextCall (keyword "
                           f"{CALL_KWARG!r}): call the boosted model, whose input split provides it, or a model whose "
                           "layers pass their keyword arguments down to the attention interface")
    return call


class UlyssesAttention:
    """The attention function registered for a model under context parallelism, all_to_all mode (see
    the module docstring). Holds only what is fixed for the model (group, size, wrapped implementation);
    each call's masks come from the `ContextCall` in its keyword arguments."""

    mode = ALL_TO_ALL
    # the exchanges' collectives (`all_to_all`, `gather_from_seq`): comm's; the planner's fake run puts
    # shape-only ones here that allocate the same buffers (plan/emulate.py)
    comm = comm

    def __init__(self, group, size: int, inner: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.group, self.size, self.inner_name = group, size, inner
        # sdpa from transformers' registry; eager is each modeling file's own `eager_attention_forward`
        self.inner = ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager" else None

    def _implementation(self, module: nn.Module):
        if self.inner is not None:
            return self.inner
        found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if found is None:
            raise NotImplementedError(f"{type(module).__name__}: its modeling file has no eager_attention_forward for "
                                      "the all_to_all mode to wrap; build the model with attn_implementation='sdpa'")
        return found

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h, S/cp, D] (all heads, this rank's piece) -> [B, h/cp, S, D] (its heads, every piece)."""
        b, h, s, d = x.shape
        send = x.reshape(b, self.size, h // self.size, s, d).transpose(0, 1).contiguous()
        got = self.comm.all_to_all(send.reshape(self.size * b, -1), self.group, [b] * self.size, [b] * self.size)
        return got.view(self.size, b, h // self.size, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // self.size,
                                                                                           self.size * s, d)

    def _sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, h/cp, D] (the implementation's output layout) -> [B, S/cp, h, D]."""
        b, s, h, d = x.shape
        piece = s // self.size
        send = x.reshape(b, self.size, piece, h, d).transpose(0, 1).contiguous()
        got = self.comm.all_to_all(send.reshape(self.size * b, -1), self.group, [b] * self.size, [b] * self.size)
        return got.view(self.size, b, piece, h, d).permute(1, 2, 0, 3, 4).reshape(b, piece, self.size * h, d)

    def _keep(self, call: ContextCall, queries: torch.Tensor, keys: torch.Tensor, batch: int, window,
              like: torch.Tensor):
        """Which (query, key) pairs attend, by token index in the row, as transformers' mask functions
        decide unsharded: causal, the sliding window (kv > q - window) when the layer has one, the
        documents of packed rows (the call's `documents`, when transformers isolates them), key padding.
        Boolean for SDPA, additive for eager."""
        queries, keys = queries.to(like.device), keys.to(like.device)
        keep = (keys[None, :] <= queries[:, None])[None, None]
        if window is not None:
            keep = keep & (keys[None, :] > queries[:, None] - window)[None, None]
        if call.documents is not None:
            docs = call.documents.to(like.device)
            keep = keep & (docs[:, queries][:, None, :, None] == docs[:, keys][:, None, None, :])
        if call.padding is not None:
            keep = keep & call.padding.to(like.device)[:, keys][:, None, None, :]
        keep = keep.expand(batch, 1, len(queries), len(keys))
        if self.inner_name == "sdpa":
            return keep
        return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~keep, torch.finfo(like.dtype).min)

    def _mask(self, call: ContextCall, batch: int, length: int, like: torch.Tensor, window=None):
        """The whole sequences' mask: None for SDPA with nothing but causality (its causal kernel)."""
        if call.padding is None and call.documents is None and window is None and self.inner_name == "sdpa":
            return None
        positions = torch.arange(length, device=like.device)
        return self._keep(call, positions, positions, batch, window, like)

    def __call__(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        call = call_of(kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = getattr(module, "num_key_value_groups", heads // kv_heads)
        if kv_heads % self.size:                      # fewer kv heads than cp: repeat them to the query heads
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
            groups = 1
        query, key, value = (self._heads_to_sequence(t) for t in (query, key, value))
        mask = self._mask(call, query.shape[0], query.shape[2], query, kwargs.get("sliding_window"))
        seen = module if groups == getattr(module, "num_key_value_groups", groups) else _GroupsView(module, groups)
        out, _ = self._implementation(module)(seen, query, key, value, mask, **kwargs)
        return self._sequence_to_heads(out), None


class GatheredKeysAttention(UlyssesAttention):
    """The ring_attn mode: this rank's queries against every rank's keys and values (all-gathered over
    cp, gradients reduce-scattered back), masked by global positions (causal) and key padding."""

    mode = RING_ATTN

    def _gather_keys(self, t: torch.Tensor) -> torch.Tensor:
        """[B, kv heads, S/cp, D] of this rank -> every rank's, in rank order (gradient reduce-scattered)."""
        return self.comm.gather_from_seq(t.contiguous(), self.group, dim=2)

    def __call__(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        call = call_of(kwargs)
        key, value = (self._gather_keys(t) for t in (key, value))
        mask = self._keep(call, call.positions, call.order, query.shape[0], kwargs.get("sliding_window"), query)
        out, _ = self._implementation(module)(module, query, key, value, mask, **kwargs)
        return out, None


class _GroupsView:
    """The attention module as the wrapped implementation sees it once kv heads fewer than cp were repeated
    here: every attribute the module's but `num_key_value_groups` (by which the implementation repeats kv
    heads), so the repeat is not done twice and the module itself is never written during a call."""

    def __init__(self, module: nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def install(model: nn.Module, group, size: int, inner: str | None = None, mode: str = ALL_TO_ALL,
            attention: UlyssesAttention | None = None) -> UlyssesAttention:
    """Register this model's context-parallel attention (the mode's, or `attention`: the planner's
    shape-only one) in transformers' attention interface and switch the model to it (every attention
    module then calls it; no forward is replaced). `inner`: the implementation it wraps; None: the one
    the model runs now, after ShardConfig's kernel switch (enable_flash_attention turns eager into
    sdpa). Refused when no module runs `inner`: the attention would silently see each rank's piece alone."""
    from transformers import AttentionInterface

    inner = getattr(model.config, "_attn_implementation", None) if inner is None else inner
    if inner not in WRAPPED:
        raise NotImplementedError(f"context parallelism wraps attention implementations {WRAPPED}; "
                                  f"{type(model).__name__} runs {inner!r}")
    if attention is None:
        attention = (UlyssesAttention if mode == ALL_TO_ALL else GatheredKeysAttention)(group, size, inner)
    name = f"{ATTENTION_NAME}_{id(model)}"
    AttentionInterface.register(name, attention)
    switched = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == inner:
            config._attn_implementation = name
            switched += 1
    if not switched:
        raise RuntimeError(f"context parallelism: no module of {type(model).__name__} runs attn_implementation="
                           f"{inner!r}, so none would call the context-parallel attention")
    return attention


class _MeanOverContext(torch.autograd.Function):
    """The loss value averaged over the cp ranks (each holds its tokens' share, normalised by the
    whole count / cp); backward identity: each rank's gradient reaches its own tokens only, and the
    dp x cp averaging makes it the whole one."""

    @staticmethod
    def forward(ctx, loss, group, size):
        total = comm.all_reduce(loss.detach().clone(), group)
        return total / size

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ContextInputs:
    """This cp rank's piece of a replica's batch, and the whole-sequence view of what the model returns.
    Fixed per model; a call's state is the `ContextCall` that `shard` returns inside the inputs."""

    def __init__(self, attention: UlyssesAttention, rank: int, model: nn.Module):
        self.attention, self.rank, self.size, self.group = attention, rank, attention.size, attention.group
        self.model = model          # the HF model: whether its forward would hold a cache (packed rows)

    def _pieces(self, length: int, device) -> list[torch.Tensor]:
        """The positions each rank holds: contiguous pieces (all_to_all), or chunks r and 2cp-1-r of 2cp
        (ring_attn: the causal work balanced over the ranks)."""
        if self.attention.mode == ALL_TO_ALL:
            return list(torch.arange(length, device=device).chunk(self.size))
        chunks = torch.arange(length, device=device).chunk(2 * self.size)
        return [torch.cat([chunks[r], chunks[2 * self.size - 1 - r]]) for r in range(self.size)]

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The token indices of a length-`length` sequence that this rank holds, in the order of its piece
        of the model's outputs (training; post_training reads its log-probs by them)."""
        return self._pieces(length, device)[self.rank]

    def shard(self, kwargs: dict) -> dict:
        """This rank's piece of `kwargs` (one replica's batch, whole on every cp rank), with the call's
        `ContextCall` under `CALL_KWARG` (the model passes it down to every attention call). Packed rows'
        documents are isolated as the unsharded model would for this call, in the model's present mode
        (`packed_rows.documents`)."""
        ids = kwargs.get("input_ids")
        if not torch.is_tensor(ids) or ids.dim() != 2:
            raise ValueError("context parallelism needs input_ids [batch, sequence] (inputs_embeds is not split)")
        passed = [name for name in packed_rows.CACHE_KWARGS if kwargs.get(name) is not None]
        if passed:
            raise NotImplementedError(f"context parallelism: {passed[0]} was passed; the split rows hold no key/value "
                                      "cache (each rank holds a piece of every sequence): call without it")
        batch, length = ids.shape
        check_length(length, self.size, self.attention.mode)
        given = kwargs.get("position_ids")
        positions = torch.arange(length, device=ids.device).expand(batch, length) if given is None \
            else given.to(ids.device).expand(batch, length)
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (batch, length)):
            raise NotImplementedError(f"context parallelism takes a [batch, sequence] padding mask; got "
                                      f"{tuple(mask.shape)}")
        pieces = self._pieces(length, ids.device)
        cut = pieces[self.rank]
        padding = None if mask is None or bool(mask.bool().all()) else mask.bool()
        call = ContextCall(padding, packed_rows.documents(self.model, kwargs, batch), cut, torch.cat(pieces))
        out = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids", "use_cache")}
        out[CALL_KWARG] = call
        out["use_cache"] = False                  # a cache of a sequence piece would serve nothing
        out["input_ids"] = ids[:, cut].contiguous()
        out["position_ids"] = positions[:, cut].contiguous()
        labels = kwargs.get("labels")
        if torch.is_tensor(labels):
            shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            out["labels"], out["shift_labels"] = labels[:, cut].contiguous(), shifted[:, cut].contiguous()
        return out

    def check_criterion(self, criterion, inputs: dict) -> None:
        """A pipeline's criterion must return the model's own loss (see `check_criterion`)."""
        check_criterion(criterion, inputs)

    def shard_microbatch(self, inputs: dict) -> dict:
        """A pipeline micro-batch (every cp rank holds it whole): this rank's piece with its `ContextCall`,
        its loss normalised by the micro-batch's labelled tokens (the model then returns the micro-batch
        mean, which the schedule weighs as without cp)."""
        kwargs = dict(inputs)
        labels = kwargs.get("labels")
        if torch.is_tensor(labels) and kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = count_items(labels, shifted=True) / self.size
        return self.shard(kwargs)

    def combine(self, output, sharded: dict, training: bool):
        """The loss of the whole sequences on every rank; whole-sequence logits outside training, put in
        order by the `ContextCall` of the `sharded` inputs that produced `output`."""
        if getattr(output, "loss", None) is not None:
            output.loss = _MeanOverContext.apply(output.loss, self.group, self.size)
        logits = getattr(output, "logits", None)
        if not training and torch.is_tensor(logits):
            order = sharded[CALL_KWARG].order
            gathered = comm.all_gather(logits.contiguous(), self.group, dim=1)     # rank by rank: `order`
            output.logits = gathered[:, torch.argsort(order.to(gathered.device))]
        return output


def check_criterion(criterion, inputs: dict) -> None:
    """Under a pipeline, the last stage's output holds this rank's piece of every sequence (its logits
    too); only the model's own loss (`outputs.loss`, the whole sequences' after `combine`) is exact. The
    criterion is called once on a probe output on every rank: anything but that loss is refused there,
    before the schedule runs, instead of a silently wrong loss of a piece."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    probe = CausalLMOutputWithPast(loss=torch.zeros(()))
    why = None
    try:
        got = criterion(probe, inputs)
    except Exception as error:          # it read something else than the loss (logits are None here)
        got, why = None, f"{type(error).__name__}: {error}"
    if got is not probe.loss:
        raise NotImplementedError(
            "execute_pipeline with cp_size > 1 (ColossalAI's sp_size): the criterion must return the model's own "
            "loss (`lambda outputs, inputs: outputs.loss`); under context parallelism each rank's outputs hold a piece "
            "of every sequence, so a loss computed from the logits and the whole labels would be wrong"
            + (f" (calling it on the model output without logits raised {why})" if why else ""))
