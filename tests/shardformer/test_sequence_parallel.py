"""Issue 13, item 1: Megatron sequence parallelism ("split_gather", `enable_sequence_parallelism=True`).

Against the unsharded model from the same weights and batch (fp32): eval output, loss (1e-5), every
gathered gradient and every weight after AdamW, for BERT, GPT-2, Llama, the generic-plan families and
the hand-written BLOOM/Falcon tables, at tp=2 and tp=4; through the plugin with ZeRO-1 over dp, with
pipeline stages (the boundary carries 1/tp of the sequence) and with activation checkpointing.
Communication per step equals plain tensor parallelism's per layer, and the whole-step difference is
exactly the formula of docs/sequence_parallel.md; activation memory saved after forward drops by exactly
(tp - 1) x the bytes of the split regions. Refusals: a sequence not divisible by tp, encoder-decoder,
output_hidden_states, a layer that flattens its tokens (OPT), ColossalAI's other modes and sp_size.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.distributed.profiling import comm_counter
from meshboost.optim.memory import saved_activation_bytes
from meshboost.pipeline import split_microbatches
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.shardformer.layers.linear import SequenceLayoutError
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import booster_step, check_tp_equivalence, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

SP = {"enable_sequence_parallelism": True}
CASES = (("BertForSequenceClassification", "bert"), ("BertModel", "bert"), ("GPT2LMHeadModel", "gpt2"),
         ("LlamaForCausalLM", "llama"), ("LlamaForCausalLM", "llama_gqa"), ("Qwen2ForCausalLM", "qwen2"),
         ("MistralForCausalLM", "mistral"), ("GemmaForCausalLM", "gemma"), ("BloomForCausalLM", "bloom"),
         ("FalconForCausalLM", "falcon"))
PLUGIN_CASES = (   # plugin settings (with SP), model; activation checkpointing on or off
    ({"tp_size": 2, "zero_stage": 1}, "llama", False),                               # tp=2 x dp=2, ZeRO-1
    ({"tp_size": 2, "pp_size": 2, "num_microbatches": 2}, "llama", False),           # tp=2 x pp=2
    ({"tp_size": 2, "pp_size": 2, "num_microbatches": 4, "pp_style": "interleaved", "num_model_chunks": 2},
     "gpt2", False),
    ({"tp_size": 2, "pp_size": 2, "num_microbatches": 2}, "gpt2", True),             # + checkpointing
    ({"tp_size": 4, "zero_stage": 2}, "llama", True),                                # tp=4, ZeRO-2 (dp=1)
)
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _equivalence(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]             # every rank builds both
    for group in (dist.group.WORLD, pairs[rank // 2]):                   # tp=4, then tp=2 twice over
        for cls, family in CASES:
            check_tp_equivalence(cls, family, group, shard_options=SP)
        # with the kernel switches: SDPA on per-rank heads over the gathered sequence, fused norms on the chunk
        for cls, family in (("LlamaForCausalLM", "llama"), ("GPT2LMHeadModel", "gpt2")):
            check_tp_equivalence(cls, family, group, attention="eager", shard_options={
                **SP, "enable_flash_attention": True, "enable_fused_normalization": True})


def _plugins(rank: int, world: int) -> None:
    for settings, family, checkpointing in PLUGIN_CASES:
        cls = CLASSES[family]
        config = tiny_config(family, num_hidden_layers=4)
        batch = tiny_batch(cls, config, batch=4, seq=8, seed=7)
        ref = build_model(cls, copy.deepcopy(config))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        want = dict(ref.named_parameters(remove_duplicate=False))

        model = build_model(cls, copy.deepcopy(config))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        plugin = HybridParallelPlugin(**settings, **SP)
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, opt)
        model.train()
        mine = split_microbatches(batch, plugin.dp_size)[plugin.mesh.dp_rank] if plugin.dp_size > 1 else batch
        loss = booster_step(booster, model, opt, mine)
        where = f"sequence parallel {settings} {family} checkpointing={checkpointing}"
        if plugin.dp_size == 1 and plugin.mesh.pp_rank == plugin.pp_size - 1:
            assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"{where}: {loss} vs {ref_loss}"
        for name, p in model.unwrap().named_parameters():
            assert_close(gathered(p), want[name].detach(), msg=f"{where}: {name}")
        dist.barrier()


def test_sequence_parallel_matches_unsharded_at_tp2_and_tp4():
    spawn(_equivalence, 4)


def test_sequence_parallel_through_the_plugin_with_zero_pp_and_checkpointing():
    spawn(_plugins, 4)


def _bytes_and_memory(rank: int, world: int) -> None:
    group, tp = dist.group.WORLD, world
    b, s = 4, 24                      # local chunk 12: neither a head count nor a width of these models
    for cls, family in (("GPT2LMHeadModel", "gpt2"), ("LlamaForCausalLM", "llama")):
        config = tiny_config(family, num_hidden_layers=3)
        batch = tiny_batch(cls, config, batch=b, seq=s)
        measured = {}
        for sp in (False, True):
            model = build_model(cls, copy.deepcopy(config))
            config_sp = ShardConfig(tensor_parallel_process_group=group, enable_sequence_parallelism=sp)
            ShardFormer(config_sp).optimize(model)
            model.train()
            with comm_counter(names={group: "tp"}) as counter:
                held, saved, out = saved_activation_bytes(lambda: model(**batch))
                loss = out.loss
                loss.backward()
            measured[sp] = held, saved, counter.summary()["tp"], model
        (tp_held, _, tp_comm, _), (sp_held, sp_saved, sp_comm, sp_model) = measured[False], measured[True]
        # Per layer: each all-reduce of plain TP became an all-gather + a reduce-scatter of the same
        # tensor (same ring bytes). Whole step: + the stack's entry split (all-gather of its gradient)
        # and exit gather (b*s*h each, (P-1)/P on the ring), + one all-reduce of every replicated
        # parameter that sees the split sequence (norms, row-parallel biases).
        stack = sp_model.base_model.h if family == "gpt2" else sp_model.base_model.layers
        replicated = sum(p.numel() for p in _replicated(stack))
        hidden_bytes = b * s * config.hidden_size * 4
        expected = 2 * hidden_bytes * (tp - 1) / tp + 2 * (tp - 1) / tp * replicated * 4
        assert sp_comm["sent_bytes"] - tp_comm["sent_bytes"] == pytest.approx(expected), (family, sp_comm, tp_comm)
        layers = len(stack)
        assert sp_comm["by_op"]["reduce_scatter"] == 4 * layers, sp_comm           # 2 forward + 2 backward per layer
        assert sp_comm["bytes_by_op"]["reduce_scatter"] == 4 * layers * hidden_bytes
        assert sp_comm["by_op"]["all_reduce"] - len(_replicated(stack)) == tp_comm["by_op"]["all_reduce"] - 4 * layers
        assert sp_comm["by_op"]["all_gather"] == 4 * layers + 2, sp_comm           # + the stack's entry and exit
        # Memory: what sits in the split regions ([batch, seq/tp, ...]: norm inputs and statistics,
        # residual-side tensors) is 1/tp of plain TP's; nothing else changes.
        split = sum(v for key, v in sp_saved.items() if len(key[2]) == 3 and key[2][:2] == (b, s // tp))
        assert split > 0
        assert tp_held - sp_held == (tp - 1) * split, (family, tp_held, sp_held, split)


def _replicated(stack) -> list[torch.Tensor]:
    """The parameters of the layers that see the split sequence: norms and GPT-2's row-parallel biases."""
    return [p for layer in stack for n, p in layer.named_parameters()
            if "ln_" in n or "norm" in n or n.endswith("c_proj.bias")]


