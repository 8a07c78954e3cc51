"""meshboost.plan: the CLI on a config alone, its JSON keys, the plugin's refusals, and one spawned
comparison of predicted against measured training-state bytes (benchmarks/plan_accuracy.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from meshboost.plan.__main__ import main

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LLAMA_7B = ("hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
            "num_key_value_heads=32,vocab_size=32000,max_position_embeddings=4096")
MEMORY = ("weights", "gradients", "optimizer_states", "masters", "activations", "buffers", "total")


def _main(argv) -> int:
    """main's exit status: returned, or argparse's SystemExit (a refusal: one line, status 2)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = _main(["--model", "llama", "--set", LLAMA_7B, "--gpus", "8", "--seq", "4096", "--global-batch", "64",
                  *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_explain_7b_layout_json(capsys):
    code, out, _ = _run(capsys, "--layout", "tp=2,pp=2,zero=1", "--json")
    assert code == 0
    (entry,) = json.loads(out)
    assert {"tp", "pp", "dp", "ep", "cp", "cp_mode", "sequence_parallel", "zero", "microbatches"} <= set(
        entry["layout"])
    assert entry["layout"]["dp"] == 2
    assert set(MEMORY) <= set(entry["memory_bytes_per_rank"])
    assert {"tp", "pp", "dp"} <= set(entry["comm_bytes_per_step"])
    assert "relative_step_time" in entry
    mem = entry["memory_bytes_per_rank"]
    assert mem["total"] == sum(mem[k] for k in MEMORY[:-1])
    # 6.74e9 parameters over tp=2 x pp=2 (~1.69e9 each; the last stage also holds the LM head), bf16
    assert 3.2e9 < mem["weights"] < 3.6e9
    assert mem["masters"] == pytest.approx(mem["weights"], rel=1e-3)   # fp32 masters of the dp=2 half ...
    assert mem["optimizer_states"] == 2 * mem["masters"]      # ... and two fp32 moments


def test_rank_7b_on_8_gpus(capsys):
    code, out, _ = _run(capsys, "--json")
    assert code == 0
    ranked = json.loads(out)
    # fits: the predicted reserved peak plus what lies outside the allocator within the device's memory
    assert ranked and all(e["memory_bytes_per_rank"]["reserved"] + e["memory_bytes_per_rank"]["outside"]
                          <= 80 * 2**30 for e in ranked)
    assert ranked[0]["relative_step_time"] == pytest.approx(1.0)
    assert all(e["layout"]["tp"] * e["layout"]["pp"] * e["layout"]["dp"] * e["layout"]["cp"] == 8 for e in ranked)
    modes = {e["layout"]["cp_mode"] for e in ranked}     # the sequence splits are enumerated too
    assert {"all_to_all", "ring_attn"} <= modes and any(e["layout"]["sequence_parallel"] for e in ranked)


def test_invalid_layout_gives_the_plugins_message(capsys):
    from meshboost.optim import ZeroConfig
    from meshboost.pipeline import PipelineConfig
    from meshboost.plugins.config import HybridParallelConfig

    with pytest.raises(ValueError) as plugin:      # (zero=3 with a pipeline runs since issue 40)
        HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=4),
                             zero=ZeroConfig(stage=3, cpu_offload=True))
    code, _, err = _run(capsys, "--layout", "pp=2,zero=3,mb=4,dp=4,offload")
    assert code == 2
    assert " ".join(str(plugin.value).split()) in err            # zero=3 with cpu offload: the plugin's refusal ...
    code, _, err = _run(capsys, "--layout", "tp=3")
    assert code == 2 and "not divisible by tp_size=3" in err      # ... and the sharder's own check
    # sequence splits: the plugin's, the context split's and split_gather's own messages (ColossalAI's sp=
    # and sp_mode= are read as cp's)
    code, _, err = _run(capsys, "--layout", "sp=2,sp_mode=ring")
    assert code == 2 and "sequence_parallelism_mode='ring'" in err and "takes no cp_size" in err
    code, _, err = _run(capsys, "--layout", "cp_mode=all_to_all")
    assert code == 2 and "with cp_size=1 splits nothing" in err
    code = _main(["--model", "llama", "--set", LLAMA_7B, "--gpus", "8", "--seq", "4098", "--layout",
                  "cp=4,cp_mode=ring_attn"])
    err = capsys.readouterr().err
    assert code == 2 and "sequence length 4098 is not divisible by 8 (cp_size=4, ring_attn;" in err
    code, _, err = _run(capsys, "--layout", "cp=2", "--model", "bert")
    assert code == 2 and "context parallelism runs causal LMs" in err
    # a layout the plugin itself refuses: its message, word for word
    from meshboost.plan.layout import Layout, plugin_config
    with pytest.raises(ValueError) as planned:
        plugin_config(Layout.of(pp=2, zero=3, microbatches=4, cpu_offload=True))
    assert str(planned.value) == str(plugin.value)


