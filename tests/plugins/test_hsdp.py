"""HSDP: HybridParallelPlugin(zero_stage=3, dp_replicate_size=2), FSDP2 on the 2-D (replicate, shard)
mesh, against one process on the same global batch, in one spawn of 4:

* fp32 HSDP 2x2 (a tiny Llama with max_norm clipping), tp=2 x 2 replicas,
  and sp=2 (Ulysses) x 2 replicas (sharded over the cp ranks): each step's mean loss within 2e-5
  relative, every gradient (the averaged DTensor gathered, then tp) before the step, the clipped norm,
  and the weights after 2 AdamW steps within 1e-5; every parameter is a DTensor on the
  (dp_replicate, dp_shard) mesh, the shard group's pieces adding up to its tp-local shard, its AdamW moments alike,
  and both replica groups hold the same pieces;
* checkpoints: save_model -> from_pretrained bitwise; the model and optimizer load exactly into plain
  dp=4 ZeRO-3 and into ZeRO-1 (state for state); save_checkpoint / load_checkpoint into a fresh HSDP
  plugin resumes bitwise (the next step's loss and weights equal the uninterrupted run's);
* fp16 (dynamic loss scale): HSDP 2x2 trains like ZeRO-3 over dp=4 on the same weights and data.
The bad layouts (dp_replicate_size not dividing dp, ZeRO-1/2, cpu_offload, pp, ep) are rows of
tests/reliability/test_bad_inputs.py.
"""

import copy
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.fsdp import FSDPOptimizer
from meshboost.testing import LOSS_ATOL, spawn
from meshboost.testing.models import build_model, tiny_config, token_batches

LR, STEPS = 1e-3, 2
LLAMA = "LlamaForCausalLM"
CONTEXT = dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")


def _fresh(cls, config, seed=0):
    model = build_model(cls, copy.deepcopy(config), seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)


def _boost(cls, config, seed=0, **kwargs):
    plugin = HybridParallelPlugin(**{"tp_size": 1, "zero_stage": 3, **kwargs})
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(*_fresh(cls, config, seed))
    return plugin, booster, model, opt


def _whole(p, t):
    """The whole of `t` (parameter `p`'s weight or gradient): FSDP2's pieces gathered, then tp's."""
    t = t.detach()
    return gather_tensor(t.full_tensor() if isinstance(t, DTensor) else t, get_tp_info(p))


def _step(booster, plugin, model, opt, batch):
    """One step on this replica's rows; returns the mean loss over dp and the gradients before the step."""
    mine = {k: v.chunk(plugin.dp_size)[plugin.mesh.dp_rank] for k, v in batch.items()}
    loss = model(**mine).loss
    booster.backward(loss, opt)
    grads = {n: _whole(p, p.grad) for n, p in model.unwrap().named_parameters()}
    opt.step(), opt.zero_grad()
    t = loss.detach().float().reshape(1).clone()
    dist.all_reduce(t, group=plugin.dp_group)
    return t.item() / plugin.dp_size, grads


def _check_layout(model, opt, plugin, what):
    """DTensors on (dp_replicate, dp_shard): 1/dp_shard of the tp-local bytes here, the moments alike, and
    the same pieces in both replica groups."""
    replicate, shard = plugin.mesh.dims.shard_axes()
    for p in model.unwrap().parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp_replicate", "_".join(shard)), what
        local = p.to_local()
        total = torch.tensor([local.numel()])
        dist.all_reduce(total, group=plugin.mesh.group(*shard))
        assert total.item() == p.numel(), f"{what}: the shard group's pieces hold {total.item()} of {p.numel()}"
        assert all(opt.state[p][k].to_local().shape == local.shape for k in ("exp_avg", "exp_avg_sq")), what
        pieces = [torch.empty_like(local) for _ in range(plugin.mesh.size(*replicate))]
        dist.all_gather(pieces, local.contiguous(), group=plugin.mesh.group(*replicate))
        assert all(torch.equal(piece, pieces[0]) for piece in pieces), f"{what}: the replicas' pieces differ"


def _equivalence(rank, world):
    cases = (("hsdp 2x2 llama, clip", LLAMA, 0.05, {}),
             ("tp=2 x 2 replicas", LLAMA, 0.0, {"tp_size": 2}),
             ("sp=2 all_to_all x 2 replicas", LLAMA, 0.0, CONTEXT))
    for what, cls, max_norm, kwargs in cases:
        config = tiny_config("llama")
        batches = token_batches(config, STEPS)
        ref, ref_opt = _fresh(cls, config)
        plugin, booster, model, opt = _boost(cls, config, dp_replicate_size=2, max_norm=max_norm, **kwargs)
        assert isinstance(opt, FSDPOptimizer) and plugin.mesh.dims.dp_replicate == 2, what
        for step, batch in enumerate(batches):
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm else float("inf")).item()
            want = {n: p.grad.clone() for n, p in ref.named_parameters()}
            ref_opt.step(), ref_opt.zero_grad()
            loss, grads = _step(booster, plugin, model, opt, batch)
            assert abs(loss - ref_loss.item()) <= 2e-5 * abs(ref_loss.item()), f"{what} {step}: {loss} vs {ref_loss}"
            if max_norm:     # clip_grad_norm_ clipped `want` in place: compare the norm, then unclipped gradients
                assert norm > max_norm and abs(opt.get_grad_norm() - norm) <= 1e-5 * norm, f"{what}: norm {norm}"
                want = {n: g / min(1.0, max_norm / (norm + 1e-6)) for n, g in want.items()}
            for n, g in grads.items():
                torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-6, msg=f"{what} step {step}: grad {n}")
        for n, p in model.unwrap().named_parameters():
            torch.testing.assert_close(_whole(p, p), ref.get_parameter(n).detach(), rtol=0, atol=1e-5,
                                       msg=f"{what}: weight {n}")
        _check_layout(model, opt, plugin, what)
        if rank == 0:
            print(f"\n[{what}] mesh {plugin.mesh.fsdp_mesh()}: losses, gradients and weights match")