def test_sequence_parallel_bytes_equal_plain_tp_and_activations_shrink():
    spawn(_bytes_and_memory, 2)


def _refusals(rank: int, world: int) -> None:
    group = dist.group.WORLD
    shard = ShardFormer(ShardConfig(tensor_parallel_process_group=group, **SP))
    config = tiny_config("llama")
    model = build_model("LlamaForCausalLM", config)
    shard.optimize(model)
    odd = tiny_batch("LlamaForCausalLM", config, seq=7)
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp_size=2"):
        model(**odd)
    short = tiny_batch("LlamaForCausalLM", config, seq=2)
    with pytest.raises(ValueError, match="at least 2"):
        model(**short)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(**tiny_batch("LlamaForCausalLM", config), output_hidden_states=True)
    with pytest.raises(ValueError, match="cross-attention"):
        ShardFormer(ShardConfig(tensor_parallel_process_group=group, **SP)).optimize(
            build_model("T5ForConditionalGeneration", tiny_config("t5")))
    opt_model = build_model("OPTForCausalLM", tiny_config("opt"))
    shard.optimize(opt_model)
    with pytest.raises(SequenceLayoutError, match="sequence parallelism"):     # it flattens tokens before fc1
        opt_model(**tiny_batch("OPTForCausalLM", tiny_config("opt")))
    # ColossalAI's sp_size beside split_gather follows tp_size (ignored, as there): the same plugin as without it
    named = dict(SP, sequence_parallelism_mode="split_gather")
    assert HybridParallelPlugin(tp_size=2, sp_size=2, **named).config == HybridParallelPlugin(tp_size=2, **named).config
    with pytest.raises(ValueError, match="sp_size=2 with sequence_parallelism_mode=None: name the mode"):
        HybridParallelPlugin(tp_size=2, sp_size=2, **SP)