def test_predicted_matches_measured():
    """One spawned group of 2: a dense tp layout and an MoE's expert-parallel one (experts dealt out
    over ep, their ZeRO buckets of their own), predicted from the config against the tensors."""
    from benchmarks.plan_accuracy import compare, measure

    cases = [("llama", dict(tp=2, precision="bf16")), ("qwen3_moe", dict(dp=2, ep=2, zero=1, precision="fp32")),
             ("llama", dict(tp=2, sequence_parallel=True, precision="fp32")),
             ("llama", dict(cp=2, cp_mode="ring_attn", checkpointing=True, precision="fp32"))]
    for case, ranks in zip(cases, measure(cases)):
        errors = compare(*case, ranks)
        for key in ("weights", "gradients", "masters", "optimizer_states"):
            assert errors[key][0] < 0.01, (case, key, errors[key])
        assert errors["activations"][0] < 0.05, (case, errors["activations"])
        comm = {key: value for key, value in errors.items() if key.startswith("comm")}
        assert comm and all(err == 0 for err, _, _ in comm.values()), (case, comm)   # comm_counter's payload bytes


def test_sequence_splits_7b(capsys):
    """split_gather holds the norms' and residuals' activations at 1/tp of the sequence (same weights, the
    tp all-reduces become all-gathers and reduce-scatters); context parallelism divides the activations
    by cp, partitions ZeRO over dp x cp and adds its own traffic, all_to_all's and ring_attn's."""
    layouts = {}
    for name, layout in (("tp", "tp=4,zero=1,ckpt=0"), ("sg", "tp=4,split_gather,zero=1"),
                         ("a2a", "tp=2,cp=2,zero=1"), ("ring", "tp=2,cp=2,cp_mode=ring_attn,zero=1"),
                         ("tp2", "tp=2,zero=1")):
        code, out, _ = _run(capsys, "--layout", layout, "--json")
        assert code == 0, layout
        (layouts[name],) = json.loads(out)
    mem = {k: v["memory_bytes_per_rank"] for k, v in layouts.items()}
    comm = {k: v["comm_bytes_per_step"] for k, v in layouts.items()}
    assert mem["sg"]["weights"] == mem["tp"]["weights"]
    assert mem["sg"]["activations"] < 0.8 * mem["tp"]["activations"]
    assert comm["sg"]["tp"] > comm["tp"]["tp"] and comm["sg"]["cp"] == 0 == comm["tp"]["cp"]
    # tp=2 x cp=2: the weights of tp=2, ZeRO's states over dp x cp = 4 (as tp=2's over dp = 4)
    assert mem["a2a"]["weights"] == mem["tp2"]["weights"]
    assert mem["a2a"]["optimizer_states"] == mem["tp2"]["optimizer_states"]
    assert mem["a2a"]["activations"] < 0.6 * mem["tp2"]["activations"]
    assert comm["a2a"]["cp"] > 0 and comm["ring"]["cp"] > 0
    assert comm["a2a"]["dp"] == pytest.approx(comm["tp2"]["dp"], rel=1e-6)     # + the token counts per micro-batch
    assert layouts["ring"]["layout"]["cp_mode"] == "ring_attn"


def test_zero3_and_offload_7b(capsys):
    """ZeRO-3 (FSDP2) shards the fp32 weights, gradients and moments over dp; cpu_offload moves the
    masters and moments of ZeRO-1 to the host (reported apart, outside the device total)."""
    code, out, _ = _run(capsys, "--layout", "zero=3,ckpt=1", "--json")
    assert code == 0
    (z3,) = json.loads(out)
    mem = z3["memory_bytes_per_rank"]
    assert 4 * 6.7e9 / 8 < mem["weights"] < 4 * 6.8e9 / 8 and mem["masters"] == 0      # fp32 shards, dp=8
    assert mem["optimizer_states"] == 2 * mem["gradients"] == 2 * mem["weights"]
    code, out, _ = _run(capsys, "--layout", "zero=1,offload=1", "--json")
    (offload,) = json.loads(out)
    mem = offload["memory_bytes_per_rank"]
    assert mem["masters"] == mem["optimizer_states"] == 0 and mem["host"] > 12 * 6.7e9 / 8


