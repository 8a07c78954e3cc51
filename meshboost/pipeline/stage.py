"""Pipeline stages cut from an unmodified HuggingFace model.

Owns: removing from the model every module this rank's stages do not hold (in place, so the
model keeps its class, its parameter names and its own forward), finding weights tied across the
first and last stage, and running one model chunk through the model's own forward.

How a stage runs its slice without forking the HF forward: the model is called as usual with
the micro-batch's inputs (so it builds its own attention masks and position embeddings, which
are cheap); the layer list iterates only the chunk being run; on a stage other than the first,
the embeddings are stand-ins returning zeros of the right shape and a pre-hook on the chunk's
first layer swaps in the hidden states received from the previous stage; on a stage other than
the last, a hook on the chunk's last layer stops the forward and returns its hidden states.
Must not communicate: p2p.py and schedule.py do that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.distributed.param_info import PipelineTie, set_pipeline_tie
from meshboost.pipeline.layout import StageLayout, get_layout, split_layers


class _StageOutput(BaseException):
    """Carries a chunk's last hidden states out of the HF forward. A BaseException so that no
    `except Exception` in model code can swallow it."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class AbsentEmbedding(nn.Module):
    """Stands in for a module of the embeddings, which the first stage holds. Returns zeros shaped
    like the hidden states received from the previous stage (set by `forward_chunk` while the chunk
    runs), so the model can build its masks from them; those hidden states replace its output at the
    first layer. Keeps the replaced module's tree of submodules with an empty tensor of the right
    dtype for every weight, so a forward reading `embeddings.patch_embeddings.projection.weight.dtype`
    (ViT) still works; the stand-in owns no parameter and saves nothing."""

    def __init__(self, replaced: nn.Module):
        super().__init__()
        _hollow_into(self, replaced)
        self.hidden_like: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        if self.hidden_like is None:
            raise RuntimeError("an embedding stand-in ran outside a pipeline chunk; run the model through "
                               "booster.execute_pipeline(data_iter, model, criterion, optimizer)")
        return torch.zeros_like(self.hidden_like)


def _hollow_into(shell: nn.Module, module: nn.Module) -> None:
    for name, p in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if p is not None and name not in shell._buffers:
            device = "cpu" if p.is_meta else p.device           # never a meta buffer: nothing to load
            shell.register_buffer(name, torch.empty(0, dtype=p.dtype, device=device), persistent=False)
    for name, child in module.named_children():
        hollow = nn.Module()
        _hollow_into(hollow, child)
        shell.add_module(name, hollow)


class AbsentModule(nn.Module):
    """Stands in for a module another pipeline stage holds; calling it is a usage error."""

    def __init__(self, path: str, owner: str):
        super().__init__()
        self.path, self.owner = path, owner

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.path} lives on the {self.owner} pipeline stage; with pp_size > 1 run the model "
                           "through booster.execute_pipeline(data_iter, model, criterion, optimizer)")