def _overlap(rank: int, world: int) -> None:
    """A column-parallel linear with its own collective (plain TP: Megatron's f; sequence parallel: the
    gather) starts its input-gradient all-reduce / reduce-scatter asynchronously, computes the weight
    gradient, and only then waits: the order of aten matmuls and collective events in backward shows it.
    Its numbers equal a plain linear's on the whole input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshboost.distributed import comm
    from meshboost.shardformer.layers import ColumnParallelLinear

    events = []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("mm", "bmm", "matmul")):
                events.append("matmul")
            return func(*args, **(kwargs or {}))

    started = {name: getattr(comm, name) for name in ("all_reduce_async", "reduce_scatter_async")}
    wait = comm.Pending.wait

    def record(name):
        def call(*args, **kwargs):
            events.append("start")
            return started[name](*args, **kwargs)
        return call
    group = dist.group.WORLD
    try:
        for name in started:
            setattr(comm, name, record(name))
        comm.Pending.wait = lambda self: (events.append("wait"), wait(self))[1]
        for seq_parallel in (False, True):
            torch.manual_seed(0)
            native = torch.nn.Linear(16, 8)
            full = torch.randn(2, 6, 16, requires_grad=True)
            want_out = native(full)
            want_out.pow(2).sum().backward()
            layer = ColumnParallelLinear.from_native(copy.deepcopy(native), group, seq_parallel=seq_parallel)
            x = full.detach().chunk(world, dim=1)[rank].clone() if seq_parallel else full.detach().clone()
            x.requires_grad_(True)
            out = layer(x)
            assert_close(out, want_out.detach().chunk(world, dim=-1)[rank], msg=f"overlap forward sp={seq_parallel}")
            events.clear()
            with Matmuls():
                out.pow(2).sum().backward()
            assert events == ["matmul", "start", "matmul", "wait"], (seq_parallel, events)
            want_grad = full.grad.chunk(world, dim=1)[rank] if seq_parallel else full.grad
            assert_close(x.grad, want_grad, msg=f"overlap input grad sp={seq_parallel}")
            assert_close(gathered(layer.weight, layer.weight.grad), native.weight.grad, msg="overlap weight grad")
    finally:
        for name, fn in started.items():
            setattr(comm, name, fn)
        comm.Pending.wait = wait


def _refusals_and_overlap(rank: int, world: int) -> None:
    _refusals(rank, world)
    _overlap(rank, world)


def test_sequence_parallel_refuses_what_it_cannot_split_and_column_collectives_overlap():
    spawn(_refusals_and_overlap, 2)
    # ColossalAI's "ring" over the tp group is split_gather's layout (the same numbers); the context modes
    # belong to sp_size, and the message says so instead of listing them as accepted
    assert ShardConfig(enable_sequence_parallelism=True,
                       sequence_parallelism_mode="ring").sequence_parallelism_mode == "split_gather"
    with pytest.raises(ValueError, match="'all_to_all' splits the sequence over a sequence axis of its own.*sp_size"):
        ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
