"""What one pipeline rank's stages are: the record that cutting makes and a step runs.

Owns: `SegmentSpan` (one segment of the layout, see layout.py, as this rank's cut model holds it:
where its layers sit in the model's global layer numbering, which virtual stages start and end it,
the configs its forward numbers layers by, its layer list here), `StageLayerList` (the layer list
of a cut model: this rank's layers under their original indices) and `PipelineStages` (the chunks
one rank runs). Cutting the model lives in cut.py (`build_stages`), running a chunk in run.py; this
module only answers questions about the record. Must not modify a model nor communicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.pipeline.layout import Segment, StageLayout
from meshboost.pipeline.run import run_chunk


class StageLayerList(nn.ModuleList):
    """The layers this rank holds, registered under their original indices (so parameter names stay
    the model's own). While a chunk runs, iteration, len and indexing see only its layers, in order
    (the model's forward loops over them). Outside a step, iteration and len see the layers held here,
    and `layers[i]` is the model's layer i by its original index: the layer itself, or for one another
    stage holds its `AbsentLayer` (every tensor None), never another layer that happens to sit at
    position i here."""

    def __init__(self, layers: dict[int, nn.Module], absent: dict[int, nn.Module] | None = None):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.running: list[nn.Module] | None = None
        self.__dict__["_absent"] = dict(absent or {})       # not submodules: they hold nothing of the model

    def _visible(self) -> list[nn.Module]:
        return self.running if self.running is not None else list(self._modules.values())

    def __iter__(self):
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    def __getitem__(self, idx):
        if self.running is not None:
            return self.running[idx]
        size = len(self._modules) + len(self.__dict__["_absent"])
        if isinstance(idx, slice):
            return nn.ModuleList([self[i] for i in range(size)[idx]])
        index = idx + size if isinstance(idx, int) and idx < 0 else idx
        if str(index) in self._modules:
            return self._modules[str(index)]
        if index in self.__dict__["_absent"]:
            return self.__dict__["_absent"][index]
        raise IndexError(f"layer index {idx} is out of range: the model has {size} layers (this pipeline rank "
                         f"holds {sorted(int(k) for k in self._modules)})")


@dataclass
class SegmentSpan:
    """One segment of the layout on this rank. Its layers are the model's global layers
    `offset .. offset + size - 1` (for shared groups: its iterations, see `Segment.shared_groups`)."""

    segment: Segment
    offset: int                          # global index of its first layer
    size: int                            # its layers (iterations)
    groups: list[int] | None             # the layer-list entry (shared group) each iteration runs, else None
    first_stage: int                     # virtual stage of its first layer: runs its embeddings
    last_stage: int                      # virtual stage of its last layer: runs its tail
    config: object | None                # the config its stack reads per-layer lists from (`layer_types[i]`)
    counted_config: object | None        # the config whose count `counted_by`'s loop runs over, else None
    layer_list: StageLayerList | None = None   # its layers on this rank; None when its stack is absent here

    @property
    def stop(self) -> int:
        return self.offset + self.size

    def entry(self, iteration: int) -> int:
        """The index into the segment's layer list that its `iteration`-th layer runs."""
        return iteration if self.groups is None else self.groups[iteration]

    def iterations_of(self, entry: int) -> list[int]:
        """The segment's iterations running entry `entry` of its layer list (one, but for shared groups)."""
        return [entry] if self.groups is None else [it for it, g in enumerate(self.groups) if g == entry]


@dataclass
class PipelineStages:
    """The model chunks one rank runs. Chunk c of pipeline rank r is virtual stage c * pp_size + r.
    Layers are numbered globally over the layout's segments in order (an encoder's, then a decoder's)."""

    model: nn.Module
    layout: StageLayout
    pp_rank: int
    pp_size: int
    num_chunks: int
    layer_ranges: list[range]                 # per virtual stage, global layer indices
    spans: list[SegmentSpan]                  # one per layout segment, in order
    kept: dict[int, nn.Module]                # global index -> layer this rank holds
    stand_ins: dict[str, nn.Module | torch.Tensor]   # embeddings path -> stand-in
    # id(config) -> the modules of the cut model holding it as `self.config` (run.py shows them a
    # chunk's view of it while the chunk runs)
    config_holders: dict[int, list[nn.Module]] = field(default_factory=dict)
    # weights held by several pipeline ranks: (those pp ranks, the ones held here), the same sets
    # on every rank (groups are built collectively)
    ties: list[tuple[tuple[int, ...], list[nn.Parameter]]] = field(default_factory=list)
    # sequence parallelism over tp ranks: received hidden states hold 1/seq_split of the sequence
    seq_split: int = 1

    @property
    def num_virtual(self) -> int:
        return self.pp_size * self.num_chunks

    def virtual(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.num_virtual - 1

    def segment_of(self, index: int) -> int:
        """The segment holding global layer `index`."""
        return max(j for j, span in enumerate(self.spans) if span.offset <= index)

    def forward_chunk(self, chunk: int, inputs: dict, received: list[torch.Tensor] | None):
        """Run local `chunk` through the model's own forward (run.py). `received`: what the previous
        stage sent (None on the first stage): the outputs of the segments before this chunk's first
        one, then, when the chunk starts inside a segment, its hidden states and carried layer
        outputs. Returns the model output on the last stage, else the list to send on (same convention)."""
        return run_chunk(self, chunk, inputs, received)
