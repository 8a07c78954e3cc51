"""The planner's row for a frozen reference model (preference training, `meshboost.post_training`): what the
reference holds on each rank, and the instant its forward runs.

Owns `reference_state` (one rank's reference bytes as `boost_reference` leaves them. The policy's plugin
shards it as it shards the policy (tp, pp, ep); with no optimizer and nothing trainable there is no
gradient, master, optimizer state, ZeRO bucket or DDP reducer. Zero 0-2: its weights in the working dtype
(`model.to(dtype)`). Zero 3: FSDP2 shards it over dp like the policy, fp32 shards (the masters' dtype,
though nothing steps them) with their padding rows, and its root unit (embeddings, final norm, head) stays
gathered in the compute dtype after its first no-grad forward: FSDP2 does not reshard the root after a
forward, and no backward comes to. Under pp every unit stays gathered to the end of the forward-only step,
which reshards them all, the roots of the stages that are not the last too), `forward_peak`
(the bytes its no-grad eval forward and the label log-probs add at their peak, from a fake run of the tp
rank's config: logits, their fp32 read, the vocab-parallel cross-entropy's temporaries), `with_reference`
(a rank's peak record with the reference: its `held` bytes at every instant of the policy's step, and the
instant `reference` before them: the policy's state kept between steps, the reference, its forward's peak
and what it gathers under zero 3, a pipeline's queued sends), and the planner's hooks `with_row`,
`rank_peak` and `notes` (no-ops without a reference). With LoRA the reference is the policy's base through
peft's `disable_adapter()`: 0 bytes of its own, its forward still counted. Offloaded (`reference="offload"`,
`boost_reference(..., offload=True)`): between uses its parameter storages live in host memory (`host`:
the weights and FSDP2's padding; on a CPU the host is the device, so they count there), so the policy's
instants carry none of it; the row is what its forward holds on the device (`loaded`: the weights, the
padding, and under zero 3 what its forward gathers at most) and the instant `reference` has it beside the
policy's state; `copy_seconds`: one host-to-device copy of `host` per step at `host_bytes_s` (nothing
overlapped, nothing copied back: frozen). Not modelled: pp x zero 3 (`check_layout` refuses it). Must not
allocate: fake tensors only.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

from meshboost.optim.precision import PRECISION_BYTES as BYTES
from meshboost.optim.precision import PRECISION_DTYPES as DTYPES

ON_DEVICE = "device"         # the reference's weights stay on the device between uses
OFFLOAD = "offload"          # in host memory between uses, on the device for its forward only
CHOICES = (ON_DEVICE, OFFLOAD)


def check_option(reference) -> str | None:
    """The planner's `reference` keyword as a mode (None: no reference), refused with the choices."""
    if reference is None or reference is False:
        return None
    if reference is True:
        return ON_DEVICE
    if reference not in CHOICES:
        raise ValueError(f"reference={reference!r}: pass True (a frozen reference on the policy's mesh, "
                         f"boost_reference) or one of {CHOICES}; leave it out for no reference")
    return reference


