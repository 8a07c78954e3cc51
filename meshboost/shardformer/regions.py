"""Block regions and linear roles: the one owner of "who applies the input collective".

Owns: `RegionPlan`, built by the sharder's plan before anything is modified: where the block regions
are and which layers sequence parallelism splits, and from that the `LinearRole` of every parallel
linear (does it apply Megatron's f itself, is that f the sequence all-gather, is its output
reduce-scattered, which block region encloses it), decided once and handed to the layer at
construction. `BlockRegion`, one per block (an attention, an MLP) whose input passes one collective
for every column-parallel linear inside it (f, or under sequence parallelism the all-gather along
the sequence): its hooks and the linears inside it hold the same object, which records, for the
current forward, the tensors its pre-hook handed the block, the split input's shape and the
gathered outputs its linears produced. `ColumnOutputs`, the weak record of column-parallel outputs
that `sharder.split_input_guard` reads. Must not set attributes on modules' `__dict__` or on
tensors, know a model family, or call `dist.*` (collectives come from `meshboost.distributed.comm`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.distributed import comm


class SequenceLayoutError(ValueError):
    """Sequence parallelism met a model it cannot split exactly (found at the first call)."""


class ColumnOutputs:
    """The outputs column-parallel linears produced (this rank's slice of the features), held weakly
    and by identity while a split-input guard still waits for its first call.

    Why not a flag on the tensor: the guard must recognize such a tensor (or a view of it) where a
    module the plan knows nothing about consumes it, so someone has to remember the tensor itself;
    this object, owned by the plan and shared by the column layers and the guards, is that one owner.
    It records nothing once every guard has passed its first call (the dataflow does not change)."""

    def __init__(self):
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # id -> tensor
        self._waiting = 0

    def watch(self) -> None:
        """A guard starts waiting for its first call."""
        self._waiting += 1

    def done(self) -> None:
        """A guard passed its first call; the last one stops the record."""
        self._waiting -= 1
        if not self._waiting:
            self._live.clear()

    def note(self, y: torch.Tensor) -> None:
        if self._waiting:
            self._live[id(y)] = y

    def holds(self, t: torch.Tensor) -> bool:
        """True for a recorded output or a view of one."""
        return any(x is not None and self._live.get(id(x)) is x for x in (t, t._base))


class BlockRegion:
    """A block whose input passes one collective for every column-parallel linear reading it.

    Copying (`gathers` False): a pre-hook applies Megatron's f once to the block's inputs that
    require grad. Gathering (sequence parallelism): a pre-hook all-gathers the block's hidden
    states along the sequence (gradient reduce-scattered), and a forward hook hands back this rank's
    chunk when the block returns a gathered column-parallel output (see `_split_output`). The
    linears inside hold this object through their `LinearRole`: a column with an f of its own skips
    it for a tensor the pre-hook produced (`produced`), and a gathered column reports its output
    (`note_gathered`)."""

    def __init__(self, path: str, group, tp_size: int, kwarg_names: tuple[str, ...], gathers: bool):
        self.path, self.group, self.tp_size = path, group, tp_size
        self.kwarg_names, self.gathers = tuple(kwarg_names), gathers
        # for the current forward (overwritten at every entry; weak, so nothing is kept alive):
        self._inputs: tuple[weakref.ref, ...] = ()       # the tensors the pre-hook handed the block
        self._split_shape: tuple[int, ...] | None = None  # [batch, local, hidden] of the gathered input
        self._gathered: list[weakref.ref] = []           # gathered outputs of the linears inside
        self._deferred: tuple[weakref.ref, weakref.ref] | None = None   # (entered input, its DeferredColumns)
        self._columns: list[weakref.ref] = []            # the column-parallel linears inside (layers.overlap)

    def __repr__(self) -> str:
        return f"BlockRegion({self.path!r}, {'gathers' if self.gathers else 'copies'})"

    def install(self, module: nn.Module) -> None:
        """Register this region's hooks on its block."""
        if self.gathers:
            module.register_forward_pre_hook(self._gather_input, with_kwargs=True)
            module.register_forward_hook(self._split_output)
        else:
            module.register_forward_pre_hook(self._copy_input, with_kwargs=True)

    def produced(self, x: torch.Tensor) -> bool:
        """True when `x` is a tensor this region's pre-hook handed the block in its latest call."""
        return any(r() is x for r in self._inputs)

    def add_column(self, module: nn.Module) -> None:
        """A column-parallel linear inside this block: its weight gradient may be computed while the
        block's input collective runs (layers/overlap.py)."""
        self._columns.append(weakref.ref(module))

    def deferred_for(self, x: torch.Tensor):
        """The `layers.overlap.DeferredColumns` of the latest call when `x` is the input it entered, else None."""
        if self._deferred is None or self._deferred[0]() is not x:
            return None
        return self._deferred[1]()

    def _enter_first(self, x: torch.Tensor, seq_parallel: bool) -> torch.Tensor:
        """The block's first input through its collective, with the columns' weight gradients deferred
        to it (the overlap: layers/overlap.py). Not under torch.compile: the per-call record and its
        weak references would be per-layer guards (a recompile per block); compiled blocks take the
        plain collective and autograd's own weight gradients."""
        from meshboost.shardformer.layers.overlap import enter_block      # layers import this module
        columns = [c for c in (r() for r in self._columns) if c is not None]
        out, deferred = enter_block(x, self.group, seq_parallel, columns)
        self._deferred = (weakref.ref(out), weakref.ref(deferred))
        return out

    def note_gathered(self, y: torch.Tensor) -> None:
        """A linear inside returned `y` gathered: whole and equal on every rank."""
        if self.gathers:
            self._gathered.append(weakref.ref(y))

    def _enter(self, produced: list[torch.Tensor]) -> None:
        self._inputs = tuple(weakref.ref(t) for t in produced)
        self._gathered = []

    def _copy_input(self, module, args, kwargs):
        """Megatron f once at the block's input: identity forward, one all-reduce of its grad backward
        (the first input's overlapped with the weight gradients of the columns inside)."""
        self._deferred = None

        overlap = not torch.compiler.is_compiling()     # see _enter_first

        def enter(t):
            if self._deferred is not None or not overlap:
                return comm.copy_to_tp(t, self.group)
            return self._enter_first(t, False)
        args = tuple(enter(a) if torch.is_tensor(a) and a.requires_grad else a for a in args)
        for key in self.kwarg_names:
            value = kwargs.get(key)
            if torch.is_tensor(value) and value.requires_grad:
                kwargs[key] = enter(value)
        self._enter([t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.requires_grad])
        return args, kwargs

    def _gather_input(self, module, args, kwargs):
        """Sequence parallelism: the block's hidden states ([batch, seq/tp, hidden]: its first positional
        argument, or a keyword in `kwarg_names`) are all-gathered along the sequence (gradient
        reduce-scattered), whether or not they require grad. Other positional tensors (BLOOM passes its
        residual) stay split; a block given no hidden states is refused rather than run on a split input."""
        self._deferred = None

        def gather(t):
            if not (torch.is_tensor(t) and t.is_floating_point() and t.dim() == 3):
                return None
            if self._deferred is None and t.requires_grad and not torch.compiler.is_compiling():
                return self._enter_first(t, True)
            return comm.gather_from_seq(t, self.group, dim=1)
        done = []
        first = gather(args[0]) if args else None
        if first is not None:
            args, done = (first, *args[1:]), [args[0]]
        for key in self.kwarg_names:
            g = gather(kwargs.get(key))
            if g is not None:
                done.append(kwargs[key])
                kwargs[key] = g
        self._enter([t for t in (args[0] if args else None, *(kwargs.get(k) for k in self.kwarg_names))
                     if torch.is_tensor(t)])
        if not done:
            raise SequenceLayoutError(f"{self.path}: a block input under sequence parallelism received no [batch, seq, "
                                      f"hidden] tensor as its first argument or as {list(self.kwarg_names)}; set the "
                                      "policy's block_input_kwargs to the argument carrying its hidden states")
        self._split_shape = tuple(done[0].shape)     # the block's output is split back to it
        return args, kwargs

    def _split_output(self, module, args, output):
        """Sequence parallelism: a block whose output is a gathered column-parallel output over the whole
        sequence (equal on every rank: a linear attention ending in a gathered projection rather than a
        row-parallel one) hands back this rank's chunk (gradient all-gathered). Any other output (a
        row-parallel one, already this rank's chunk; a column-split one) is left alone."""
        batch, local, width = self._split_shape or (None, None, None)
        out = output if torch.is_tensor(output) else output[0] if isinstance(output, tuple) and output else None
        if not torch.is_tensor(out) or not any(r() is out for r in self._gathered) or \
                out.shape != (batch, local * self.tp_size, width):
            return output
        out = comm.split_to_tp(out, self.group, dim=1)
        return out if torch.is_tensor(output) else (out, *output[1:])


@dataclass(frozen=True)
class LinearRole:
    """How one parallel linear meets its input, decided once by the sharder's plan (`RegionPlan`).

    applies_f: a column-parallel linear applies Megatron's f to its input itself (identity forward,
        all-reduce of the input gradient backward; under `seq_parallel` its sequence-parallel form:
        all-gather along the sequence forward, reduce-scatter backward). False for a column whose
        block region applied it once for every linear reading the block's input.
    seq_parallel: the activations around the linear hold this rank's chunk of the sequence: a
        column's f is the sequence all-gather; a row-parallel output is reduce-scattered along the
        sequence instead of all-reduced (Megatron's g in its sequence-parallel form).
    region: the innermost block region enclosing the linear, or None. A column that applies f skips
        it for a tensor the region's hook produced (already covered); a gathered column reports its
        output to it.
    outputs: where a column records its split outputs for the split-input guards (None: nowhere).
    """

    applies_f: bool = True
    seq_parallel: bool = False
    region: BlockRegion | None = None
    outputs: ColumnOutputs | None = None

    def covered(self, x: torch.Tensor) -> bool:
        """True when `x` already passed the enclosing block's collective."""
        return self.region is not None and self.region.produced(x)


@dataclass
class RegionPlan:
    """Where the block regions are and which layer list sequence parallelism splits: asked for every
    parallel linear's role, so no style re-derives it from paths."""

    regions: dict[str, BlockRegion] = field(default_factory=dict)   # every path reaching a block -> its region
    seq_stack: str | None = None        # full path of the sequence-parallel layer list, if on
    outputs: ColumnOutputs = field(default_factory=ColumnOutputs)

    def add(self, paths: list[str], group, tp_size: int, kwarg_names: tuple[str, ...]) -> BlockRegion:
        """A region for the block reached by `paths`: gathering when it lies in the sequence-parallel stack."""
        region = BlockRegion(paths[0], group, tp_size, kwarg_names, gathers=self.in_stack(paths[0]))
        for path in paths:
            self.regions[path] = region
        return region

    def at(self, path: str) -> BlockRegion:
        """The region of the block at `path`."""
        return self.regions[path]

    def enclosing(self, path: str) -> BlockRegion | None:
        """The innermost region whose block contains `path`."""
        owners = [b for b in self.regions if path.startswith(b + ".")]
        return self.regions[max(owners, key=len)] if owners else None

    def in_stack(self, path: str) -> bool:
        """True when `path` lies in a layer of the sequence-parallel stack."""
        return self.seq_stack is not None and path.startswith(self.seq_stack + ".")

    def column_role(self, path: str, own_f: bool = False) -> LinearRole:
        """A column-parallel linear at `path`. Inside a region its input passed the block's collective,
        so it applies no f, unless `own_f` (a gathered projection may read something other than the
        block's input): then it applies f, skipping it for the block's own input, and since the region
        already gathered the sequence its f is plain."""
        region = self.enclosing(path)
        return LinearRole(applies_f=own_f or region is None, seq_parallel=region is None and self.in_stack(path),
                          region=region, outputs=self.outputs)

    def row_role(self, path: str) -> LinearRole:
        """A row-parallel linear at `path`: its output reduce-scattered in the sequence-parallel stack."""
        return LinearRole(applies_f=False, seq_parallel=self.in_stack(path))
