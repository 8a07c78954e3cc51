"""Vocabulary-parallel embedding, LM head and cross-entropy.

Owns: splitting the vocabulary over the tp group, padding it to a multiple of
`make_vocab_size_divisible_by * tp_size` (padded rows are zero and never win: the loss masks
them, gathered logits are trimmed back to the real vocabulary), and the cross-entropy that works
on vocab-split logits without ever gathering them; telling whether a model computes its causal-LM
loss through transformers' `loss_function` (`uses_causal_lm_loss`), which is what that loss replaces, and
that loss's reduction (`reduce_token_losses`, shared with the chunked loss of chunked_loss.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshboost.distributed import comm
from meshboost.distributed.param_info import get_tp_info
from meshboost.shardformer.layers.linear import shard_parameter_


def check_in_range(values: torch.Tensor, bad: torch.Tensor, what: str) -> None:
    """Raise where the unsharded op would, when any `bad` entry is set: at once on the CPU, naming
    the first offending value; on an accelerator without a host sync (a device-side assert). No
    communication: every rank sees the same inputs and raises the same error."""
    if values.device.type == "cpu":
        if bool(bad.any()):
            raise IndexError(f"{what}: found {values[bad][0].item()}")
    else:
        torch._assert_async(~bad.any(), what)


# transformers' nn.Embedding subclasses that only scale the lookup (Gemma's sqrt(hidden), BART's):
# the return line of their forward -> whether the scale is cast to the weight's dtype first.
_SCALED_FORWARDS = {"return super().forward(input_ids) * self.embed_scale": False,
                    "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)": True}


def embedding_extras(module: nn.Embedding) -> tuple | None:
    """What an embedding does beyond a lookup, which its vocab-parallel replacement must keep:
    None for a plain nn.Embedding, (embed_scale, cast to the weight dtype) for a scaled word
    embedding. A ValueError for any other subclass: swapping it would silently drop its behaviour."""
    if type(module).forward is nn.Embedding.forward:
        return None
    try:
        lines = [line.strip() for line in inspect.getsource(type(module).forward).splitlines()]
    except (OSError, TypeError):
        lines = []
    body = [line for line in lines if line and not line.startswith(("def ", "@", '"""', "#"))]
    if len(body) == 1 and body[0] in _SCALED_FORWARDS and hasattr(module, "embed_scale"):
        return module.embed_scale, _SCALED_FORWARDS[body[0]]
    raise ValueError(f"{type(module).__name__} subclasses nn.Embedding with a forward of its own; a vocab-parallel "
                     "embedding would drop what that forward adds. Pass custom_policy=Policy(..., "
                     "vocab_parallel=False) to keep the embedding and LM head replicated")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over tp: each rank looks up the tokens it
    owns, zeros the rest, and one all-reduce assembles the full embeddings. A scaled word
    embedding's `embed_scale` (Gemma) is applied to the result exactly as the original does."""

    def __init__(self, weight: nn.Parameter, group, num_embeddings: int, padding_idx: int | None,
                 scale_grad_by_freq: bool = False, extras: tuple | None = None):
        super().__init__()
        self.scale_cast = False
        if extras is not None:
            scale, self.scale_cast = extras
            if torch.is_tensor(scale):
                self.register_buffer("embed_scale", scale, persistent=False)   # moves and casts with the model
            else:
                self.embed_scale = scale
        self.weight = weight
        self.process_group = group
        info = get_tp_info(weight)
        self.num_embeddings = num_embeddings            # the real vocabulary, as HF code expects
        self.embedding_dim = weight.shape[1]
        self.vocab_start = info.shard_index * info.local_size if info else 0
        self.vocab_end = self.vocab_start + weight.shape[0]
        self.padding_idx = padding_idx
        self.scale_grad_by_freq = scale_grad_by_freq

    @classmethod
    def from_native(cls, module: nn.Embedding, group, make_vocab_size_divisible_by: int = 64):
        if module.max_norm is not None or module.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm or sparse embeddings")
        extras = embedding_extras(module)
        info = get_tp_info(module.weight)              # tied to an embedding sharded already (T5's three)
        num_embeddings = info.full_shape[0] if info is not None else module.weight.shape[0]
        shard_parameter_(module.weight, 0, group, pad_to_multiple=make_vocab_size_divisible_by)
        return cls(module.weight, group, num_embeddings, module.padding_idx, module.scale_grad_by_freq, extras)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A shard only sees its own rows: an id past the vocabulary would silently embed as zeros.
        check_in_range(input_ids, (input_ids < 0) | (input_ids >= self.num_embeddings),
                       f"token ids must lie in [0, {self.num_embeddings}) (the embedding's vocabulary)")
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        local_pad = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            local_pad = self.padding_idx - self.vocab_start
        out = F.embedding(local_ids, self.weight, local_pad, None, 2.0, self.scale_grad_by_freq, False)
        out = comm.reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.process_group)
        if hasattr(self, "embed_scale"):
            out = out * (self.embed_scale.to(self.weight.dtype) if self.scale_cast else self.embed_scale)
        return out

    def extra_repr(self) -> str:
        return (f"vocab {self.num_embeddings} (rows {self.vocab_start}:{self.vocab_end} here), "
                f"dim {self.embedding_dim}")


# Set inside `split_logits()`: every vocab-parallel head returns its shard of the logits, in eval too.
_SPLIT_REQUESTED = contextvars.ContextVar("meshboost_split_logits", default=False)