QWEN3_30B_A3B = ("hidden_size=2048,intermediate_size=6144,moe_intermediate_size=768,num_hidden_layers=48,"
                 "num_attention_heads=32,num_key_value_heads=4,head_dim=128,num_experts=128,num_experts_per_tok=8,"
                 "vocab_size=151936,max_position_embeddings=32768,tie_word_embeddings=false")


def test_moe_expert_parallel_plan(capsys):
    """Qwen3-30B-A3B on 16 GPUs: ep splits the experts (the weights per rank drop by ~ep), its ZeRO
    buckets partition over edp = dp / ep, and ep that does not divide dp is the mesh's own error."""
    argv = ["--model", "qwen3_moe", "--set", QWEN3_30B_A3B, "--gpus", "16", "--nodes", "2", "--seq", "4096",
            "--global-batch", "64", "--json"]
    assert main([*argv, "--layout", "tp=2,ep=8,zero=1,ckpt=1"]) == 0
    (ep8,) = json.loads(capsys.readouterr().out)
    assert main([*argv, "--layout", "tp=2,zero=1,ckpt=1"]) == 0
    (ep1,) = json.loads(capsys.readouterr().out)
    assert ep8["layout"]["ep"] == 8 and ep8["comm_bytes_per_step"]["ep"] > 0 == ep1["comm_bytes_per_step"]["ep"]
    # 30.5e9 parameters, 29.0e9 of them experts: per rank 29.0e9 / (tp=2 x ep=8) + 1.5e9 / tp=2 (attention,
    # router, vocab-parallel embedding and head) = 2.58e9 bf16 weights; 15.3e9 without ep
    weights8, weights1 = ep8["memory_bytes_per_rank"]["weights"], ep1["memory_bytes_per_rank"]["weights"]
    assert 2 * 2.5e9 < weights8 < 2 * 2.7e9 and 2 * 15.0e9 < weights1 < 2 * 15.6e9
    assert _main([*argv, "--layout", "tp=2,ep=3,zero=1"]) == 2
    assert "ep_size=3 does not divide the data-parallel size 8" in capsys.readouterr().err


def _planned_plugin_body(rank, world):
    import torch
    import transformers as tfm

    from meshboost import Booster
    from meshboost.optim.memory import memory_breakdown
    from meshboost.plan import plan

    overrides = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    estimate = plan("llama", overrides, layout="tp=2,zero=1,precision=fp32", gpus=2, memory_gb=1, seq=16,
                    global_batch=2)
    plugin = estimate.plugin()                    # the layout the planner explained, as a plugin
    assert (plugin.tp_size, plugin.zero_stage, plugin.precision) == (2, 1, "fp32")
    torch.manual_seed(0)
    model = tfm.LlamaForCausalLM(tfm.LlamaConfig(**overrides))
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    held = memory_breakdown(model, optimizer)
    predicted = estimate.memory_bytes_per_rank
    assert held["working_weights"] == predicted["weights"], (held, predicted)
    assert held["optimizer_states"] == predicted["optimizer_states"], (held, predicted)
    _runtime_facts_body(rank, overrides)