def reference_state(planner, layout, pp_rank: int, tp_rank: int, dp_rank: int) -> dict:
    """{weights, padding, gathered, held, loaded, host, shared} bytes of the reference on one rank: `weights`
    what `memory_breakdown(reference)` counts (the parameters' own bytes), `padding` FSDP2's spare rows,
    `gathered` its root unit kept gathered after a forward (zero 3 without pp), `held` the device bytes through
    the policy's step (on the device: their sum; offloaded: 0, or `host` on a CPU), `loaded` what an offloaded
    reference brings to the device for its forward (else 0: in `held`), `host` its host copy (offloaded);
    `shared`: LoRA, the reference is the policy's base (all 0)."""
    from meshboost.plan import sharded

    if planner.lora is not None:
        return {"weights": 0, "padding": 0, "gathered": 0, "held": 0, "loaded": 0, "host": 0, "shared": True}
    shards = planner.shards(layout, pp_rank, tp_rank)
    every = [*shards, *getattr(shards, "frozen", ())]
    padding = gathered = 0
    if layout.zero == 3:
        groups = sharded.fsdp_groups(layout, every, dp_rank)
        weights = sum(sharded.SHARD_BYTES * sharded.fsdp_local_numel(s, n, i) for g, n, i in groups for s in g)
        padding = sum(sharded.SHARD_BYTES * (sharded.fsdp_padded_numel(s, n) - sharded.fsdp_local_numel(s, n, i))
                      for g, n, i in groups for s in g)
        root = {id(s) for s in sharded.fsdp_units(every, planner.layer_prefixes)[0]}
        if layout.pp == 1:           # under pp the forward-only step ends by resharding every unit
            gathered = _gathered_bytes(layout, groups, root)
    else:
        weights = BYTES[layout.precision] * sum(s.numel for s in every)
    out = {"weights": int(weights), "padding": int(padding), "gathered": int(gathered), "shared": False}
    resident = int(weights + padding + gathered)
    if planner.reference != OFFLOAD:
        return {**out, "held": resident, "loaded": 0, "host": 0}
    host = int(weights + padding)
    return {**out, "held": host if planner.device == "cpu" else 0, "loaded": resident, "host": host}


def _gathered_bytes(layout, groups, only: set | None = None) -> int:
    """Zero 3: bytes of the shards of `groups` (those whose id is in `only`) gathered in the compute dtype."""
    from meshboost.plan import sharded

    return BYTES[layout.precision] * sum(sharded.fsdp_padded_numel(s, n) * n for g, n, _ in groups for s in g
                                         if only is None or id(s) in only)


def _forward_gather(planner, layout, pp_rank: int, tp_rank: int, dp_rank: int) -> int:
    """Zero 3: the gathered bytes beside the reference's layers while they run, on top of `held`: without
    pp, the largest transformer layer (one at a time, forward_prefetch off; the root is in `held`); under
    pp, every unit of the stage (reshard_after_forward is off there: each stays gathered to the step's end,
    which reshards them all; still under what MemTracker measures, so `check_layout` refuses pp x zero 3)."""
    from meshboost.plan import sharded

    if layout.zero != 3:
        return 0
    shards = planner.shards(layout, pp_rank, tp_rank)
    every = [*shards, *getattr(shards, "frozen", ())]
    groups = sharded.fsdp_groups(layout, every, dp_rank)
    if layout.pp > 1:               # every unit
        return _gathered_bytes(layout, groups)
    layers = sharded.fsdp_units(every, planner.layer_prefixes)[1:]
    return max((_gathered_bytes(layout, groups, {id(s) for s in u}) for u in layers), default=0)