class StageLayerList(nn.ModuleList):
    """The layers this rank holds, registered under their original indices (so parameter names stay
    the model's own). Iteration, len and indexing see only the layers of the chunk being run."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.running: list[nn.Module] | None = None

    def _visible(self) -> list[nn.Module]:
        return self.running if self.running is not None else list(self._modules.values())

    def __iter__(self):
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    def __getitem__(self, idx):
        return self._visible()[idx]


@dataclass
class PipelineStages:
    """The model chunks one rank runs. Chunk c of pipeline rank r is virtual stage c * pp_size + r."""

    model: nn.Module
    layout: StageLayout
    pp_rank: int
    pp_size: int
    num_chunks: int
    layer_ranges: list[range]                 # per virtual stage
    chunk_layers: list[list[nn.Module]]       # per local chunk
    stand_ins: dict[str, nn.Module]           # embeddings path -> AbsentEmbedding
    tied_params: list[nn.Parameter] = field(default_factory=list)   # shared by the first and last stage
    has_tied: bool = False                    # some weight is tied across stages (same on every rank)

    @property
    def num_virtual(self) -> int:
        return self.pp_size * self.num_chunks

    def virtual(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.num_virtual - 1

    def forward_chunk(self, chunk: int, inputs: dict, hidden: torch.Tensor | None):
        """Run local `chunk` through the model's own forward. `hidden`: the previous stage's output
        (None on the first stage). Returns the model output on the last stage, else the hidden states."""
        layers = self.chunk_layers[chunk]
        base = self.model.base_model
        layer_list = base.get_submodule(self.layout.layers)
        handles = []
        if not self.is_first(chunk):
            handles.append(layers[0].register_forward_pre_hook(_replace_hidden(hidden), with_kwargs=True))
        if not self.is_last(chunk):
            handles.append(layers[-1].register_forward_hook(_stop_with_output))
        swapped = {} if self.is_first(chunk) else self.stand_ins
        for stand_in in swapped.values():
            stand_in.hidden_like = hidden
        layer_list.running = layers
        try:
            with _swapped(base, swapped), _per_layer_config(self.model.config, self.layer_ranges[self.virtual(chunk)]):
                return self.model(**inputs)
        except _StageOutput as done:
            return done.hidden
        finally:
            layer_list.running = None
            for stand_in in swapped.values():
                stand_in.hidden_like = None
            for h in handles:
                h.remove()


@contextlib.contextmanager
def _per_layer_config(config, indices: range):
    """The model's forward numbers the layers it iterates from 0 (`enumerate(self.layers)`) and reads
    per-layer settings by that number (`config.layer_types[i]`: sliding or full attention, and the
    like): while a chunk runs, every per-layer list of the config starts with this chunk's entries,
    so the chunk's first layer gets its own mask and rope, not layer 0's."""
    num_layers = getattr(config, "num_hidden_layers", None)
    lists = {k: v for k, v in vars(config).items()
             if isinstance(v, (list, tuple)) and isinstance(num_layers, int) and len(v) == num_layers}
    if not lists or indices.start == 0:
        yield
        return
    try:
        for key, value in lists.items():
            reordered = [value[i] for i in indices] + [value[i] for i in range(num_layers) if i not in indices]
            setattr(config, key, type(value)(reordered))
        yield
    finally:
        for key, value in lists.items():
            setattr(config, key, value)


def _only_through_schedule(layer_list: StageLayerList):
    def hook(module, args):
        if layer_list.running is None:
            raise RuntimeError("this model is one pipeline stage; with pp_size > 1 run it through "
                               "booster.execute_pipeline(data_iter, model, criterion, optimizer)")
    return hook


def _replace_hidden(hidden: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}
    return hook


def _stop_with_output(module, args, output):
    raise _StageOutput(output[0] if isinstance(output, (tuple, list)) else output)


@contextlib.contextmanager
def _swapped(root: nn.Module, replacements: dict[str, nn.Module]):
    """Temporarily put `replacements` (path -> module) in place under `root`."""
    saved = {path: _set(root, path, module) for path, module in replacements.items()}
    try:
        yield
    finally:
        for path, module in saved.items():
            _set(root, path, module)


def _set(root: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, leaf)
    setattr(parent, leaf, module)
    return old


def _owner(name: str, layout: StageLayout, base_prefix: str, layer_ranges: list[range]) -> int | None:
    """Virtual stage holding the parameter `name` (a full model name), or None if the layout misses it."""
    if base_prefix and not name.startswith(base_prefix + "."):
        return len(layer_ranges) - 1                                  # a head: outside the base model
    rel = name[len(base_prefix) + 1:] if base_prefix else name
    if any(rel.startswith(p + ".") for p in layout.embeddings):
        return 0
    if rel.startswith(layout.layers + "."):
        index = int(rel[len(layout.layers) + 1:].split(".", 1)[0])
        return next(v for v, r in enumerate(layer_ranges) if index in r)
    if any(rel.startswith(p + ".") for p in layout.tail):
        return len(layer_ranges) - 1
    return None


def build_stages(model: nn.Module, pp_rank: int, pp_size: int, num_chunks: int = 1,
                 num_layers_per_stage: list[int] | None = None, layout: dict | None = None) -> PipelineStages:
    """Cut `model` in place down to the chunks of pipeline rank `pp_rank`. `layout`: the family's
    declared pipeline layout (see `get_layout`). Every check runs before the model is touched, and
    none communicates, so every rank raises the same error."""
    layout = get_layout(model, layout)
    base = getattr(model, "base_model", model)
    if isinstance(base.get_submodule(layout.layers), StageLayerList):
        raise ValueError(f"{type(model).__name__} was already cut into pipeline stages by an earlier boost: boost the "
                         "original model once; to start over, build a fresh model (or load its checkpoint into one)")
    base_prefix = next((n for n, m in model.named_modules() if m is base), "")
    layers = base.get_submodule(layout.layers)
    num_virtual = pp_size * num_chunks
    layer_ranges = split_layers(len(layers), num_virtual, num_layers_per_stage)

    owners: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = _owner(name, layout, base_prefix, layer_ranges)
        if owner is None:
            raise ValueError(f"pipeline layout {layout.name!r} does not place parameter {name!r}; add its module "
                             "to the layout's embeddings or tail in meshboost/pipeline/layout.py")
        owners.setdefault(id(p), set()).add(owner)
        params[id(p)] = p
    last = num_virtual - 1
    tied = [params[i] for i, o in owners.items() if len(o) > 1]
    for i, o in owners.items():
        if len(o) > 1 and o != {0, last}:
            raise ValueError(f"a weight of shape {tuple(params[i].shape)} is shared by pipeline stages "
                             f"{sorted(o)}; only weights tied between the first and last stage are supported")

    mine = [v for v in range(num_virtual) if v % pp_size == pp_rank]
    kept = {i: layers[i] for v in mine for i in layer_ranges[v]}
    _set(base, layout.layers, StageLayerList(kept))
    chunk_layers = [[kept[i] for i in layer_ranges[v]] for v in mine]

    stand_ins = {p: AbsentEmbedding(base.get_submodule(p)) for p in layout.embeddings if _exists(base, p)}
    if pp_rank != 0:
        for path, stand_in in stand_ins.items():
            _set(base, path, stand_in)
    if pp_rank != pp_size - 1:
        for path in layout.tail:
            if _exists(base, path):
                _set(base, path, AbsentModule(path, "last"))
        heads = [] if model is base else list(model.named_children())
        for name, child in heads:
            if child is not base and any(True for _ in child.parameters()):
                setattr(model, name, AbsentModule(name, "last"))

    holds_tied = pp_rank in (0, pp_size - 1)
    if holds_tied and pp_size > 1:
        for p in tied:
            # The first stage's copy is the weight; the last stage's is a replica (not counted twice in norms).
            set_pipeline_tie(p, PipelineTie(replica=pp_rank == pp_size - 1))
    model.register_forward_pre_hook(_only_through_schedule(base.get_submodule(layout.layers)))
    return PipelineStages(model, layout, pp_rank, pp_size, num_chunks, layer_ranges, chunk_layers, stand_ins,
                          tied_params=tied if holds_tied else [], has_tied=bool(tied))


def _exists(root: nn.Module, path: str) -> bool:
    try:
        return isinstance(root.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def prune_optimizer(optimizer, model: nn.Module) -> None:
    """Drop from `optimizer` (a torch optimizer built on the whole model) the parameters this
    stage no longer holds, so they are neither stepped nor kept alive."""
    if optimizer is None:
        return
    keep = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in keep]
    for p in list(optimizer.state):
        if id(p) not in keep:
            del optimizer.state[p]