def _runtime_facts_body(rank, overrides):
    """The planner's copies of the runtime's figures are the runtime's, measured on what it sends
    (torch's dispatcher: `dispatched_comm_counter`): the p2p header before an activation, the input
    check's all-gather per rank, and the bucket cap of the DDP the planned zero-0 plugin builds."""
    import torch
    import torch.distributed as dist
    import transformers as tfm

    from meshboost import Booster
    from meshboost.distributed import ParallelDims, ParallelMesh
    from meshboost.distributed.p2p import StageComm
    from meshboost.distributed.profiling import dispatched_comm_counter
    from meshboost.plan import plan
    from meshboost.plan.cost import DDP_BUCKET_BYTES, INPUT_CHECK_BYTES, P2P_HEADER_BYTES
    from meshboost.plugins.input_checks import InputCheck

    activation = torch.zeros(3, 5)
    with dispatched_comm_counter() as sent:
        stages = StageComm(dist.group.WORLD, torch.device("cpu"))
        if rank == 0:
            stages.send_activation([activation], 1)
            stages.wait_sends()
        else:
            assert torch.equal(stages.recv_activation(1)[0], activation)
    if rank == 0:
        assert sent.summary()["world"]["bytes_by_op"]["send"] == P2P_HEADER_BYTES + activation.nbytes, sent.summary()
    check = InputCheck(ParallelMesh(ParallelDims(tp=2)))        # (the mesh agrees its settings: not counted)
    with dispatched_comm_counter() as gathered:
        check(torch.ones(2, 4, dtype=torch.long))
    assert gathered.summary()["world"]["bytes_by_op"] == {"all_gather": 2 * INPUT_CHECK_BYTES}, gathered.summary()
    estimate = plan("llama", overrides, layout="zero=0,precision=fp32", gpus=2, memory_gb=1, seq=16, global_batch=2)
    model, *_ = Booster(plugin=estimate.plugin()).boost(tfm.LlamaForCausalLM(tfm.LlamaConfig(**overrides)))
    ddp = model.module
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    assert ddp.bucket_bytes_cap == DDP_BUCKET_BYTES, (ddp.bucket_bytes_cap, DDP_BUCKET_BYTES)


def test_estimate_builds_the_plugin_it_explains():
    """...and the planner's p2p header, input-check bytes and DDP bucket are the runtime's (one group)."""
    from meshboost.testing import spawn

    spawn(_planned_plugin_body, 2)


# -- the cost model's constants: calibration, defaults, the file the planner reads ------------------
def _finite_positive(constants):
    import math
    from dataclasses import fields
    for f in fields(constants):
        value = getattr(constants, f.name)
        if f.name != "source" and value is not None:        # None: all_gather's rate and latency
            # rates are positive; an overhead fitted under noise may clamp to 0 (calibrate keeps it >= 0)
            rate = any(k in f.name for k in ("flops", "bytes_s", "elements_s", "speedup"))
            assert math.isfinite(value) and (value > 0 if rate else value >= 0), (f.name, value)


