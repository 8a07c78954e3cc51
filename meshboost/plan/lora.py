"""LoRA (HuggingFace peft, `booster.enable_lora`) in the planner: which parameters train and how they split.

Owns: `LoraOptions` (rank, target modules, dropout; checked: a rank of 1 or more, a dropout in [0, 1),
targets the model holds), putting peft's adapters on a model as `booster.enable_lora` does (peft's
`get_peft_model`, which freezes every base weight; the adapters in the model's own dtype, as the
plugin's cast to the working dtype leaves them), on the planner's meta model and on the activations'
fake model (the options travel in that model's config, `FIELD`, so each config's fake runs are cached
apart), and the tensor-parallel split of each adapter, shardformer/lora.py's rule read from the
sharder's own plan: a column-parallel base's `lora_B` is split like the base's output (fused blocks and
head replicas alike) and its `lora_A` stays whole, its gradient summed over tp; a row-parallel base's
`lora_A` is split like the base's input and its `lora_B` stays whole, summed. The frozen base weights
are held (weights) but have no gradient, fp32 master or optimizer state (params.py's `RankShards.frozen`).
Must not count bytes (memory.py) nor refuse a layout the plugin runs, except what the planner does not
model yet (LoRA under zero=3; adapters on packed experts).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass

ALL_LINEAR = "all-linear"       # peft's shorthand: every linear but the output head (attention and MLP)
FIELD = "meshboost_lora"        # the config attribute carrying the options into the activations' fake runs


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters of rank `rank` on the linears named by `targets` (module names as peft's
    `target_modules` reads them, or "all-linear"), with `dropout` before each adapter."""

    rank: int
    targets: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0
    quantize: object = None          # QLoRA: a booster.QuantConfig, the adapted bases in NF4 (`nf4_bytes`)

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",")))
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank!r}: pass a whole number of 1 or more (peft's LoraConfig r)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout {self.dropout!r}: pass a probability in [0, 1)")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoRA targets {','.join(map(str, self.targets))!r}: pass module names "
                             f"(q_proj,v_proj) or {ALL_LINEAR}")
        if ALL_LINEAR in self.targets and len(self.targets) > 1:
            raise ValueError(f"LoRA targets {','.join(self.targets)!r}: {ALL_LINEAR} stands alone")

    def peft_config(self):
        """The `peft.LoraConfig` a script passes to `booster.enable_lora` for these options."""
        from meshboost.booster.lora import require_peft

        targets = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        return require_peft().LoraConfig(r=self.rank, lora_alpha=2 * self.rank, target_modules=targets,
                                         lora_dropout=self.dropout)

    def describe(self) -> str:
        dropout = f", dropout {self.dropout:g}" if self.dropout else ""
        nf4 = ", the bases in NF4 (QLoRA)" if self.quantize is not None else ""
        return f"LoRA r={self.rank} on {','.join(self.targets)}{dropout}{nf4}"


def adapted(model, options: LoraOptions | None, fake: bool = False):
    """`model` (a transformers model, meta or fake) with peft's adapters for `options` put on in place,
    every other parameter frozen, as `booster.enable_lora` leaves it; `model` unchanged without options.
    A target the model does not hold raises a one-line ValueError. `fake`: `model` is built under
    FakeTensorMode in the working dtype (so are the adapters peft builds): `_fake_moves`."""
    if options is None:
        return model
    from meshboost.booster.lora import require_peft

    peft = require_peft()
    with warnings.catch_warnings(), _fake_moves() if fake else contextlib.nullcontext():
        warnings.simplefilter("ignore")         # peft reads transformers' deprecated is_gradient_checkpointing
        try:
            peft.get_peft_model(model, options.peft_config(), autocast_adapter_dtype=False)
        except ValueError as exc:
            detail = " ".join(str(exc).split())
            raise ValueError(f"LoRA targets {','.join(options.targets)!r} on {type(model).__name__}: {detail}; name "
                             f"linears the model holds (q_proj,v_proj) or {ALL_LINEAR}") from None
    return model


