"""Dropout random streams under tensor parallelism: per tp rank inside the split regions, shared elsewhere.

Owns: `install_tp_rank_rng`, the hooks that move a rank onto its own random stream where it holds
only its slice of the features (from a column-parallel linear's split output to the row-parallel
linear that consumes it: attention probabilities on this rank's heads, T5's DenseReluDense dropout)
and back onto the shared stream (identical on every tp rank) before that row-parallel linear, so
the dropouts of the replicated regions (embeddings, residual and hidden dropouts) draw the same
masks on every rank; and `TPRankRNG`, the small per-model object whose `enter` / `leave` / `hold`
sequence parallelism uses to keep the per-rank stream over a whole layer stack. Must not fork a
HuggingFace forward or know a model family: it hooks meshboost's parallel linears (in transformers 5
attention dropout is functional, inside the attention interface, so there is no module to hook).

How the per-rank stream is made: entering draws one number from the default CPU generator, which
every tp rank holds in the same state, mixes in the tp rank, and seeds the CPU generator (and the
accelerator's, when the activations live on one) with it, after saving their states; leaving
restores them. The draw costs a few microseconds on the host and never syncs a device.

Activation checkpointing replays the masks, because the stream a rank is on is written in its
generator state: every per-rank seed carries a tag in its top bits (region or held), and
`torch.utils.checkpoint` restores the CPU and device generator states (seed included) before it
recomputes. A recompute that starts on the shared stream draws the same number again, so reseeds
the same way; one that starts on a held stream (a sequence-parallel stack whose first-layer hook,
outside the checkpoint, entered it) sees the tag and neither re-enters nor leaves, just as the
forward did. No flag that a recompute could not see decides anything.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.distributed.generators import device_generators
from meshboost.shardformer.layers import ColumnParallelLinear, ColumnSubsetLinear, RowParallelLinear

_ENTROPY_BITS = 40          # random bits per per-rank seed (the CPU generator uses the low 32 of a seed)
_ENTROPY_MASK = (1 << _ENTROPY_BITS) - 1
_REGION_TAG = 0x6D6272      # top bits of a seed: this rank's stream, left at the next row-parallel linear
_HELD_TAG = 0x6D6268        # ... this rank's stream, kept until released (sequence parallelism)
_RANK_STEP = 0x9E3779B97F   # odd: distinct tp ranks get distinct seeds, also in the low 32 bits
REGION, HELD = "region", "held"


def _stream_of(seed: int) -> str | None:
    return {_REGION_TAG: REGION, _HELD_TAG: HELD}.get(seed >> _ENTROPY_BITS)


def _environment_device() -> torch.device:
    """The current accelerator (its current index), else the CPU."""
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _tensor_device(args, kwargs) -> torch.device | None:
    return next((t.device for t in (*args, *kwargs.values()) if torch.is_tensor(t)), None)


class TPRankRNG:
    """Which random stream this rank's dropouts draw from, for one model (two models coexist).

    enter(): onto this rank's stream (no-op when already on one). leave(): back onto the shared
    stream exactly where it was (no-op on the shared stream or on a held one). hold() / enter(hold=
    True): this rank's stream, which leave() does not end, until leave(release=True). reset(): back
    on the shared stream at each forward of the model, so an exception cannot leave a rank astray.
    """

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.draws = 0                   # per-rank streams started (forward and recompute): for tests
        # (per-rank seed, [(generator, shared state)]) of the last stream entered. Kept after leaving:
        # a recompute whose checkpoint holds the layer's hooks (transformers 4) leaves the same stream again.
        self._saved: tuple[int, list] | None = None
        self._generators: dict[torch.device, list] = {}
        self._handles: list = []         # every hook this object installed (see remove_tp_rank_rng)

    # -- where this rank is -----------------------------------------------------------------
    @staticmethod
    def stream() -> str | None:
        """REGION or HELD while this process draws from a per-rank stream, None on the shared one
        (read from the CPU generator's seed, which checkpoint recomputation restores)."""
        return _stream_of(torch.default_generator.initial_seed())

    def _device_generators(self, device: torch.device | None) -> list:
        device = _environment_device() if device is None else device
        if device not in self._generators:
            self._generators[device] = device_generators(device)
        return self._generators[device]

    # -- moving between streams ---------------------------------------------------------------
    def enter(self, device: torch.device | None = None, hold: bool = False) -> None:
        """Draw this rank's dropouts from its own stream. `device`: where the activations live
        (default: the current accelerator, else the CPU); its generator is seeded with the CPU's."""
        current = self.stream()
        if current == HELD or current == (HELD if hold else REGION):
            return
        if current == REGION:            # hold from inside a region: start the held stream afresh
            self._restore()
        # One draw from the shared stream: the same on every tp rank, and again on recompute.
        draw = int(torch.randint(_ENTROPY_MASK + 1, (1,), generator=torch.default_generator).item())
        tag = _HELD_TAG if hold else _REGION_TAG
        seed = (tag << _ENTROPY_BITS) | ((draw + self.tp_rank * _RANK_STEP) & _ENTROPY_MASK)
        generators = self._device_generators(device)
        self._saved = (seed, [(g, g.get_state()) for g in generators])
        for g in generators:
            g.manual_seed(seed)
        self.draws += 1

    def leave(self, release: bool = False) -> None:
        """Back onto the shared stream where it was left. A held stream stays unless `release`."""
        current = self.stream()
        if current is None or (current == HELD and not release):
            return
        self._restore()

    def _restore(self) -> None:
        seed = torch.default_generator.initial_seed()
        if self._saved is None or self._saved[0] != seed:
            raise RuntimeError(
                f"tp rank {self.tp_rank} is on a per-rank dropout stream (seed {seed:#x}) this model did not "
                "start, so the shared stream cannot be restored and the tp ranks would draw different masks in "
                "replicated regions. Causes: another model's per-rank stream is still active, or a checkpointed "
                "region begins between a column-parallel linear and the row-parallel linear that reads it")
        for generator, state in self._saved[1]:
            generator.set_state(state)

    def reset(self) -> None:
        """Back on the shared stream (a region or hold an exception left open is closed)."""
        if self.stream() is not None and self._saved is not None:
            self._restore()

    @contextlib.contextmanager
    def hold(self, device: torch.device | None = None):
        """This rank's stream for the whole block, row-parallel linears inside included. Nested
        holds share the outer one. Use inside a forward (the model's forward resets the stream)."""
        started = self.stream() != HELD
        if started:
            self.enter(device, hold=True)
        try:
            yield self
        finally:
            if started:
                self.leave(release=True)

    def hold_across(self, first: nn.Module, last: nn.Module) -> None:
        """Hold this rank's stream from `first`'s forward to the end of `last`'s (a sequence-
        parallel layer stack: first and last layer). transformers 5 checkpoints a layer's forward,
        inside its hooks, so these run once and the layers' recomputation finds the held stream."""
        self._handles += [first.register_forward_pre_hook(self._hold_hook, with_kwargs=True),
                          last.register_forward_hook(self._release_hook)]

    # -- hooks --------------------------------------------------------------------------------
    def _enter_hook(self, module, args, output) -> None:
        if module.training and torch.is_tensor(output):
            self.enter(output.device)

    def _leave_hook(self, module, args) -> None:
        self.leave()

    def _model_done_hook(self, module, args, output) -> None:
        self.leave()                     # a region no row-parallel linear closed ends with the model

    def _reset_hook(self, module, args) -> None:
        self.reset()

    def _hold_hook(self, module, args, kwargs) -> None:
        if module.training:
            self.enter(_tensor_device(args, kwargs), hold=True)

    def _release_hook(self, module, args, output) -> None:
        self.leave(release=True)


def _opens_region(module: nn.Module) -> bool:
    """A linear whose output is this rank's slice of the features (not gathered back)."""
    if isinstance(module, ColumnParallelLinear):
        return not module.gather_output
    return isinstance(module, ColumnSubsetLinear)


def install_tp_rank_rng(model: nn.Module, group) -> TPRankRNG:
    """Give `model` (already sharded over the tp `group`) per-rank dropout inside its split regions
    and shared dropout elsewhere; returns its `TPRankRNG` (the same one when called again)."""
    existing = get_tp_rank_rng(model)
    if existing is not None:
        return existing
    rng = TPRankRNG(dist.get_rank(group))
    for module in model.modules():
        if _opens_region(module):
            rng._handles.append(module.register_forward_hook(rng._enter_hook))
        elif isinstance(module, RowParallelLinear):
            rng._handles.append(module.register_forward_pre_hook(rng._leave_hook))
            if module.adapter is not None:       # a LoRA adapter masks this rank's slice of the features
                module.adapter.stream = rng
    rng._handles += [model.register_forward_pre_hook(rng._reset_hook),
                     model.register_forward_hook(rng._model_done_hook)]
    model._tp_rank_rng = rng
    return rng


def remove_tp_rank_rng(model: nn.Module) -> None:
    """Take the hooks off `model` again: every dropout draws from the shared stream (the behaviour
    without `install_tp_rank_rng`, for comparisons)."""
    rng = model.__dict__.pop("_tp_rank_rng", None)
    if rng is not None:
        rng.reset()
        for handle in rng._handles:
            handle.remove()
        for module in model.modules():
            if isinstance(module, RowParallelLinear) and module.adapter is not None:
                module.adapter.stream = None
        rng._handles.clear()


def get_tp_rank_rng(model: nn.Module) -> TPRankRNG | None:
    """The `TPRankRNG` installed on `model`, or None."""
    return model.__dict__.get("_tp_rank_rng")
