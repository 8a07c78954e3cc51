"""Issue 24, item 3: one owner for sequence and block regions (meshboost/shardformer/regions.py).

The sharder's `RegionPlan` decides every parallel linear's `LinearRole` once (does it apply Megatron's
f, is that f the sequence all-gather, is its output reduce-scattered, which block region encloses it);
a block's hooks and the linears inside it hold the same `BlockRegion`; the split-input guards read
the column outputs from one `ColumnOutputs`. Nothing travels in a module's `__dict__` or in attributes
set on tensors. The numbers these roles give are the business of test_policies.py and
test_sequence_parallel.py; this file checks who decides and who holds what.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear
from meshboost.shardformer.regions import ColumnOutputs, LinearRole, RegionPlan
from meshboost.shardformer.sharder import UncoveredParameterError, split_input_guard
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_batch, tiny_config


def test_the_plan_decides_each_linear_role():
    plan = RegionPlan(seq_stack="model.layers")
    attn = plan.add(["model.layers.0.attn", "model.shared.attn"], None, 2, ("hidden_states",))
    outside = plan.add(["model.head_block"], None, 2, ("hidden_states",))
    assert attn.gathers and not outside.gathers             # gathering in the sequence-parallel stack only
    assert plan.at("model.shared.attn") is attn               # one region, every path to its block
    # a column inside a region: the block's hook applied f (here: gathered the sequence) for it
    assert plan.column_role("model.layers.0.attn.q") == LinearRole(False, False, attn, plan.outputs)
    # ... unless it has an f of its own (a gathered projection): plain, skipped for the block's input
    assert plan.column_role("model.layers.0.attn.q", own_f=True) == LinearRole(True, False, attn, plan.outputs)
    # outside any region: f of its own, the sequence all-gather in the stack
    assert plan.column_role("model.layers.0.mlp.up") == LinearRole(True, True, None, plan.outputs)
    assert plan.column_role("model.lm_proj") == LinearRole(True, False, None, plan.outputs)
    assert plan.column_role("model.head_block.fc").region is outside
    assert plan.row_role("model.layers.0.mlp.down").seq_parallel
    assert not plan.row_role("model.head_block.out").seq_parallel
    assert plan.enclosing("model.layers.0.attn") is None     # a block is not inside itself


def test_column_outputs_are_held_weakly_while_a_guard_waits():
    outputs = ColumnOutputs()
    y = torch.randn(2, 3)
    outputs.note(y)
    assert not outputs.holds(y)                              # no guard waiting: nothing recorded
    norm = nn.LayerNorm(3)
    split_input_guard("block.norm", outputs)(norm)
    outputs.note(y)
    assert outputs.holds(y) and outputs.holds(y.view(3, 2)) and not outputs.holds(y.clone())
    with pytest.raises(UncoveredParameterError, match="block.norm"):
        norm(y.view(2, 3))
    norm(torch.randn(2, 3))                                  # a clean call: the guard removes itself
    assert not norm._forward_pre_hooks and not outputs.holds(y)
    outputs.note(y)
    assert not outputs.holds(y)                              # every guard passed: recording stops
    z = torch.randn(1)
    outputs.watch()
    outputs.note(z)
    del z
    assert len(outputs._live) == 0                           # weak: a dead output leaves no entry


def _no_side_channels(rank, world):
    group = dist.group.WORLD
    for sp in (False, True):
        config = tiny_config("llama")
        model = build_model("LlamaForCausalLM", config)
        ShardFormer(ShardConfig(tensor_parallel_process_group=group, enable_sequence_parallelism=sp)).optimize(model)
        attn = model.model.layers[0].self_attn
        region = attn.q_proj.role.region
        assert region is not None and region.gathers == sp
        assert all(getattr(attn, p).role.region is region and not getattr(attn, p).copy_input
                   for p in ("q_proj", "k_proj", "v_proj"))
        assert attn.o_proj.role.seq_parallel == sp and attn.o_proj.role.region is None
        hooks = [h for h in attn._forward_pre_hooks.values() if getattr(h, "__self__", None) is region]
        assert len(hooks) == 1                               # the block's hook holds the same object
        outs = []
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.register_forward_hook(lambda mod, args, out: outs.append(out))
        batch = tiny_batch("LlamaForCausalLM", config)
        model(**batch).loss.backward()
        assert outs and all(not vars(o) for o in outs), "a parallel linear set an attribute on its output"
        stray = [(n, k) for n, m in model.named_modules() for k in vars(m) if k.startswith("_meshboost")
                 or k == "enclosing_block"]
        assert not stray, stray


def test_block_hooks_and_linears_share_one_region_and_nothing_rides_on_modules_or_tensors():
    spawn(_no_side_channels, 2)