@contextlib.contextmanager
def _fake_moves():
    """peft moves each new adapter to its base's device and dtype (`module.to`); torch cannot move a fake
    parameter (it swaps tensors, which a fake one refuses), so a move to the device and dtype every
    parameter has already returns the module as it is (what the move would leave), and any other raises."""
    import torch
    import torch.nn as nn

    original = nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or p.device == device) and (dtype is None or p.dtype == dtype)
               for p in module.parameters()):
            return module
        return original(module, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


def with_options(config, options: LoraOptions | None, later_stage: bool = False):
    """A copy of `config` carrying `options` (FIELD) for the activations' fake runs, or `config` itself.
    `later_stage`: for a pipeline stage after the first, whose input (received from the stage before)
    needs a gradient: on the first stage nothing before the first adapter does (the embedding is frozen),
    so its first layer saves less than the others, and the fake model's first layer stands for a later
    stage's only when its input is made to require grad (`adapted_from_config`)."""
    if options is None:
        return config
    import copy

    out = copy.deepcopy(config)
    setattr(out, FIELD, {**asdict(options), "targets": list(options.targets), "later_stage": later_stage})
    return out


def adapted_from_config(model, config):
    """`adapted` with the options `with_options` put in `config` (the activations' fake model); for a
    later stage the input embedding's output requires grad, as a received activation does."""
    fields = dict(getattr(config, FIELD, None) or {})
    later = fields.pop("later_stage", False)
    model = adapted(model, LoraOptions(**fields) if fields else None, fake=True)
    if later:
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return model


# torchao's NF4 linear dequantizes its weight in each product (forward and backward): int64 codes and float
# temporaries, measured with MemTracker per element of the weight (fp32 20.09 bytes, bf16 14.05), one at a time
DEQUANT_BYTES = {"fp32": 20.1, "bf16": 14.1, "fp16": 14.1}


def nf4_bytes(numel: int, quant) -> int:
    """Bytes an NF4 weight of `numel` elements holds (torchao's `NF4Tensor`): 4-bit codes, one int8 scale per
    block, one fp32 factor per group of scales (a shard's groups as distributed/quantized.py regroups them)."""
    blocks = -(-numel // quant.block_size)
    return numel // 2 + blocks + 4 * -(-blocks // quant.scaler_block_size)


def mark_quantized(options: LoraOptions | None, shards):
    """`shards` (params.rank_shards) with the adapted bases' frozen shards marked NF4 (`.quant`) under QLoRA."""
    if options is not None and options.quantize is not None:
        for shard in shards.frozen:
            if shard.name.endswith(".base_layer.weight"):
                shard.quant = options.quantize
    return shards


def dequant_scratch(shards, precision: str) -> int:
    """The largest NF4 base's dequantization temporaries on this rank (0 without QLoRA)."""
    return int(max((DEQUANT_BYTES[precision] * s.numel for s in getattr(shards, "frozen", ())
                    if getattr(s, "quant", None) is not None), default=0))


def check_layout(options: LoraOptions | None, layout) -> None:
    """Raise for a LoRA layout the planner does not model yet (the plugin runs it)."""
    if options is not None and layout.zero == 3:
        raise NotImplementedError("LoRA under zero=3 (FSDP2 shards the frozen base weights too) is not modelled "
                                  "yet by the planner; use zero=0, 1 or 2")


def adapter_splits(plan, splits: dict) -> dict:
    """id(param) -> `params.Split` of every adapter weight in the sharder's `plan` (its `adapters`, each
    beside its base's match), given the bases' `splits` (each adapter's Split made from its base's, so
    this module needs no name of params.py, which calls it)."""
    from dataclasses import replace

    from meshboost.shardformer.lora import COLUMN_STYLES, ROW_STYLES, is_lora_linear

    styles = {id(m.module): m.style.name for m in plan.matches}
    out = {}
    for layer in plan.adapters:
        if not is_lora_linear(layer):
            raise NotImplementedError(f"LoRA adapters on {type(layer).__name__} (packed experts) are not modelled "
                                      "yet by the planner; leave the experts out of the targets")
        base = layer.get_base_layer()
        style, split = styles.get(id(base)), splits.get(id(base.weight))
        whole = replace(split, dim=0, num_fused=1, pad_to_multiple=1, replicas=1, whole=True)    # params.SUMMED
        for name in layer.lora_A:
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            if style in COLUMN_STYLES:       # lora_B: the base's output rows, as the base's weight splits them
                out[id(b)] = replace(split, dim=0, pad_to_multiple=1)
                out[id(a)] = whole
            elif style in ROW_STYLES:        # lora_A: the base's input columns
                out[id(a)] = replace(split, dim=1, num_fused=1, pad_to_multiple=1, replicas=1)
                out[id(b)] = whole
    return out


def frozen_inputs(model, splits: dict, held) -> int:
    """Column-parallel blocks whose input gradient this rank never computes, so Megatron's f skips its
    backward all-reduce (split_gather: its reduce-scatter): autograd runs no backward upstream of the
    first trainable parameter. On the stage holding a frozen input embedding (LoRA's), every block of its
    layers, in forward order, up to and including the first holding a trainable parameter (an attention
    with adapters: the first layer's attention); 0 elsewhere and when the embedding trains. Assumes the
    embedding's output is not made to require grad (peft does that when checkpointing is on before
    `enable_lora`: wrap first, as the planner's fake run and the benchmarks do)."""
    from meshboost.plugins.fsdp_wrap import transformer_layers
    from meshboost.shardformer.layers import is_conv1d

    names = {id(p): n for n, p in model.named_parameters()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if weight is None or weight.requires_grad or names.get(id(weight)) not in held:
        return 0
    count = 0
    for _, layer in transformer_layers(model):
        if not any(names.get(id(p)) in held for p in layer.parameters()):
            break
        for block in layer.children():
            linears = [m for m in block.modules() if hasattr(m, "weight") and id(m.weight) in splits]
            if any(not splits[id(m.weight)].whole and m.weight.dim() == 2      # output features split: a column
                   and splits[id(m.weight)].dim == (1 if is_conv1d(m) else 0) for m in linears):
                count += 1
            if any(p.requires_grad for p in block.parameters()):
                return count
    return count