def test_calibration_over_two_processes_round_trips_and_the_planner_reads_it(tmp_path, capsys):
    """One calibration (the CLI's, over 2 gloo processes; the one-process path, no collectives, runs in
    tests/benchmarks/test_gpu_check.py's dry run) serves the round trip and the planner's reading of it."""
    from meshboost.plan import calibrate

    path = tmp_path / "cost.json"
    assert main(["--calibrate", "--calibration", str(path), "--precision", "fp32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    constants = calibrate.load(str(path))
    assert printed == json.loads(path.read_text())
    _finite_positive(constants)
    assert constants.source.startswith("calibrated on cpu") and "2 processes, gloo" in constants.source
    assert constants.all_reduce_bytes_s != 0 and constants.send_latency_s < 0.1      # the collectives measured
    assert constants.flops_fp32 < 1e14 and constants.layer_overhead_s < 1.0   # a CPU, not the H100 defaults
    again = tmp_path / "again.json"
    calibrate.save(constants, str(again))
    assert calibrate.load(str(again)) == constants
    code, out, _ = _run(capsys, "--constants", str(path), "--layout", "tp=2,pp=2,zero=1")
    assert code == 0 and "cost constants: calibrated on cpu" in out
    code, out, _ = _run(capsys, "--constants", str(path), "--layout", "tp=2,pp=2,zero=1", "--json")
    calibrated = json.loads(out)[0]["step_seconds"]
    code, out, _ = _run(capsys, "--layout", "tp=2,pp=2,zero=1", "--json")
    assert calibrated > 10 * json.loads(out)[0]["step_seconds"]      # a CPU is far slower than the defaults
    (tmp_path / "bad.json").write_text(json.dumps({"flops_fp32": -1.0}))
    with pytest.raises(ValueError, match="finite number"):
        calibrate.load(str(tmp_path / "bad.json"))
    (tmp_path / "unknown.json").write_text(json.dumps({"flops": 1.0}))
    with pytest.raises(ValueError, match="unknown cost constants"):
        calibrate.load(str(tmp_path / "unknown.json"))


def test_known_gpu_defaults_say_their_source():
    from meshboost.plan import calibrate
    h100 = calibrate.known_gpu_constants("NVIDIA H100 80GB HBM3")
    a100 = calibrate.known_gpu_constants("NVIDIA A100-SXM4-80GB")
    assert calibrate.known_gpu_constants("NVIDIA H200") is not None
    assert calibrate.known_gpu_constants("Some Other GPU") is None
    _finite_positive(h100)
    assert h100.flops_half == pytest.approx(989e12 * 0.4) and a100.flops_half == pytest.approx(312e12 * 0.4)
    assert "datasheet" in h100.source and "efficiency" in h100.source


def test_step_time_terms():
    """The bubble: with per-micro-batch costs equal, pp=2 over M micro-batches takes (M + 1) / M of M slots;
    per-collective latency counts calls, not bytes."""
    from dataclasses import replace

    from meshboost.plan.cost import CostConstants, step_seconds
    from meshboost.plan.layout import Layout
    c = replace(CostConstants(), layer_overhead_s=0.0, microbatch_overhead_s=0.0, pipeline_overhead_s=0.0,
                optimizer_elements_s=1e30)
    terms: dict = {}
    t4 = step_seconds(Layout.of(pp=2, microbatches=4), 10**6, 2, 64, 16, {"tp": [], "pp": [], "dp": []}, 8, c,
                      breakdown=terms)
    assert terms["bubble"] == pytest.approx(1 / 5)
    t1 = step_seconds(Layout.of(microbatches=4), 10**6, 2, 64, 16, {"tp": [], "pp": [], "dp": []}, 8, c)
    assert t4 == pytest.approx(t1 * 5 / 4)
    slow = replace(c, all_reduce_latency_s=1.0)
    act = 16 * 64 * 2
    comm = {"tp": [("all_reduce", 10 * act)], "pp": [], "dp": []}
    base = step_seconds(Layout.of(tp=2), 10**6, 2, 64, 16, comm, 8, c)
    assert step_seconds(Layout.of(tp=2), 10**6, 2, 64, 16, comm, 8, slow) - base == pytest.approx(
        10 * (1.0 - c.all_reduce_latency_s))


# the runtime's name for each planner axis's group (ParallelMesh.group), per layout
RUNTIME_AXES = {"tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",)}


def _runtime_groups(layout, monkeypatch=None) -> dict:
    """{planner axis: {rank: sorted ranks of its group}} from the runtime's ParallelMesh, built on every rank
    of the world in turn over torch's fake process group (no processes, no collectives)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshboost.distributed.dims import ParallelDims
    from meshboost.distributed.mesh import ParallelMesh
    from meshboost.distributed.param_info import DENSE, EXPERT
    from meshboost.plan.layout import planner_axes
    out: dict = {}
    for rank in range(layout.world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
        try:
            mesh = ParallelMesh(ParallelDims(tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=layout.cp,
                                             dp_replicate=layout.dp_replicate), device_type="cpu")
            dims = mesh.dims
            named = {**RUNTIME_AXES, "edp": dims.grad_axes(EXPERT), "dp": dims.shard_axes(DENSE)[1],
                     "dp_replicate": dims.shard_axes(DENSE)[0]}
            for axis, axes in named.items():
                assert dims.size(*axes) == dims.size(*planner_axes(layout.dims, axis)), axis
                axes = tuple(a for a in axes if dims.size(a) > 1)        # a one-rank axis is this rank alone
                ranks = dist.get_process_group_ranks(mesh.group(*axes)) if axes else [rank]
                out.setdefault(axis, {})[rank] = tuple(sorted(ranks))
        finally:
            dist.destroy_process_group()
    return out


# HSDP with ep (the last two): the planner's own copy of the axis map once gave them other groups than the runtime's
LAYOUTS_OF_GROUPS = ("tp=2,pp=2,dp=2", "pp=2,dp=4,ep=2", "tp=2,dp=2,cp=2", "tp=2,dp=4,dp_replicate=2,zero=3",
                     "dp=4,cp=2,dp_replicate=2,zero=3", "dp=8,ep=2,dp_replicate=2,zero=3",
                     "tp=2,dp=4,ep=2,dp_replicate=2,zero=3")


def test_planner_groups_are_the_runtime_meshs(monkeypatch):
    """The planner's groups of every axis (axis_groups, which its inside-a-node test and its group sizes
    read) hold the same ranks as the runtime ParallelMesh's groups for the same layout, in the mesh's
    order and with the order reversed (ParallelDims.mesh_axes patched): the planner follows the runtime's
    record instead of restating its axis order."""
    from meshboost.distributed.dims import ParallelDims
    from meshboost.plan.layout import axis_groups, axis_inside_node, parse_layout

    original = ParallelDims.mesh_axes
    for order in ("runtime", "reversed"):
        if order == "reversed":
            monkeypatch.setattr(ParallelDims, "mesh_axes", property(lambda self: tuple(reversed(original.fget(self)))))
            axis_inside_node.cache_clear()
        for text in LAYOUTS_OF_GROUPS:
            layout = parse_layout(text)
            runtime = _runtime_groups(layout)
            for axis, by_rank in runtime.items():
                planned = axis_groups(layout.dims, axis)
                assert sorted(set(by_rank.values())) == sorted(planned), (order, text, axis)
    monkeypatch.undo()
    axis_inside_node.cache_clear()
    # tp innermost in the runtime's order: tp=2 inside a node of 2, dp (outermost) across nodes
    layout = parse_layout("tp=2,dp=4")
    assert axis_inside_node(layout.dims, "tp", 2) and not axis_inside_node(layout.dims, "dp", 2)


def _tiny_planner(gpus: int, nodes: int = 1, model: str = "llama", **extra):
    from meshboost.plan import Planner
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64, **extra}
    return Planner(model, config, gpus=gpus, nodes=nodes, seq=16, global_batch=gpus, precision="fp32", device="cpu")


def test_hsdp_memory_traffic_and_node_preference():
    """HSDP in the planner: per rank 1/dp_shard of the training state (ZeRO-3 over every dp rank: 1/dp),
    all-gathers and reduce-scatters over the shard group and one all-reduce of the reduced shard over the
    replicas; on two nodes every HSDP candidate keeps its shard groups inside a node, and HSDP with the
    replicas across the nodes is predicted faster than ZeRO-3 over both nodes. (The same figures equal the
    measurement on CPU: tests/benchmarks/test_zero3_memory_bench.py.)"""
    from meshboost.plan.layout import axis_inside_node, parse_layout
    planner = _tiny_planner(16, nodes=2)
    flat = planner.rank_state(parse_layout("dp=16,zero=3,fp32,mb=1x1"))
    hsdp_layout = parse_layout("dp=16,dp_replicate=2,zero=3,fp32,mb=1x1")
    planner.check(hsdp_layout)
    hsdp = planner.rank_state(hsdp_layout)
    for key in ("weights", "gradients", "optimizer_states"):
        assert 0 < flat[key] < hsdp[key] <= 2 * flat[key] + 4 * 64 * 16, key       # 1/8 against 1/16 (+ padding)
    comm = planner.rank_comm(hsdp_layout)
    gathered = sum(n for op, n in comm["dp"] if op == "all_gather")
    scattered = sum(n for op, n in comm["dp"] if op == "reduce_scatter")
    assert gathered > scattered > 0 and comm["dp_replicate"] == [("all_reduce", scattered // 8)]
    candidates = planner.candidates(zero_stages=(3,), checkpointing=(False,))
    replicated = [lay for lay in candidates if lay.dp_replicate > 1]
    assert replicated and all(axis_inside_node(lay.dims, "dp", 8) for lay in replicated)
    assert {lay.dp_replicate for lay in replicated if lay.tp == lay.pp == 1} == {2, 4, 8, 16}   # dp_shard <= 8
    flat_seconds = planner.explain(parse_layout("dp=16,zero=3,fp32,mb=1x1")).step_seconds
    assert planner.explain(hsdp_layout).step_seconds < flat_seconds


def test_zero3_with_pipeline_and_experts():
    """ZeRO-3 with pp: each stage's weights sharded over dp and gathered once per step (the plugin's
    reshard_after_forward default under pp), so a stage all-gathers what it reduce-scatters; with ep: the
    experts sharded over their replicas edp = dp / ep and moved over edp, dense weights over dp."""
    from meshboost.plan.layout import parse_layout
    planner = _tiny_planner(4)
    staged = parse_layout("pp=2,dp=2,zero=3,fp32,mb=2x1")
    planner.check(staged)
    comm = planner.rank_comm(staged, pp_rank=1)
    ops = {op: sum(n for o, n in comm["dp"] if o == op) for op in ("all_gather", "reduce_scatter")}
    assert ops["all_gather"] == ops["reduce_scatter"] > 0          # fp32: the same bytes, one gather each
    moe = _tiny_planner(4, num_local_experts=4, num_experts_per_tok=2, model="mixtral")
    whole, split = (parse_layout(f"dp=4,ep={ep},zero=3,fp32,mb=1x1") for ep in (1, 2))
    moe.check(split)
    experts = sum(s.numel for s in moe.shards(split, 0, 0) if s.expert)
    dense = sum(s.numel for s in moe.shards(split, 0, 0) if not s.expert)
    state = moe.rank_state(split)
    assert experts and state["weights"] == 4 * (dense // 4 + experts // 2)    # dims divisible: no padding
    assert {op for op, _ in moe.rank_comm(split)["edp"]} == {"all_gather", "reduce_scatter"}
    # ep=2 holds half the experts, sharded over edp=2: the same quarter of them as ZeRO-3 over dp=4 at ep=1
    assert moe.rank_state(whole)["weights"] == state["weights"]


def test_lora_accounting_against_peft():
    """LoRA (plan/lora.py): the planner's trainable elements are peft's own count on the same model (every
    linear, and q/v only), the frozen base weights are held in the working dtype with no gradient, fp32 master
    or AdamW moment; at tp=2 a column-parallel linear's lora_B and a row-parallel one's lora_A are split with
    their base, the other factor whole (its gradient summed over tp), and the first attention's input
    gradient is never computed (the embedding is frozen: one all-reduce less); zero=3 is refused as not
    modelled. (Against the tensors and MemTracker: plan_accuracy CASES 44-47, tests/plan/test_peak.py.)"""
    import copy

    import peft
    from transformers import LlamaForCausalLM

    from meshboost.plan import Planner, parse_layout
    from meshboost.plan.lora import LoraOptions

    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}
    whole = parse_layout("dp=2,zero=0,bf16,mb=1x1")
    for targets in ("all-linear", "q_proj,v_proj"):
        options = LoraOptions(4, targets)
        planner = Planner("llama", config, gpus=2, seq=16, global_batch=2, precision="bf16", device="cpu",
                          lora=options)
        reference = peft.get_peft_model(LlamaForCausalLM(copy.deepcopy(planner.config)), options.peft_config())
        trainable, total = reference.get_nb_trainable_parameters()
        planner.check(whole)
        shards = planner.shards(whole, 0, 0)
        assert sum(s.numel for s in shards) == trainable > 0, targets
        assert sum(s.numel for s in shards.frozen) == total - trainable, targets
        assert all("lora_" in s.name for s in shards) and not any("lora_" in s.name for s in shards.frozen)
        assert planner.rank_state(whole) == {"weights": 2 * total, "gradients": 2 * trainable,
                                             "masters": 4 * trainable, "optimizer_states": 2 * 4 * trainable}
    planner = Planner("llama", config, gpus=2, seq=16, global_batch=2, precision="bf16", device="cpu",
                      lora=LoraOptions(4))
    split = parse_layout("tp=2,zero=0,bf16,mb=1x2")
    planner.check(split)
    shards = planner.shards(split, 0, 1)
    held = {s.name: s for s in shards}
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert held[f"{q}.lora_B.default.weight"].shape == (32, 4) and held[f"{q}.lora_A.default.weight"].shape == (4, 64)
    assert held[f"{o}.lora_A.default.weight"].shape == (4, 32) and held[f"{o}.lora_B.default.weight"].shape == (64, 4)
    assert held[f"{q}.lora_A.default.weight"].tp_grad_sum == held[f"{o}.lora_B.default.weight"].tp_grad_sum == 256
    assert held[f"{q}.lora_B.default.weight"].tp_grad_sum == 0
    assert {s.name: s.shape for s in shards.frozen}[f"{q}.base_layer.weight"] == (32, 64)
    assert shards.frozen_inputs == 1
    full = Planner("llama", config, gpus=2, seq=16, global_batch=2, precision="bf16", device="cpu")
    act = 2 * 16 * 64 * 2                  # one [mb, seq, hidden] bf16 activation: the layers' f and g all-reduce it
    # the stage's traffic without a split sequence (no fake run needed: nothing fed the chunk)
    from meshboost.plan.traffic import rank_traffic
    (op_full, full_bytes), (op, lora_bytes) = (rank_traffic(p, split, p.shards(split, 0, 1), 2, True, True)["tp"][0]
                                               for p in (full, planner))
    assert op_full == op == "all_reduce" and full_bytes - lora_bytes == act
    with pytest.raises(NotImplementedError, match="zero=3"):
        planner.check(parse_layout("dp=2,zero=3,bf16,mb=1x1"))