@contextlib.contextmanager
def split_logits():
    """Inside the block every `VocabParallelLMHead` returns its vocab shard of the logits whatever its mode
    (a frozen reference in eval too), for a reader that reduces over tp itself (post_training's log-probs):
    the vocabulary is never gathered. Scoped to the caller's context, nothing stored on a module."""
    token = _SPLIT_REQUESTED.set(True)
    try:
        yield
    finally:
        _SPLIT_REQUESTED.reset(token)


class VocabParallelLMHead(nn.Module):
    """Column-parallel projection onto the (padded) vocabulary.

    Returns vocab-split logits while `output_is_parallel` (training with parallel_output, where
    the vocab-parallel loss consumes them); otherwise gathers and trims them to the real vocab,
    so evaluation code sees ordinary logits.
    """

    def __init__(self, weight, bias, group, vocab_size: int, parallel_output: bool):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.process_group = group
        self.vocab_size = vocab_size
        self.parallel_output = parallel_output
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_native(cls, module: nn.Linear, group, make_vocab_size_divisible_by: int = 64,
                    parallel_output: bool = True):
        vocab_size = module.weight.shape[0] if get_tp_info(module.weight) is None \
            else get_tp_info(module.weight).full_shape[0]
        # Tied with the input embedding: already sharded (same padding rule), left as is.
        shard_parameter_(module.weight, 0, group, pad_to_multiple=make_vocab_size_divisible_by)
        if module.bias is not None:
            shard_parameter_(module.bias, 0, group, pad_to_multiple=make_vocab_size_divisible_by)
        return cls(module.weight, module.bias, group, vocab_size, parallel_output)

    @property
    def output_is_parallel(self) -> bool:
        return ((self.parallel_output and self.training or _SPLIT_REQUESTED.get()) and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.copy_to_tp(x, self.process_group)
        logits = F.linear(x, self.weight, self.bias)
        if self.output_is_parallel:
            return logits
        logits = comm.gather_from_tp(logits, self.process_group, dim=-1)
        # trimmed to the real vocabulary, contiguous as nn.Linear's output is (losses .view() it)
        return logits[..., : self.vocab_size].contiguous() if logits.shape[-1] != self.vocab_size else logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        # logits: [N, V_local] float, target: [N] global ids.
        rank, part = dist.get_rank(group), logits.shape[-1]
        start = rank * part
        if start + part > vocab_size:              # this shard holds padded columns: they never win
            col = torch.arange(start, start + part, device=logits.device)
            logits = logits.masked_fill(col >= vocab_size, torch.finfo(logits.dtype).min)
        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        check_in_range(target, ~ignored & ((target < 0) | (target >= vocab_size)),
                       f"labels must be {ignore_index} (ignored) or lie in [0, {vocab_size}) (the vocabulary)")
        owned = (target >= start) & (target < start + part) & ~ignored
        local_t = (target - start).masked_fill(~owned, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = shifted.exp_()                       # shifted is ours and read above: no second [N, V] buffer
        # One all-reduce carries both sums (target logit and softmax denominator).
        sums = torch.stack([picked, exp.sum(dim=-1)])
        comm.all_reduce(sums, group)
        picked, sum_exp = sums[0], sums[1]
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), owned, local_t, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss_i / d logits_ij = (softmax_ij - [j is the target of i]) * grad_loss_i: one scaled
        # copy of the saved softmax (left intact for a retained graph), then the target entries.
        softmax, owned, local_t, ignored = ctx.saved_tensors
        # Ignored rows get no gradient whatever flows in, as in torch's nll_loss: a mean over no
        # labelled token is 0/0, whose backward sends inf or NaN here (inf * 0 would be NaN).
        scale = grad_loss.masked_fill(ignored, 0.0)
        grad = softmax * scale.unsqueeze(-1)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= owned.to(grad.dtype) * scale
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy over vocab-split logits [..., V_local] against global target ids [...].

    reduction "mean" divides by the number of non-ignored targets (or by `num_items_in_batch`
    when given, as transformers' loss does for gradient accumulation); "sum" and "none" as torch.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_target = target.reshape(-1).to(flat_logits.device)
    losses = _VocabParallelCrossEntropy.apply(flat_logits, flat_target, group, vocab_size, ignore_index)
    return reduce_token_losses(losses.view(target.shape), target, ignore_index, reduction, num_items_in_batch)


def reduce_token_losses(losses: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str = "mean",
                        num_items_in_batch=None) -> torch.Tensor:
    """Per-token losses (0 where ignored) reduced as transformers' causal-LM loss does: the sum over
    `num_items_in_batch` when given, else the mean over the non-ignored targets; "sum" and "none" as torch."""
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    # Matches F.cross_entropy(reduction="mean"): nan when every target is ignored.
    return total / (target.to(total.device) != ignore_index).sum()


def make_causal_lm_loss(head: VocabParallelLMHead):
    """A drop-in for transformers' `ForCausalLMLoss` that uses the vocab-parallel cross-entropy
    while `head` returns split logits, and the ordinary loss on gathered logits otherwise."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                       shift_labels=None, **kwargs):
        if not head.output_is_parallel:
            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                   ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        return vocab_parallel_cross_entropy(logits, shift_labels, head.process_group, vocab_size,
                                            ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)

    return causal_lm_loss


def uses_causal_lm_loss(model: nn.Module) -> bool:
    """True when the model's forward computes a causal-LM loss through `self.loss_function` (so
    the loss can be swapped for the vocab-parallel one without touching the forward, and it honours
    `num_items_in_batch`, shifting its labels by one). transformers maps a vision-language model's
    "ForConditionalGeneration" loss type to the same causal-LM loss."""
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM", "ForConditionalGeneration"):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING

    if LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM") is not LOSS_MAPPING["ForCausalLM"]:
        return False
    try:
        return "self.loss_function(" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
