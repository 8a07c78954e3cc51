"""ColossalAI's `shardformer.layer.loss.dist_log_prob`: each next token's log-probability from a causal LM's
logits, whole or split over the tensor-parallel vocabulary (ColossalChat's GRPO consumers call it with the
plugin's `shard_config`). A thin view of the vocab-parallel cross-entropy that meshboost's loss and
`meshboost.post_training`'s log-probs are built on (`shardformer.layers.vocab.vocab_parallel_cross_entropy`,
negated, per token): the max and the softmax denominator reduced over tp, the label's logit taken on the rank
that holds it, padded vocabulary columns never counted; the vocabulary is never gathered.

Which logits it was given is read from their width, not assumed from the config as ColossalAI does: a
meshboost model returns vocab-split logits only in training with `parallel_output` (or inside
`split_logits()`), whole ones in eval. A width that is neither, one that could be both, split logits without
`vocab_size` (the padding would count) and context parallelism (each rank holds a piece of the sequence: use
`meshboost.post_training.token_logprobs`) are refused. Computed in fp32, returned in `dtype`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshboost.shardformer.layers.vocab import vocab_parallel_cross_entropy

__all__ = ["dist_log_prob"]


def _shard_width(vocab_size: int, tp_size: int, divisible_by: int) -> int:
    """The width of one tp rank's logits: the vocabulary padded as the sharder pads it, split over tp."""
    multiple = divisible_by * tp_size if divisible_by > 1 else tp_size
    return -(-vocab_size // multiple) * multiple // tp_size


def _is_split(logits: torch.Tensor, shard_config, vocab_size: int | None) -> bool:
    """Whether `logits` are this rank's vocab shard (True) or the whole vocabulary (False); refuses the rest."""
    tp = shard_config.tensor_parallel_size if shard_config is not None else 1
    width = logits.shape[-1]
    if tp == 1:
        if vocab_size is not None and width != vocab_size:
            raise ValueError(f"dist_log_prob: logits of width {width} for vocab_size={vocab_size} without tensor "
                             "parallelism; pass the model's vocabulary size")
        return False
    if vocab_size is None:
        raise ValueError(f"dist_log_prob(vocab_size=None) at tp_size={tp}: pass vocab_size=model.config.vocab_size "
                         "(meshboost pads the split vocabulary, and the padding must not count)")
    shard = _shard_width(vocab_size, tp, shard_config.make_vocab_size_divisible_by)
    if shard == vocab_size and width == vocab_size:
        raise ValueError(f"dist_log_prob: logits of width {width} could be the whole vocabulary ({vocab_size}) or "
                         f"one tp rank's padded shard of it (tp_size={tp}, make_vocab_size_divisible_by="
                         f"{shard_config.make_vocab_size_divisible_by}); use meshboost.post_training.token_logprobs "
                         "with the model, or a make_vocab_size_divisible_by that tells them apart")
    if width not in (shard, vocab_size):
        raise ValueError(f"dist_log_prob: logits of width {width} are neither the vocabulary ({vocab_size}) nor one "
                         f"tp rank's shard of it ({shard} at tp_size={tp})")
    return width == shard


def dist_log_prob(labels: torch.Tensor, logits: torch.Tensor, shard_config, vocab_size: int | None,
                  dtype: torch.dtype | None = None, seq_dim: int = 1) -> torch.Tensor:
    """log p(labels[..., t + 1] | logits[..., t, :]) for every position but the last: [B, S - 1, 1], as
    ColossalAI's. `labels` [B, S] are token ids (-100: not scored, 0); `logits` [B, S, V] or [B, S, V / tp];
    `shard_config`: the plugin's (`plugin.shard_config`: its tp group and vocabulary padding)."""
    if seq_dim not in (1, -2):
        raise ValueError(f"dist_log_prob(seq_dim={seq_dim}): the sequence is dimension 1 of [batch, seq, vocab]")
    mesh = getattr(shard_config, "mesh", None)
    if mesh is not None and mesh.cp_size > 1:
        raise NotImplementedError(f"dist_log_prob under context parallelism (sp_size={mesh.cp_size}): each rank "
                                  "holds a piece of the sequence, so the next token of its last position is "
                                  "elsewhere; use meshboost.post_training.token_logprobs(model, batch)")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"dist_log_prob: labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    target = labels[..., 1:].contiguous()
    scores = logits[..., :-1, :]
    if _is_split(logits, shard_config, vocab_size):
        logprobs = -vocab_parallel_cross_entropy(scores, target, shard_config.tp_group, vocab_size,
                                                 reduction="none")
    else:
        logprobs = -F.cross_entropy(scores.reshape(-1, scores.shape[-1]).float(), target.reshape(-1).to(scores.device),
                                    reduction="none").view(target.shape)
    return logprobs.unsqueeze(-1).to(dtype or logits.dtype)
