"""A frozen reference offloaded to host memory between uses (`boost_reference(..., offload=True)`, HostOffload) on
4 processes (fp32, tiny Llama), each layout against the same reference kept on the device, from the same weights:

- the log-probs of two uses in a row bitwise equal (`sequence_logprobs`, or a forward-only pipeline step under pp):
  tp2 x dp2, pp2 x dp2 (2 micro-batches), tp2 x ZeRO-3 dp2 (FSDP2 over tp shards), pp2 x ZeRO-3 dp2;
- between uses (after boost, after each use) every parameter's local storage on this rank (a tp shard, the
  stage's weights, FSDP2's padded shard) holds 0 bytes, and the host copies hold exactly the bytes the device
  reference's parameter storages hold (FSDP2's padding rows included): a storage the rule missed fails one, a
  host copy of the wrong size the other; the host copies are other storages than the parameters', and their
  bytes are the planner's `reference_host` for the rank (`plan(..., reference="offload")`; pp x ZeRO-3, which the
  planner refuses with a reference, aside);
- pp x ZeRO-3: a forward-only pipeline step leaves no unit gathered on any stage (every registered parameter is
  FSDP2's DTensor shard again; before the fix a stage that is not the last kept its root unit, the embeddings,
  gathered: fsdp/pipeline.py's `StepSharding.finish`).
One process group, the layouts looped inside."""

import copy

import torch
from torch.distributed.tensor import DTensor

from meshboost import Booster
from meshboost.pipeline.config import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.post_training import boost_reference, pair_batch, pipeline_sequence_logprobs, sequence_logprobs
from meshboost.post_training.reference import HostOffload
from meshboost.testing import spawn
from meshboost.testing.models import build_model

from tests.post_training.pairs import PAIRS, SEQ, preference_config, random_pairs, replica

MICRO = 2
LAYOUTS = [("tp2 dp2", dict(tp_size=2)),
           ("pp2 dp2", dict(pp_size=2, pipeline=PipelineConfig(num_microbatches=MICRO))),
           ("tp2 zero3 dp2", dict(tp_size=2, zero=ZeroConfig(stage=3))),
           ("pp2 zero3 dp2", dict(pp_size=2, zero=ZeroConfig(stage=3),
                                  pipeline=PipelineConfig(num_microbatches=MICRO)))]


def _storages(model) -> dict[int, int]:
    """{data_ptr: bytes} of the distinct storages under the parameters' local tensors now (0-byte ones by id)."""
    out = {}
    for p in model.parameters():
        s = (p.to_local() if isinstance(p, DTensor) else p.detach()).untyped_storage()
        out[s.data_ptr() or id(p)] = s.nbytes()
    return out


def _use(booster, ref, batch, pipelined: bool):
    with torch.no_grad():
        if pipelined:
            scored = pipeline_sequence_logprobs(booster, ref, batch, MICRO)
            return None if scored is None else torch.cat([s.sums for s in scored])
        return sequence_logprobs(ref, batch).sums


def _check_between_uses(what: str, ref, offload: HostOffload, device_bytes: int) -> None:
    held = {k: v for k, v in _storages(ref).items() if v}
    assert not held, f"{what}: parameter storages left on the device between uses: {held}"
    assert not offload.on_device and offload.host_bytes == device_bytes, (what, offload.host_bytes, device_bytes)
    params = {k for k in _storages(ref)}
    assert all(s.host.untyped_storage().data_ptr() not in params for s in offload.stored), what
    assert all(s.host.is_pinned() == (s.view.device.type == "cuda") for s in offload.stored), what


def _planned_host_bytes() -> dict:
    """{layout: {pp_rank: the planner's reference_host}} of LAYOUTS (the planner's layout strings)."""
    from meshboost.plan import plan

    out = {}
    for what, layout in (("tp2 dp2", "tp=2,zero=0"), ("pp2 dp2", f"pp=2,zero=0,microbatches={MICRO}"),
                         ("tp2 zero3 dp2", "tp=2,zero=3")):
        e = plan(preference_config(), layout=layout, gpus=4, seq=SEQ, global_batch=2 * PAIRS, precision="fp32",
                 device="cpu", reference="offload")
        out[what] = {s["pp_rank"]: s["memory_bytes"]["reference_host"] for s in e.per_stage}
    return out


def _body(rank, world_size, planned):
    config = preference_config()
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    for what, fields in LAYOUTS:
        booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(**fields)))
        mesh = booster.plugin.mesh
        pipelined = mesh.pp_size > 1
        on_device = boost_reference(booster, copy.deepcopy(whole))
        offloaded = boost_reference(booster, copy.deepcopy(whole), offload=True)
        offload = HostOffload.of(offloaded)
        assert offload is not None and HostOffload.of(on_device) is None, what
        device_bytes = sum(_storages(on_device).values())
        assert device_bytes > 0, what
        _check_between_uses(f"{what}, after boost", offloaded, offload, device_bytes)
        if what in planned:
            assert offload.host_bytes == planned[what][mesh.pp_rank], (what, offload.host_bytes, planned[what])
        for use in range(2):
            batch = pair_batch(replica(random_pairs(30 + use), mesh.dp_rank, mesh.dp_size),
                               microbatches=MICRO if pipelined else 1)
            want, got = _use(booster, on_device, batch, pipelined), _use(booster, offloaded, batch, pipelined)
            assert (want is None) == (got is None), what
            if want is not None:
                assert torch.equal(got, want), f"{what} use {use}: {got} != {want}"
            _check_between_uses(f"{what}, after use {use}", offloaded, offload, device_bytes)
            if pipelined and fields.get("zero") is not None:     # no unit left gathered by the step (ZeRO-3)
                gathered = [n for n, p in on_device.module.named_parameters() if not isinstance(p, DTensor)]
                assert not gathered, f"{what} pp_rank {mesh.pp_rank}: gathered after a forward-only step: {gathered}"
            assert sum(_storages(on_device.unwrap()).values()) == device_bytes, what


def test_reference_host_offload():
    spawn(_body, 4, _planned_host_bytes())
