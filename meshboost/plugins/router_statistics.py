"""The router's load-balancing loss over data-parallel replicas: each replica's own, or the whole batch's.

Owns: the two meanings of `HybridParallelConfig.router_statistics` and the second one's computation.

  * "replica" (the default, DDP's semantics, what every data-parallel framework trains): each replica
    computes the load-balancing loss of the tokens it holds, and the gradient averaged over the
    replicas is that of the mean of their losses. Exact for that objective; not the loss one process
    would compute on the whole batch, whose routing statistics (the fraction of tokens sent to each
    expert, the mean router probability of each) are those of all tokens together.
  * "global": every replica's router logits are gathered over dp (all-gather forward, reduce-scatter
    of their gradient backward) and the model family's own `load_balancing_loss_func` runs on them, so
    every replica's loss carries the whole batch's load-balancing term, equal to one process's on the
    whole batch. Its gradient reaches each replica's logits summed over the replicas (dp times the
    whole loss's, since every replica adds the same term), which the data-parallel averaging brings
    back to exactly the whole loss's gradient. Costs one all-gather of [tokens, experts] per MoE layer
    and one of the attention mask per step.

Must not know a family: it reads what transformers' MoE causal LMs expose (`router_logits` and
`aux_loss` in the output, `num_experts`, `num_experts_per_tok`, `router_aux_loss_coef` on the model, and
`load_balancing_loss_func` in the model's module), and refuses a model without them.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from meshboost.distributed import comm

REPLICA = "replica"
GLOBAL = "global"
MODES = (REPLICA, GLOBAL)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"router_statistics={mode!r}; expected one of {MODES} ('replica': each data-parallel "
                         "replica's own load-balancing loss, DDP's semantics; 'global': routing statistics of the "
                         "whole batch, all-gathered over dp)")
    return mode


def loss_function(model: nn.Module):
    """The family's `load_balancing_loss_func`, or an error naming what is missing."""
    func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(model, a)]
    if func is None or missing:
        raise NotImplementedError(f"router_statistics='global': {type(model).__name__} is not a transformers MoE causal "
                                  f"LM with a load-balancing loss (missing: {missing or ['load_balancing_loss_func']}); "
                                  "use router_statistics='replica'")
    return func


def with_global_router_loss(model: nn.Module, output, attention_mask, group):
    """`output` (the model's, with router logits) with its load-balancing term recomputed on every
    replica's routing statistics: `loss` and `aux_loss` replaced. A collective over `group` (dp)."""
    logits = getattr(output, "router_logits", None)
    if getattr(output, "aux_loss", None) is None or not logits:
        return output                     # no router loss this call (output_router_logits off)
    func = loss_function(model)
    counts = torch.tensor([logits[0].shape[0]], device=logits[0].device)
    sizes = comm.all_gather(counts, group, dim=0).tolist()
    if len(set(sizes)) > 1:
        raise ValueError(f"router_statistics='global': the data-parallel replicas hold {sizes} tokens; gathering "
                         "their routing statistics needs equal batch shapes on every replica (pad the last batch or "
                         "drop it: drop_last=True), or use router_statistics='replica'")
    gathered = tuple(comm.gather_from_seq(layer, group, dim=0) for layer in logits)
    mask = None if attention_mask is None else comm.all_gather(attention_mask.contiguous(), group, dim=0)
    aux = func(gathered, model.num_experts, model.num_experts_per_tok, mask)
    coef = model.router_aux_loss_coef
    if output.loss is not None:
        output.loss = output.loss - coef * output.aux_loss.to(output.loss.device) + coef * aux.to(output.loss.device)
    output.aux_loss = aux
    return output
