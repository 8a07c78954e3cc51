"""LowLevelZeroPlugin (ZeRO data parallelism, no model parallelism) against single-process fp32
AdamW on the combined batch at dp=2: stage 1 fp16, stage 1 fp32 and stage 2 fp32 (with clipping) over
10 steps, each resident and with cpu_offload=True, the offloaded run equal to the resident one bit for
bit (losses and final weights) with masters and states on the CPU and one gradient shard down and one
updated shard up per bucket and step; an offloaded fp16 save_model/save_optimizer round trip; a model
boosted on meta with offload (masters on the CPU while the weights have no device) and loaded;
communication_dtype, master_weights=False and cast_inputs; no_sync accumulation in stage 1 and its
error in stage 2; every ColossalAI keyword accepted, the unsupported ones refused with the alternative.
The optimizer is the same ZeroOptimizer HybridParallelPlugin uses."""

import copy
import inspect
import os

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.optim import ZeroOptimizer
from meshboost.booster.plugin import LowLevelZeroPlugin
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import train_reference
from meshboost.testing.models import build_model, tiny_config, token_batches

STEPS = 10
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# ColossalAI's LowLevelZeroPlugin.__init__ keywords (colossalai/booster/plugin/low_level_zero_plugin.py)
COLOSSALAI_KEYWORDS = (
    "stage", "precision", "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval",
    "hysteresis", "max_scale", "max_norm", "norm_type", "reduce_bucket_size_in_m", "communication_dtype",
    "overlap_communication", "overlap_allgather", "cpu_offload", "master_weights", "verbose", "cast_inputs",
    "fp8_communication", "use_fp8", "extra_dp_size")
REFUSED = [  # (keywords, exception, message fragment naming the way out)
    (dict(overlap_allgather=True), NotImplementedError, "overlap_communication=True overlaps"),
    (dict(use_fp8=True), NotImplementedError, "precision='bf16'"),
    (dict(fp8_communication=True), NotImplementedError, "communication_dtype=torch.bfloat16"),
    (dict(extra_dp_size=2), NotImplementedError, "Use extra_dp_size=1"),
    (dict(extra_dp_size=0), ValueError, "extra_dp_size=0 must be a positive integer"),
    (dict(communication_dtype=torch.int8), ValueError, "communication_dtype=torch.int8"),
    (dict(stage=3), ValueError, "stage=3"),
    (dict(precision="fp8"), ValueError, "precision='fp8'"),
]


def _model_and_optimizer(config, device=None):
    with torch.device(device or "cpu"):
        model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)


def _train(booster, model, opt, batches, rank, world):
    """Train on this rank's half of each batch; the dp-mean loss and the norm of every step."""
    opt.track_grad_norm = True          # without clipping the step computes the norm only when asked
    losses, norms = [], []
    for b in batches:
        loss = model(**{k: v.chunk(world)[rank] for k, v in b.items()}).loss
        booster.backward(loss, opt)
        opt.step(), opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        norms.append(opt.get_grad_norm())
    return losses, norms


def _check_offloaded(opt, steps_taken, msg):
    """Masters and states on the CPU; one copy of this rank's shard each way per bucket and step
    (steps_taken None: placement only)."""
    assert opt.cpu_offload and opt.staging is not None, msg
    masters = [m for g in opt.param_groups for m in g["params"]]
    assert all(m.device.type == "cpu" for m in masters), f"{msg}: a master is not on the CPU"
    states = [v for m in masters for v in opt.optim.state[m].values() if torch.is_tensor(v)]
    assert states and all(s.device.type == "cpu" for s in states), f"{msg}: a state is not on the CPU"
    if steps_taken is None:
        return
    shard_bytes = sum(b.shard_size for b in opt.buckets) * DTYPES[opt.precision].itemsize
    assert opt.staging.copies_to_host == opt.staging.copies_to_device == steps_taken * len(opt.buckets), msg
    assert opt.staging.bytes_to_host == opt.staging.bytes_to_device == steps_taken * shard_bytes, msg


