"""One rank's traffic per step from what it holds: the payload of every collective per axis, and the
collective calls ZeRO and FSDP2 make.

Owns `rank_traffic` (cost.comm_per_step's inputs read from a rank's shards and the model: its dense and
expert elements, ZeRO's padded buckets, tied weights, MoE layers, the attention shape a sequence split
exchanges; FSDP2's gathers and reductions added under zero=3), `zero_buckets` (the calls the cost model
charges) and `attention_shape`. Must not estimate time (cost.py) nor memory.
"""

from __future__ import annotations

from meshboost.plan import cost, memory, sharded
from meshboost.plan.layout import Layout

# encoders whose layers end in a LayerNorm after the MLP (checkpointing's recompute reaches it)
POST_NORM = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "distilbert", "mpnet",
             "data2vec-text")


def attention_shape(planner, layout: Layout) -> cost.AttentionShape:
    """Query and key/value heads one tp rank holds (kv replicated when fewer than tp), and head_dim."""
    text = planner.config.get_text_config() if hasattr(planner.config, "get_text_config") else planner.config
    heads = getattr(text, "num_attention_heads", 1)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or planner.hidden // heads
    return cost.AttentionShape(heads // layout.tp, max(1, kv // layout.tp), head_dim)


def zero_buckets(planner, layout: Layout, shards) -> int:
    """ZeRO-1/2's buckets (one reduce-scatter and one all-gather each), FSDP2's units (zero=3), 1
    otherwise."""
    if layout.zero == 3 and layout.fsdp_sizes[1] > 1:
        return len(sharded.fsdp_units(shards, planner.layer_prefixes))
    if layout.zero not in (1, 2) or layout.grad_replicas == 1:
        return 1
    return max(1, len(memory.zero_buckets(shards, layout.grad_replicas, 0, layout.ep)))


def rank_traffic(planner, layout: Layout, shards, layers_held: int, first: bool, last: bool,
                 summed_per_layer: int = 0) -> dict:
    """{axis: [(op, payload bytes)]} of one rank holding `shards` (`layers_held` layers; the first and
    or last pipeline stage), as `dispatched_comm_counter` counts a step of it: cost.comm_per_step's
    terms from the rank's holdings, FSDP2's collectives under zero=3."""
    dense = [s for s in shards if not s.expert]
    local = padded = sum(s.numel for s in dense)
    expert_local = expert_padded = sum(s.numel for s in shards if s.expert)
    if layout.zero in (1, 2):           # each bucket padded to a multiple of its group (dp, or edp)
        buckets = memory.zero_buckets(shards, layout.grad_replicas, 0, layout.ep)
        padded = sum(-(-n // size) * size for n, size, _, expert in buckets if not expert)
        expert_padded = sum(-(-n // size) * size for n, size, _, expert in buckets if expert)
    tied = sum(s.numel for s in dense if s.tie is not None)
    moe = None
    if planner.expert_paths:
        moe_layers = len({s.name.rsplit(".", 1)[0] for s in shards} & planner.expert_paths)
        moe = cost.MoeTraffic(moe_layers, planner.top_k, planner.num_experts, expert_local, expert_padded)
    sequence = None
    if layout.cp > 1 or layout.sequence_parallel and layout.tp > 1:
        sequence = cost.SequenceTraffic(attention_shape(planner, layout), summed_per_layer)
    comm = cost.comm_per_step(layout, planner.hidden, layers_held, first, last, local, padded, planner.seq, tied,
                              planner.vocab_parallel_loss, planner.lm_head, moe, sum(s.tp_grad_sum for s in shards),
                              planner.config.model_type in POST_NORM, sequence, shards.frozen_inputs)
    fsdp = sharded.fsdp_step_comm(layout, shards, planner.layer_prefixes) if layout.zero == 3 else {}
    for axis, ops in fsdp.items():                  # FSDP2's, per op (calls: zero_buckets)
        comm.setdefault(axis, []).extend(ops)
    return comm

