"""Activation bytes saved for backward, measured on fake tensors of the real model.

Owns: running the model's own forward (transformers' code, the same class and config) under torch's
`FakeTensorMode` (no memory, no flops) with `torch.autograd.graph.saved_tensors_hooks` counting every
distinct saved view once, as `meshboost.optim.memory.saved_activation_bytes` does on real tensors,
except the parameters autograd saves (a linear's weight: counted as weights already); splitting the count into a per-layer part and the ends (embeddings, final norm, head, loss)
from a 1-layer and a 2-layer copy of the config; and the per-rank estimate for a layout: layers held
by the stage x micro-batches in flight (1F1B: min(pp - stage, microbatches)), tensor parallelism by
measuring a per-rank config (heads, key/value heads, intermediate size and vocabulary divided by tp,
head_dim kept) where the family's config allows it, else a documented approximation; under sequence
parallelism (split_gather) and context parallelism, the same forward with meshboost's own sequence
splits emulated shape for shape (emulate.py), and under expert parallelism meshboost's dispatch with
shape-only exchanges (fake_experts.py); the checkpointing mode (full, selective) and the chunked
loss applied as the runtime applies them (`enable_checkpointing`, `install_chunked_loss`). The same fake
run goes on through backward under
torch's MemTracker (live.py's `live_peak`): the bytes alive after the forward and after each op of
forward and backward (their maximum: the peak; with the gradients accumulated by each op on top: the
peak of a layout that holds them), which the peak model (peak.py) uses; for a pipeline stage that is
not the last, the base model's forward ended after its last layer (as the stage's is), its output's
gradient seeding the backward. Every instant's
bytes are affine in the micro-batch size, so each size's figures come from runs at 2 and 3 sequences
(`_extrapolated`): one set of fake runs per config, not per size. Must not touch the caller's model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
from dataclasses import dataclass

import torch

from meshboost.optim.precision import PRECISION_DTYPES as DTYPES     # the one precision table
from meshboost.plan import fakecache

SPLIT_GATHER = "split_gather"
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
INTERMEDIATE_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# config fields whose value above 1 makes layers differ by position (every n-th layer sparse, sliding, ...)
HETEROGENEOUS_STEPS = ("decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step", "sliding_window_pattern")


@dataclass(frozen=True)
class ActivationModel:
    """Saved bytes of one micro-batch: `per_layer` per decoder/encoder layer, `ends` for the rest."""

    per_layer: int
    ends: int
    exact_tp: bool          # the tp per-rank figure was measured (True) or approximated (False)
    summed_per_layer: int = 0   # split_gather: replicated elements per layer fed the chunk (grads summed over tp)
    # what a step really holds (peak.py): bytes alive once the forward returned its loss (each storage
    # once), and the peak alive over forward and backward (the kernels' temporaries: the loss's softmax
    # gradient, a layer's backward buffers), per layer and ends, as torch's MemTracker counts them
    live_per_layer: int = 0
    live_ends: int = 0
    peak_per_layer: int = 0
    peak_ends: int = 0
    # that peak with the gradients accumulated by each instant on top (a layout that keeps every working
    # gradient through the backward holds them: under checkpointing the last layer's recomputation then)
    grads_peak_per_layer: int = 0
    grads_peak_ends: int = 0
    # the same for a pipeline stage that is not the last (`body`, measured only for pp > 1): its layers
    # without final norm, head and loss, the output kept and its gradient seeding the backward; the ends
    # hold the embedding's, the output and its gradient and, at the peak, one layer's backward temporaries
    body_live_per_layer: int = 0
    body_live_ends: int = 0
    body_peak_per_layer: int = 0
    body_peak_ends: int = 0
    body_grads_peak_per_layer: int = 0
    body_grads_peak_ends: int = 0


@dataclass(frozen=True)
class SequenceSplit:
    """How a layout splits the sequence: `mode` "split_gather" over `size` = tp ranks (`roles`: the
    sharder's plan), or a context mode ("all_to_all", "ring_attn") over `size` = cp ranks."""

    mode: str
    size: int
    roles: object = None


def _layer_field(config) -> str:
    for name in LAYER_FIELDS:
        if isinstance(getattr(config, name, None), int):
            return name
    raise ValueError(f"{type(config).__name__} has none of {LAYER_FIELDS}: cannot count its layers")


def count_layers(config) -> int:
    return getattr(config, _layer_field(config))


def _saved_bytes(cls, config, batch: int, seq: int, dtype: torch.dtype, checkpointing: str | None,
                 split: SequenceSplit | None = None, vocab_tp: int = 1, body: bool = False,
                 ep: int = 1, loss_chunk: int | None = None) -> tuple[int, ...]:
    """(distinct bytes autograd saves in one training forward of `cls(config)` on fake tensors, the
    parameters (and views of them: a linear saves its weight) left out: they are the weights;
    split_gather's replicated elements fed the chunk; `live_peak`'s other four figures) for one rank of
    `split`'s sequence split. `body`: the base model alone (no head, no loss), its backward fed a
    gradient of its output, as a pipeline stage that is not the last runs it. `ep` > 1: the experts dealt
    out over ep ranks, meshboost's dispatch with balanced routing (fake_experts.py). `checkpointing`: the
    runtime's mode ("full", "selective", None) turned on as the plugin does (`enable_checkpointing`);
    `loss_chunk`: the sharder's chunked LM head and loss installed (`install_chunked_loss`; under tp on the
    rank's vocabulary shard, its two collectives' 3 x tokens fp32 left out)."""
    from meshboost.plan import emulate, fake_experts, lora
    from meshboost.plan.live import last_layer, live_peak
    from meshboost.shardformer import enable_checkpointing, uses_causal_lm_loss
    from meshboost.shardformer.selective import FULL
    from torch._subclasses.fake_tensor import FakeTensorMode

    weights: set = set()
    previous = torch.get_default_dtype()
    with FakeTensorMode(), fake_experts.fake_grouped_mm():
        torch.set_default_dtype(dtype)          # built in the working dtype (a fake tensor cannot be cast in place)
        try:
            model = lora.adapted_from_config(cls(config), config).train()     # LoRA: peft's adapters, base frozen
        finally:
            torch.set_default_dtype(previous)
        if ep > 1:
            fake_experts.install_expert_parallel(model, ep)
        weights.update(p.untyped_storage()._cdata for p in model.parameters())
        enable_checkpointing(model, FULL if checkpointing is True else checkpointing or None)   # bool: the old switch
        sequence = context = None
        if split is not None and split.mode == SPLIT_GATHER:
            sequence = emulate.install_sequence_split(model, split.roles)
        elif split is not None:
            context = emulate.install_context(model, split.size, split.mode)
        vocab = getattr(config, "vocab_size", 2)
        ids = torch.randint(0, vocab, (batch, seq))
        inputs = {"input_ids": ids}
        if "labels" in _forward_args(cls):
            num_labels = getattr(config, "num_labels", 2)
            inputs["labels"] = ids if _is_causal(cls) else torch.randint(0, num_labels, (batch,))
        if context is not None:                 # this rank's piece of every sequence, as the plugin cuts it
            inputs = context.shard(inputs)
        loss = contextlib.nullcontext()
        if loss_chunk is not None and not body:     # the sharder's order: after the vocabulary split
            loss = emulate.install_chunked_loss(model, loss_chunk)
        elif vocab_tp > 1 and uses_causal_lm_loss(model):   # the sharder's vocab-parallel loss, shape-only exchanges
            loss = emulate.install_vocab_parallel_loss(model, vocab_tp)
        if body:
            inputs.pop("labels", None)
        with loss:
            only = last_layer(model) if count_layers(config) == 1 else None       # marked (live.two_layers)
            saved, *live = live_peak(model.base_model if body else model, inputs, weights,
                                     last_layer(model) if body else None, only)
    return (saved, sum(sequence.summed.values()) if sequence is not None else 0, *live)




def _forward_args(cls) -> tuple[str, ...]:
    return tuple(inspect.signature(cls.forward).parameters)


def _is_causal(cls) -> bool:
    return cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _with_layers(config, layers: int):
    c = copy.deepcopy(config)
    setattr(c, _layer_field(c), layers)
    return c


def tp_rank_config(config, tp_size: int, padded_vocab: int | None):
    """The config whose whole model computes what one tp rank computes (heads, key/value heads and
    intermediate size / tp, head_dim kept, the vocabulary shard), or None where the family's config
    ties head_dim to the hidden size (GPT-2, BERT: no such config exists)."""
    if tp_size == 1:
        return config
    if not all(isinstance(getattr(config, f, None), int) for f in ("num_attention_heads", "intermediate_size")):
        return None
    if not hasattr(config, "head_dim"):
        return None
    c = copy.deepcopy(config)
    c.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    c.num_attention_heads = config.num_attention_heads // tp_size
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int):
        c.num_key_value_heads = max(1, kv // tp_size)
    for name in INTERMEDIATE_FIELDS:         # the MLP's, each expert's, the shared experts'
        if isinstance(getattr(config, name, None), int):
            setattr(c, name, getattr(config, name) // tp_size)
    if padded_vocab is not None:
        c.vocab_size = padded_vocab // tp_size
    return c


def _measured(cls, config_json: str, model_type: str, batch: int, seq: int, precision: str,
              checkpointing: str | None, split: SequenceSplit | None = None, vocab_tp: int = 1,
              body: bool = False, ep: int = 1, loss_chunk: int | None = None) -> tuple[int, ...]:
    """(per layer, ends, summed per layer, live per layer, live ends, peak per layer, peak ends, the peak
    with the gradients per layer and ends) for one micro-batch of `batch` sequences. `body`: the last six
    again, of a non-last pipeline stage."""
    whole = _measured_batch(cls, config_json, model_type, batch, seq, precision, checkpointing, split, vocab_tp,
                            False, ep, loss_chunk)
    if not body:
        return whole
    return whole + _measured_batch(cls, config_json, model_type, batch, seq, precision, checkpointing, split,
                                   vocab_tp, True, ep, loss_chunk)[3:]


@fakecache.derived
def _measured_batch(cls, config_json: str, model_type: str, batch: int, seq: int, precision: str,
                    checkpointing: str | None, split: SequenceSplit | None = None, vocab_tp: int = 1,
                    body: bool = False, ep: int = 1, loss_chunk: int | None = None) -> tuple[int, ...]:
    """`_measured` of one batch size, from a 1-layer and a 2-layer copy of the config."""
    one, two = (_extrapolated(cls, config_json, model_type, n, batch, seq, precision, checkpointing, split,
                              vocab_tp, body, ep, loss_chunk) for n in (1, 2))
    per_layer = tuple(b - a for a, b in zip(one, two))       # (saved, summed, live, peak, grads peak) per layer
    ends = tuple(2 * a - b for a, b in zip(one, two))
    return (per_layer[0], ends[0], per_layer[1], *(n for i in (2, 3, 4) for n in (per_layer[i], ends[i])))


def _extrapolated(cls, config_json: str, model_type: str, layers: int, batch: int, *rest) -> tuple[int, ...]:
    """`_saved_bytes` (saved, summed, live after the forward, peak, peak with the gradients accumulated
    by each instant on top) of a `layers`-layer copy at `batch` sequences, from the runs at 2 and 3:
    every tensor has the batch dimension or none, so the saved and live bytes at each instant (after
    each op, the same ops at every batch size) are affine in the batch (the gradients do not depend on
    it); the peak is the largest of those instants at `batch` (not an extrapolated peak: at one
    sequence the embedding's weight gradient can outweigh the loss's softmax gradient, at twelve the
    other way round). A model whose op sequence changes with the batch (a single sequence takes other
    paths: a few ops fewer) is run at `batch` itself."""
    if batch <= 3:
        saved, summed, after, timeline, grads = _layers_run(cls, config_json, model_type, layers, batch, *rest)
        return saved, summed, after, max(timeline, default=0), max(map(sum, zip(timeline, grads)), default=0)
    one, two = (_layers_run(cls, config_json, model_type, layers, b, *rest) for b in (2, 3))
    if len(one[3]) != len(two[3]):
        saved, summed, after, timeline, grads = _layers_run(cls, config_json, model_type, layers, batch, *rest)
        return saved, summed, after, max(timeline, default=0), max(map(sum, zip(timeline, grads)), default=0)
    k = batch - 2
    timeline = [a + k * (b - a) for a, b in zip(one[3], two[3])]
    return (*(a + k * (b - a) for a, b in zip(one[:3], two[:3])), max(timeline),
            max(map(sum, zip(timeline, one[4]))))


@fakecache.derived
def _layers_run(cls, config_json: str, model_type: str, layers: int, batch: int, seq: int, precision: str,
                checkpointing: str | None, split, vocab_tp: int, body: bool, ep: int,
                loss_chunk: int | None = None) -> tuple:
    """(saved, summed, live after the forward, timeline, gradients timeline) of a `layers`-layer copy:
    two layers alike (`_alike_layers`) from the marked one-layer run (live.two_layers: a fake run
    fewer, the costlier one), any other copy run; a pipeline stage's body reads the whole model's marked
    one-layer run too (`two_layers`' `whole`: a ranking makes it for the last stage anyway)."""
    from meshboost.plan.live import two_layers

    args = (seq, precision, checkpointing, split, vocab_tp, body, ep, loss_chunk)
    if layers == 2 and _alike_layers(config_json, split):
        saved, summed, after, totals, grads, marks = _run(cls, config_json, model_type, 1, batch, *args)
        whole = _run(cls, config_json, model_type, 1, batch, *args[:5], False, ep, loss_chunk)[5] if body else None
        if marks is not None and (not body or whole is not None and whole[-1] is not None):
            gathered = split is not None and split.mode == SPLIT_GATHER
            saved, after, totals, grads = two_layers(saved, after, totals, grads, marks, whole, gathered)
            return saved, 2 * summed, after, totals, grads      # split_gather's summed: each layer's own
    return _run(cls, config_json, model_type, layers, batch, *args)[:5]


def _alike_layers(config_json: str, split) -> bool:
    """Whether a copy's second layer runs the first's ops on tensors of the same shapes: not under LoRA
    (nothing before the first adapter needs a gradient: the first layer differs) or a config whose
    layers differ by kind (`layer_types`, dense layers among MoE ones, ...). split_gather's cut before
    the stack's first layer and gather after its last lie outside the marked layer (live.LayerMarks),
    and its replicated parameters fed the chunk are all the layers' (twice theirs with two)."""
    from meshboost.plan.lora import FIELD

    config = json.loads(config_json)
    if config.get(FIELD) or config.get("mlp_only_layers") or (config.get("first_k_dense_replace") or 0) > 0:
        return False
    if len(set(config.get("layer_types") or ())) > 1 or len(set(config.get("no_rope_layers") or ())) > 1:
        return False
    return all((config.get(name) or 1) <= 1 for name in HETEROGENEOUS_STEPS)


@fakecache.fake_run
def _run(cls, config_json: str, model_type: str, layers: int, batch: int, seq: int, precision: str,
         checkpointing: str | None, split, vocab_tp: int, body: bool, ep: int, loss_chunk: int | None = None) -> tuple:
    from transformers import AutoConfig

    config = _with_layers(AutoConfig.for_model(model_type, **json.loads(config_json)), layers)
    return _saved_bytes(cls, config, batch, seq, DTYPES[precision], checkpointing, split, vocab_tp, body, ep,
                        loss_chunk)


def _key(config) -> tuple[str, str]:
    d = config.to_dict()
    for k in ("model_type", "transformers_version", "architectures"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str), config.model_type


_DERIVED: dict = {}         # (id(config), kind, tp, padded vocabulary) -> (config, derived config, its _key)


def _derived_config(config, kind: str, tp_size: int, padded_vocab: int | None) -> tuple:
    """(the per-rank config (`kind` "rank": `tp_rank_config`, None where none exists) or the config with
    the padded vocabulary ("padded"), its `_key`), made once per config object: a ranking asks for
    them once per layout, and each is a deep copy and a JSON dump of the config."""
    memo = (id(config), kind, tp_size, padded_vocab)
    if memo not in _DERIVED or _DERIVED[memo][0] is not config:     # the config is kept: its id stays its own
        if kind == "rank":
            derived = tp_rank_config(config, tp_size, padded_vocab)
        else:
            derived = config
            if padded_vocab is not None:
                derived = copy.deepcopy(config)
                derived.vocab_size = padded_vocab
        if len(_DERIVED) >= 256:
            _DERIVED.clear()
        _DERIVED[memo] = (config, derived, None if derived is None else _key(derived))
    return _DERIVED[memo][1:]


def activation_model(cls, config, batch: int, seq: int, precision: str, tp_size: int = 1,
                     padded_vocab: int | None = None, checkpointing: str | None = None,
                     split: SequenceSplit | None = None, body: bool = False, ep: int = 1,
                     loss_chunk: int | None = None) -> ActivationModel:
    """Per-layer and end bytes saved for backward by one micro-batch of `batch` x `seq` on one tp rank
    (of one cp rank, under context parallelism: `split`); `body`: with a non-last pipeline stage's live
    and peak bytes too; `ep`: the experts over ep ranks, their tokens dispatched (balanced routing)."""
    rank_config, rank_key = _derived_config(config, "rank", tp_size, padded_vocab)
    if rank_config is not None:
        vocab_tp = tp_size if padded_vocab is not None else 1     # the head's logits stay split over tp
        per_layer, ends, summed, *live = _measured(cls, *rank_key, batch, seq, precision, checkpointing,
                                                   split, vocab_tp, body, ep, loss_chunk)
        return ActivationModel(per_layer, ends, True, summed, *live)
    # No per-rank config: assume the hidden-sized tensors stay whole on every rank (per layer its 2 norm
    # inputs and the residual path, about 4 x batch x seq x hidden, or all a checkpointed layer keeps,
    # its input; at the ends the final norm's and the head's inputs) and the rest divides by tp. Under
    # split_gather, what the emulated split saves less on the whole model is taken off that.
    context = split if split is not None and split.mode != SPLIT_GATHER else None
    # a vocab-parallel head: the padded vocabulary and the sharder's loss as the last tp rank runs it (its
    # padding masked in a copy of the logits); the logits' bytes divide by tp below
    vocab_tp = 1 if padded_vocab is None else tp_size
    config, key = _derived_config(config, "padded", tp_size, padded_vocab)
    per_layer, ends, _, *live = _measured(cls, *key, batch, seq, precision, checkpointing, context,
                                          vocab_tp, body, ep, loss_chunk)
    tokens = seq // context.size if context is not None else seq
    hidden = batch * tokens * config.hidden_size * DTYPES[precision].itemsize
    whole, whole_ends = min(4 * hidden, per_layer), min(2 * hidden, ends)
    per_layer_tp = whole + (per_layer - whole) // tp_size
    ends_tp = whole_ends + (ends - whole_ends) // tp_size
    summed = 0
    if split is not None and split.mode == SPLIT_GATHER:
        split_layer, split_ends, summed, *_ = _measured(cls, *key, batch, seq, precision, checkpointing,
                                                        split, vocab_tp, loss_chunk=loss_chunk)
        per_layer_tp -= per_layer - split_layer
        ends_tp -= ends - split_ends
    # the live and peak bytes scaled as the saved ones are (the same approximation); what the gradients
    # accumulated by each instant add to a peak (a layout keeping them) are gradient bytes: 1/tp of them
    scale = [per_layer_tp / max(per_layer, 1), ends_tp / max(ends, 1)] * 2
    if checkpointing:       # a peak is a layer's recomputation, whose tensors divide as a plain layer's saved ones
        plain, _, *_ = _measured(cls, *key, batch, seq, precision, None, context, vocab_tp, ep=ep,
                                 loss_chunk=loss_chunk)
        kept = min(4 * hidden, plain)
        scale[2:] = [(kept + (plain - kept) // tp_size) / max(plain, 1)] * 2
    scaled = []
    for group in range(0, len(live), 6):            # (live, peak, grads peak) x (per layer, ends), whole then body
        run = live[group:group + 6]
        figures = [int(n * f) for n, f in zip(run[:4], scale)]
        figures += [figures[2 + i] + max(0, run[4 + i] - run[2 + i]) // tp_size for i in (0, 1)]
        scaled += figures
    live = scaled
    return ActivationModel(per_layer_tp, ends_tp, False, summed, *live)


def stage_activation_bytes(model: ActivationModel, layers_held: int, first: bool, last: bool,
                           in_flight: int) -> int:
    """Bytes one pipeline stage holds at its peak: its layers' (and, on the last stage, the ends')
    saved tensors for each micro-batch in flight."""
    per_microbatch = layers_held * model.per_layer + (model.ends if last else 0)
    return per_microbatch * in_flight