def forward_peak(planner, layout, pp_rank: int, layer_gather: int = 0, head_gather: int = 0) -> int:
    """The bytes the reference's no-grad eval forward of one micro-batch and its label log-probs hold at
    their peak on pipeline rank `pp_rank` (the last: the head's logits shard, read in fp32, and the
    vocab-parallel cross-entropy's temporaries; another stage: its layers' output), from a fake run of
    a 2-layer copy of the tp rank's config (under no grad nothing is saved: a layer's temporaries do not
    add up over layers). Sequence splits (cp, split_gather) and ep are not emulated: the whole sequences
    and every expert, an upper bound of those layouts' layers (in eval, cp gathers whole sequences
    before the head anyway). `layer_gather`, `head_gather`: bytes alive beside the layers, and beside the
    rest (zero 3's gathered units)."""
    from meshboost.plan.activations import _derived_config

    vocab, padded = getattr(planner.config, "vocab_size", None), None
    if isinstance(vocab, int) and layout.tp > 1:
        multiple = planner.vocab_multiple * layout.tp
        padded = -(-vocab // multiple) * multiple
    config, key = _derived_config(planner.config, "rank", layout.tp, padded)
    vocab_tp = layout.tp if padded is not None and planner.vocab_parallel_loss else 1
    if config is None:               # no per-rank config (GPT-2, BERT under tp): the whole model's, an upper bound
        config, key = _derived_config(planner.config, "rank", 1, None)
        vocab_tp = 1
    body = layout.pp > 1 and pp_rank < layout.pp - 1
    layers, head = _forward_run(planner.cls, *key, layout.microbatch_size, planner.seq, layout.precision,
                                vocab_tp, body, isinstance(vocab, int) and planner.lm_head, vocab or 0)
    return max(layers + layer_gather, head + head_gather)


@lru_cache(maxsize=256)
def _forward_run(cls, config_json: str, model_type: str, batch: int, seq: int, precision: str, vocab_tp: int,
                 body: bool, logprobs: bool, vocab: int) -> tuple[int, int]:
    """(the peak of live bytes, parameters and buffers left out, while the layers run; after the last
    layer: the final norm, the head, the log-probs) of one no-grad eval forward on fake tensors."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig

    from meshboost.plan import emulate, fake_experts
    from meshboost.plan.activations import _with_layers, count_layers
    from meshboost.plan.live import LiveBytes, last_layer

    config = AutoConfig.for_model(model_type, **json.loads(config_json))
    config = _with_layers(config, min(2, count_layers(config)))
    previous = torch.get_default_dtype()
    with FakeTensorMode(), fake_experts.fake_grouped_mm():
        torch.set_default_dtype(DTYPES[precision])
        try:
            model = cls(config).eval()
        finally:
            torch.set_default_dtype(previous)
        ids = torch.randint(0, max(vocab, 2), (batch, seq))
        loss = contextlib.nullcontext()
        if vocab_tp > 1:        # the vocab-parallel cross-entropy, its exchanges shape-only (the last tp rank's)
            loss = emulate.install_vocab_parallel_loss(model, vocab_tp)
        tracker = LiveBytes([*model.parameters(), *model.buffers()])
        ends: list[int] = []
        hook = last_layer(model).register_forward_hook(lambda *args: ends.append(len(tracker.totals)))
        try:
            with loss, tracker, torch.no_grad():
                if body:
                    model.base_model(input_ids=ids, use_cache=False)
                elif logprobs:
                    _label_logprobs(model, ids, vocab_tp, vocab)
                else:
                    model(input_ids=ids)
        finally:
            hook.remove()
    cut = ends[0] if ends else len(tracker.totals)
    return max(tracker.totals[:cut], default=0), max(tracker.totals[cut:], default=0)


def _label_logprobs(model, ids, vocab_tp: int, vocab: int) -> None:
    """post_training's label log-probs of `ids` (labels = ids), as `token_logprobs` computes them."""
    from meshboost.post_training.logprobs import label_logprobs, shifted_labels

    class Head:                  # what label_logprobs reads of a vocab-parallel head
        process_group, vocab_size = None, vocab

    logits = model(input_ids=ids, use_cache=False).logits
    label_logprobs(logits, shifted_labels(ids), Head(), vocab_tp > 1)


def with_reference(planner, layout, pp_rank: int, tp_rank: int, dp_rank: int, mem: dict, predicted: dict) -> dict:
    """`predicted` (peak.rank_peak's record of the rank whose state is `mem`) with the reference: its
    `held` bytes added to every instant of the policy's step, and the instant `reference` (the step's
    first: the policy's weights, masters, optimizer states and resident buffers, kept between steps; the
    reference's bytes (offloaded: those it brings in, `loaded`) and its forward's peak; zero 3: what its forward
    gathers, `_forward_gather`)."""
    from meshboost.plan import peak
    from meshboost.plan.memory import resident_buffers

    state = reference_state(planner, layout, pp_rank, tp_rank, dp_rank)
    instants = {k: v + state["held"] for k, v in predicted["instants"].items()}
    kept = mem["weights"] + mem["masters"] + mem["optimizer_states"]
    if layout.cpu_offload and planner.device == "cpu":      # on a CPU the host is the device
        kept += mem.get("host", 0)
    kept += resident_buffers(mem["buffers"], layout.zero, layout.pp)
    gather = _forward_gather(planner, layout, pp_rank, tp_rank, dp_rank) if not state["shared"] else 0
    if layout.pp > 1 and pp_rank < layout.pp - 1:   # the forward-only step waits for its sends at its end
        kept += layout.microbatches * peak.boundary_bytes(planner, layout)
    instants["reference"] = kept + state["held"] + state["loaded"] + forward_peak(
        planner, layout, pp_rank, gather, gather if layout.pp > 1 else 0)
    return peak.finish(instants, planner.device)


def with_row(planner, mem: dict, layout, pp_rank: int, tp_rank: int, dp_rank: int, host=None) -> tuple[dict, dict]:
    """(`mem` (a rank's state by kind) with the row `reference` when the planner has one, the host bytes outside
    the device total: {"host": `host`} (cpu_offload's) where given, "reference_host" (the offloaded reference's
    copy)). The row: the reference's device bytes at their largest, `held` on the device, offloaded what its
    forward holds there (`loaded` and what it gathers, beside `held`)."""
    outside = {"host": host} if host is not None else {}
    if planner.reference is None:
        return mem, outside
    check_layout(layout)
    state = reference_state(planner, layout, pp_rank, tp_rank, dp_rank)
    row = state["held"]
    if planner.reference == OFFLOAD and not state["shared"]:
        row += state["loaded"] + _forward_gather(planner, layout, pp_rank, tp_rank, dp_rank)
        outside["reference_host"] = state["host"]
    return {**mem, "reference": row}, outside


def copy_seconds(planner, memory: dict, breakdown: dict | None = None) -> float:
    """Seconds an offloaded reference's copies add to a step (`memory`: a rank's, with_row's `reference_host`):
    one host-to-device copy of its host bytes per use, one use per step (KTO's two passes copy twice), at the
    cost constants' `host_bytes_s`, nothing overlapped; the breakdown's `reference_copies`."""
    seconds = memory.get("reference_host", 0) / planner.constants.host_bytes_s
    if breakdown is not None and planner.reference == OFFLOAD:
        breakdown["reference_copies"] = seconds
    return seconds


def check_layout(layout) -> None:
    """Refuse the layouts whose reference the planner does not predict yet (a refusal: the ranking skips them)."""
    if layout.zero == 3 and layout.pp > 1:
        raise NotImplementedError(
            f"a reference model at pp_size={layout.pp} x zero_stage=3 is not modelled yet: its forward-only pipeline "
            "step under FSDP2 holds more than the planner counts (MemTracker measured its instant 3-4% (bf16) and "
            "4-11% (fp32) above the prediction at one micro-batch, 8-17% at 3, benchmarks/plan_reference.py); plan "
            "it with zero_stage 0-2 or pp_size=1")


def rank_peak(planner, layout, pp_rank: int, tp_rank: int, shards, dp_rank: int, mem: dict) -> dict:
    """peak.rank_peak's record of the rank, `with_reference` when the planner has a reference."""
    from meshboost.plan import peak

    predicted = peak.rank_peak(planner, layout, pp_rank, shards, dp_rank, mem)
    if planner.reference is None:
        return predicted
    return with_reference(planner, layout, pp_rank, tp_rank, dp_rank, mem, predicted)


def notes(planner, layout) -> list[str]:
    """What the reference's row reads of `layout`, for the estimate's notes (none without a reference)."""
    if planner.reference is None:
        return []
    if planner.lora is not None:
        out = ["reference: the policy's base through peft's disable_adapter() (LoRA): 0 bytes of its own, no "
               "second copy; its no-grad forward counted at the instant 'reference'"]
    else:
        held = ("FSDP2 fp32 shards over dp, its root unit kept gathered after its forward" if layout.zero == 3
                else f"its weights in {layout.precision}")
        if planner.reference == OFFLOAD:
            held = (f"{held.split(',')[0]}, in host memory between uses (reference_host); the row is what its "
                    "forward holds on the device, the step's time has their host-to-device copy (reference_copies)")
        out = [f"reference: a frozen copy boosted like the policy (boost_reference), no gradient, optimizer state "
               f"or reduction buffer: {held}"]
    if layout.cp > 1 or layout.sequence_parallel and layout.tp > 1 or layout.ep > 1:
        out.append("reference forward: predicted on whole sequences with every expert (no sequence split or expert "
                   "parallelism emulated): an upper bound")
    return out