def _state(opt):
    """The optimizer's exported state (full tensors by parameter position: every rank joins the gathers)."""
    return {i: entry["per_element"] for i, entry in opt.state_dict()["state"].items()}


def _checkpoints(rank, world):
    import transformers

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    config = tiny_config("llama")
    first, second = token_batches(config, 2, seed=9)
    plugin, booster, model, opt = _boost(LLAMA, config, seed=3, dp_replicate_size=2)
    _step(booster, plugin, model, opt, first)
    saved = {n: _whole(p, p) for n, p in model.unwrap().named_parameters()}
    saved_state = _state(opt)
    booster.save_model(model, f"{folder}/model", shard=True, size_per_shard=0.01, use_safetensors=True)
    booster.save_optimizer(opt, f"{folder}/optim", shard=True)
    booster.save_checkpoint(f"{folder}/run", model, opt, step=1)
    if rank == 0:
        hf = transformers.LlamaForCausalLM.from_pretrained(f"{folder}/model")
        for name, p in hf.named_parameters():
            assert torch.equal(p.detach(), saved[name]), f"from_pretrained {name}"
    # HSDP -> plain dp: ZeRO-3 over dp=4, and ZeRO-1 over dp=4, load the same weights and moments exactly
    for layout in (dict(zero_stage=3), dict(zero_stage=1)):
        plugin2, booster2, model2, opt2 = _boost(LLAMA, config, seed=4, **layout)
        booster2.load_model(model2, f"{folder}/model")
        booster2.load_optimizer(opt2, f"{folder}/optim")
        for n, p in model2.unwrap().named_parameters():
            master = opt2.master_weight(p) if layout["zero_stage"] == 1 else p
            assert master is None or torch.equal(_whole(p, master), saved[n]), f"{layout}: load_model {n}"
        got = _state(opt2)
        assert got.keys() == saved_state.keys(), layout
        for i in got:
            for key, value in saved_state[i].items():
                assert torch.equal(got[i][key], value), f"{layout}: load_optimizer {i} {key}"
    # the uninterrupted run's next step, then a fresh HSDP plugin resumed from save_checkpoint: bitwise
    loss, _ = _step(booster, plugin, model, opt, second)
    after = {n: _whole(p, p) for n, p in model.unwrap().named_parameters()}
    plugin3, booster3, model3, opt3 = _boost(LLAMA, config, seed=5, dp_replicate_size=2)
    meta = booster3.load_checkpoint(f"{folder}/run", model3, opt3)
    assert meta["step"] == 1
    resumed, _ = _step(booster3, plugin3, model3, opt3, second)
    assert resumed == loss, f"resumed loss {resumed} vs {loss}"
    for n, p in model3.unwrap().named_parameters():
        assert torch.equal(_whole(p, p), after[n]), f"resume: {n}"


def _fp16(rank, world):
    """One fp16 step: HSDP 2x2 against ZeRO-3 over dp=4 (both reduce gradients in fp32)."""
    config = tiny_config("llama", num_hidden_layers=1)
    (batch,) = token_batches(config, 1, seed=7)
    results = {}
    for replicas in (2, 1):
        plugin, booster, model, opt = _boost(LLAMA, config, dp_replicate_size=replicas, precision="fp16",
                                             initial_scale=2**10)
        loss, _ = _step(booster, plugin, model, opt, batch)
        assert opt.get_loss_scale() == 2**10, "the fp16 step overflowed"
        results[replicas] = loss, {n: _whole(p, p) for n, p in model.unwrap().named_parameters()}
    (l2, w2), (l1, w1) = results[2], results[1]
    assert abs(l2 - l1) <= LOSS_ATOL[torch.float16], f"fp16 loss hsdp {l2} vs dp {l1}"
    init = dict(_fresh(LLAMA, config)[0].named_parameters())
    for name in w2:      # one AdamW step moves a weight by about LR: the two agree to 1% of it
        update2, update1 = w2[name] - init[name].detach(), w1[name] - init[name].detach()
        assert update2.abs().max() > 0.5 * LR, f"fp16 {name}: the step did not move it"
        torch.testing.assert_close(update2, update1, rtol=0, atol=1e-2 * LR, msg=f"fp16 update of {name}")


def _body(rank, world):
    import time
    for part in (_equivalence, _checkpoints, _fp16):
        start = time.perf_counter()
        part(rank, world)
        if rank == 0:
            print(f"[time] {part.__name__}: {time.perf_counter() - start:.1f} s")


def test_hsdp_2x2():
    spawn(_body, 4)