def _assert_same_weights(a, b, msg):
    for (name, p), q in zip(a.unwrap().named_parameters(), b.unwrap().parameters()):
        assert torch.equal(p, q), f"{msg}: {name}"


def _body(rank, world, root):
    config = tiny_config("llama")
    batches = token_batches(config, STEPS, batch=8)
    runs = {}
    for stage, precision, max_norm in ((1, "fp16", 0.0), (1, "fp32", 0.0), (2, "fp32", 0.5)):
        ref = train_reference(*_model_and_optimizer(config), batches, max_norm)
        ref_losses, ref_norms = ref.losses, ref.norms
        for offload in (False, True):
            msg = f"stage {stage} {precision} cpu_offload={offload}"
            booster = Booster(plugin=LowLevelZeroPlugin(stage=stage, precision=precision, max_norm=max_norm,
                                                        cpu_offload=offload))
            model, opt, *_ = booster.boost(*_model_and_optimizer(config))
            assert isinstance(opt, ZeroOptimizer) and opt.stage == stage
            losses, norms = _train(booster, model, opt, batches, rank, world)
            for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
                assert abs(loss - ref_loss) <= LOSS_ATOL[DTYPES[precision]], f"{msg} step {step}: {loss} vs {ref_loss}"
            if precision == "fp32":
                for norm, ref_norm in zip(norms, ref_norms):
                    assert abs(norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), msg
                ref_params = dict(ref.model.named_parameters())
                for name, p in model.unwrap().named_parameters():
                    assert_close(p.detach(), ref_params[name].detach(), msg=f"{msg} {name}", scale=3)
            runs[stage, precision, offload] = booster, model, opt, losses, norms
        # Offloading moves where the step runs, not what it computes: the same numbers, bit for bit.
        resident, offloaded = runs[stage, precision, False], runs[stage, precision, True]
        assert offloaded[3] == resident[3], f"stage {stage} {precision}: offloaded losses differ"
        _assert_same_weights(resident[1], offloaded[1], f"stage {stage} {precision} offloaded")
        taken = sum(n is not None for n in offloaded[4])          # fp16 skips copy nothing
        _check_offloaded(offloaded[2], taken, f"stage {stage} {precision}")

    # Offloaded fp16 checkpoint round trip: masters, moments and the loss scaler come back (on the CPU).
    booster, model, opt, *_ = runs[1, "fp16", True]
    folder = os.path.join(root, "fp16_offload")
    booster.save_model(model, os.path.join(folder, "model"), shard=True)
    booster.save_optimizer(opt, os.path.join(folder, "optim"), shard=True)
    again = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp16", cpu_offload=True))
    model2, opt2, *_ = again.boost(*_model_and_optimizer(config))
    again.load_model(model2, os.path.join(folder, "model"))
    again.load_optimizer(opt2, os.path.join(folder, "optim"))
    saved, loaded = opt.state_dict(), opt2.state_dict()
    assert saved["loss_scaler"] == loaded["loss_scaler"]
    for key, entry in saved["state"].items():
        for k, v in entry["per_element"].items():
            assert torch.equal(v, loaded["state"][key]["per_element"][k]), f"round trip {key} {k}"
        assert torch.equal(entry["master"], loaded["state"][key]["master"]), f"round trip {key} master"
    _check_offloaded(opt2, None, "loaded")
    extra = batches[:2]
    assert _train(booster, model, opt, extra, rank, world) == _train(again, model2, opt2, extra, rank, world)
    _assert_same_weights(model, model2, "after the round trip")

    # Boosted on meta with offload: the masters are on the CPU while the weights have no device yet;
    # load_model materialises the weights and fills the masters, and training is the resident run's.
    if rank == 0:
        _model_and_optimizer(config)[0].save_pretrained(os.path.join(root, "init"))
    dist.barrier()
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=0.5, cpu_offload=True))
    model, opt, *_ = booster.boost(*_model_and_optimizer(config, "meta"))
    assert all(p.is_meta for p in model.unwrap().parameters())
    assert all(m.device.type == "cpu" for g in opt.param_groups for m in g["params"])
    booster.load_model(model, os.path.join(root, "init"))
    losses, _ = _train(booster, model, opt, batches, rank, world)
    assert losses == runs[2, "fp32", False][3]
    _assert_same_weights(runs[2, "fp32", False][1], model, "boosted on meta")
    _check_offloaded(opt, STEPS, "boosted on meta")

    # communication_dtype (bf16 reduce-scatter of fp32 gradients) and master_weights=False (the inner
    # optimizer steps bf16 shards): a few steps within bf16's tolerance of the fp32 reference.
    ref_losses = train_reference(*_model_and_optimizer(config), batches[:3]).losses
    for kwargs, dtype in ((dict(stage=2, precision="fp32", communication_dtype=torch.bfloat16), torch.float32),
                          (dict(stage=1, precision="bf16", master_weights=False, cpu_offload=True), torch.bfloat16)):
        booster = Booster(plugin=LowLevelZeroPlugin(**kwargs))
        model, opt, *_ = booster.boost(*_model_and_optimizer(config))
        losses, _ = _train(booster, model, opt, batches[:3], rank, world)
        for loss, ref_loss in zip(losses, ref_losses):
            assert abs(loss - ref_loss) <= LOSS_ATOL[torch.bfloat16], f"{kwargs}: {losses} vs {ref_losses}"
        assert all(m.dtype == dtype for g in opt.param_groups for m in g["params"]), kwargs

    # cast_inputs: fp32 features reach an fp16 model cast (ColossalAI's default), or untouched
    for cast in (True, False):
        booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp16", cast_inputs=cast))
        model, opt, *_ = booster.boost(*_model_and_optimizer(config))
        embeds = torch.randn(2, 4, config.hidden_size)
        if cast:
            assert model(inputs_embeds=embeds).logits.dtype == torch.float16
        else:
            with pytest.raises(RuntimeError):
                model(inputs_embeds=embeds)

    # no_sync: stage 1 accumulates two micro-steps locally == one combined-batch step
    ref = train_reference(*_model_and_optimizer(config), batches[:1]).model
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32"))
    model, opt, *_ = booster.boost(*_model_and_optimizer(config))
    first, second = [{k: v.chunk(world)[rank].chunk(2)[i] for k, v in batches[0].items()} for i in range(2)]
    with booster.no_sync(model, opt):
        booster.backward(model(**first).loss / 2, opt)
    booster.backward(model(**second).loss / 2, opt)
    opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in model.unwrap().named_parameters():
        assert_close(p.detach(), ref_params[name].detach(), msg=f"no_sync {name}", scale=3)

    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    model, opt, *_ = booster.boost(*_model_and_optimizer(config))
    with pytest.raises(RuntimeError, match="ZeRO stage 2"):
        booster.no_sync(model, opt)

    # Every ColossalAI keyword, at its ColossalAI default where meshboost can honour it
    LowLevelZeroPlugin(stage=1, precision="fp16", initial_scale=2**32, min_scale=1, growth_factor=2, backoff_factor=0.5,
                       growth_interval=1000, hysteresis=2, max_scale=2**32, max_norm=0.0, norm_type=2.0,
                       reduce_bucket_size_in_m=12, communication_dtype=None, overlap_communication=True,
                       overlap_allgather=False, cpu_offload=False, master_weights=True, verbose=False,
                       cast_inputs=True, fp8_communication=False, use_fp8=False, extra_dp_size=1)
    for kwargs, error, fragment in REFUSED:
        with pytest.raises(error, match=fragment.replace("(", r"\(").replace(".", r"\.")):
            LowLevelZeroPlugin(**kwargs)


def test_low_level_zero_dp2(tmp_path):
    spawn(_body, 2, str(tmp_path))


def test_every_colossalai_keyword_is_in_the_signature():
    params = inspect.signature(LowLevelZeroPlugin.__init__).parameters
    assert [k for k in COLOSSALAI_KEYWORDS if k not in params] == []
    # ColossalAI's order, so positional calls mean the same
    assert [k for k in params if k in COLOSSALAI_KEYWORDS] == list(COLOSSALAI_KEYWORDS)
