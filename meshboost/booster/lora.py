"""LoRA through HuggingFace peft: ColossalAI's `booster.enable_lora` / `save_lora_as_pretrained`.

Owns: checking a LoRA request (peft installed, a config or an adapter folder, the plugin able to
train adapters, the model not boosted yet; all pure, so every rank raises alike before any
collective), wrapping the model with peft (`get_peft_model`, or `PeftModel.from_pretrained` with
trainable adapters), and saving only the adapters as a peft folder (`adapter_config.json` plus the
adapter weights, loadable by `PeftModel.from_pretrained`) from the fp32 masters when the optimizer
keeps them. The wrapped model is then boosted like any model: the adapters are ordinary trainable
parameters and the base weights frozen ones. Must not shard, reduce or write tensors itself.
"""

from __future__ import annotations

import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.booster.qlora import quant_config, quantize_bases_
from meshboost.booster.wrappers import ModelWrapper, unwrap_model
from meshboost.checkpoint.atomic import AtomicTarget
from meshboost.checkpoint.model_io import gather_entry
from meshboost.checkpoint.writer import agree, save_roles
from meshboost.lazy import LazyInitContext, lazy_seed, set_initializer
from meshboost.shardformer.lora import is_peft_module

_WRAPPED = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.")


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft model (checked by class module, so peft is not imported for others)."""
    return is_peft_module(model)


def base_checkpoint_name(name: str) -> str | None:
    """The name a parameter of a peft LoRA model goes by in a checkpoint of its base model (the
    HF name: the `base_model.model.` prefix and peft's wrapper levels dropped), or None for an adapter
    tensor, which such a checkpoint does not hold (`booster.load_model` of the base weights)."""
    if any(part.startswith("lora_") for part in name.split(".")):
        return None
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return _WRAPPED.sub(".", name)


def require_peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA needs HuggingFace peft: pip install peft (or pip install -e '.[lora]' from a "
                          "meshboost clone)") from e
    return peft


def enable_lora(plugin, model: nn.Module, pretrained_dir: str | None, lora_config, bnb_quantization_config,
                quantize) -> nn.Module:
    """`model` wrapped with LoRA adapters (new from `lora_config`, or trainable ones loaded from the
    peft folder `pretrained_dir`), to be boosted next with the plugin that checked it. quantize: True, "nf4"
    or a `QuantConfig`: the adapted linears' frozen bases become NF4 (QLoRA, `qlora.py`)."""
    peft = require_peft()
    if plugin is None:
        raise ValueError("booster.enable_lora needs a plugin: Booster(plugin=TorchDDPPlugin() or "
                         "LowLevelZeroPlugin() or HybridParallelPlugin(tp_size=1, ...))")
    refusal = plugin.lora_refusal()
    if refusal:
        raise NotImplementedError(refusal)
    if isinstance(model, ModelWrapper) or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError("booster.enable_lora must come before booster.boost: pass the original model, then "
                           "boost the model it returns")
    if bnb_quantization_config is not None:
        raise NotImplementedError("booster.enable_lora(bnb_quantization_config=...): bitsandbytes' 4-bit layers are "
                                  "not supported; pass quantize='nf4' (or a meshboost QuantConfig) for QLoRA's NF4 "
                                  "bases through torchao")
    quant = quant_config(quantize)
    peft_model = _enable(peft, model, pretrained_dir, lora_config)
    if quant is not None:
        quantize_bases_(peft_model, quant)
    return peft_model


def _enable(peft, model: nn.Module, pretrained_dir: str | None, lora_config) -> nn.Module:
    if isinstance(model, peft.PeftModel):
        raise ValueError("this model already has peft adapters; call booster.enable_lora once, on the base model")
    if pretrained_dir is None:
        if lora_config is None:
            raise ValueError("booster.enable_lora needs lora_config=peft.LoraConfig(...) for new adapters, or "
                             "pretrained_dir= a folder saved by save_lora_as_pretrained / PeftModel.save_pretrained")
        if not isinstance(lora_config, peft.LoraConfig):
            raise TypeError(f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}")
        seed = lazy_seed(model)
        if seed is not None:
            return _lazy_adapters(peft, model, lora_config, seed)
        return peft.get_peft_model(model, lora_config)
    if lora_config is not None:
        raise ValueError("pass lora_config or pretrained_dir, not both: the adapter folder carries its own config")
    if lazy_seed(model) is not None:
        raise NotImplementedError("booster.enable_lora(pretrained_dir=...) on a model built under LazyInitContext: "
                                  "the saved adapters would be loaded into meta tensors and lost; build the base "
                                  "model eagerly (or with from_pretrained) to continue training saved adapters")
    if not os.path.isfile(os.path.join(pretrained_dir, "adapter_config.json")):
        raise FileNotFoundError(f"pretrained_dir={pretrained_dir!r} holds no adapter_config.json; pass a folder "
                                "written by booster.save_lora_as_pretrained or PeftModel.save_pretrained")
    return _load_adapters(peft, model, pretrained_dir)


def _lazy_adapters(peft, model: nn.Module, lora_config, seed: int) -> nn.Module:
    """New adapters on a model still on meta (LazyInitContext): peft builds them inside the context too
    (its own init runs on meta and is lost, and it moves the adapters to their base layer's device), so
    each adapter module records peft's init for `boost` to apply with the base weights: A as
    `nn.Linear`'s default (or gaussian, std 1/r), B zero; adapters on packed experts (`target_parameters`)
    alike, their factors being linears too. Inits that read the base weights (PiSSA, OLoRA, LoftQ, ...) or
    add other tensors (DoRA, LoRA on embeddings) are refused, on every rank alike, before any collective."""
    init = lora_config.init_lora_weights
    if init not in (True, "gaussian") or lora_config.use_dora:
        raise NotImplementedError(f"LoraConfig(init_lora_weights={init!r}, use_dora={lora_config.use_dora}) on a "
                                  "model built under LazyInitContext: that init reads the base weights, which are "
                                  "not materialised before boost; use init_lora_weights=True or 'gaussian' without "
                                  "DoRA, or build the base model eagerly")
    before = {id(p) for p in model.parameters()}
    with LazyInitContext(seed=seed):
        peft_model = peft.get_peft_model(model, lora_config)
    inits = {}
    for module in peft_model.modules():
        for adapter in getattr(module, "lora_A", {}).values() if isinstance(module, peft.tuners.lora.LoraLayer) else ():
            inits[adapter] = _init_lora_a_gaussian if init == "gaussian" else _init_lora_a
        for adapter in getattr(module, "lora_B", {}).values() if isinstance(module, peft.tuners.lora.LoraLayer) else ():
            inits[adapter] = _init_zero
    covered = {id(p) for m in inits for p in m.parameters()}
    other = [n for n, p in peft_model.named_parameters() if id(p) not in before and id(p) not in covered]
    if other:
        raise NotImplementedError(f"LoRA on a model built under LazyInitContext: {other[0]} is an adapter tensor "
                                  "meshboost cannot initialise lazily (only the linear lora_A / lora_B of "
                                  "target_modules); drop its target, or build the base model eagerly")
    for adapter, fn in inits.items():
        set_initializer(adapter, fn)
    return peft_model


def _init_lora_a(linear: nn.Module) -> None:
    """peft's default init of A (the LoRA paper's: as `nn.Linear` initialises its weight)."""
    nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5))


def _init_lora_a_gaussian(linear: nn.Module) -> None:
    """peft's init_lora_weights='gaussian' for A: normal with std 1/r (r: A's output features)."""
    nn.init.normal_(linear.weight, std=1 / linear.out_features)


def _init_zero(module: nn.Module) -> None:
    """peft's init of B: zero, so the adapted model starts equal to its base."""
    for p in module.parameters(recurse=False):
        nn.init.zeros_(p)


def _load_adapters(peft, model: nn.Module, pretrained_dir: str) -> nn.Module:
    """The adapters of `pretrained_dir` on `model`, trainable; refused (on every rank alike: the same
    files) when the folder's tensors are not exactly the adapters its config builds: peft itself only
    warns of missing keys and would train freshly initialised adapters in their place."""
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    def refuse(what: str):
        return ValueError(f"pretrained_dir={pretrained_dir!r}: {what}; the folder's adapter_config.json (r, "
                          "target_modules, ...) must describe its adapter weights: pass the folder "
                          "save_lora_as_pretrained wrote, unedited")
    try:
        peft_model = peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    except RuntimeError as e:                  # a size mismatch: the rank differs from the config's
        raise refuse(f"its weights do not fit the adapters its config builds ({str(e).splitlines()[-1].strip()})") \
            from e
    saved = load_peft_weights(pretrained_dir, device="cpu")
    built = get_peft_model_state_dict(peft_model)
    missing, unexpected = sorted(set(built) - set(saved)), sorted(set(saved) - set(built))
    if missing or unexpected:
        detail = (f"its config builds {missing[0]!r}, which its weights lack" if missing
                  else f"it holds {unexpected[0]!r}, which no adapter its config builds reads")
        raise refuse(detail + f" ({len(missing)} missing, {len(unexpected)} unexpected)")
    for name, tensor in built.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise refuse(f"{name} has shape {tuple(saved[name].shape)}, its config builds {tuple(tensor.shape)}")
    return peft_model


def save_lora(model: nn.Module, checkpoint: str, use_safetensors: bool, mesh=None) -> None:
    """Write the adapters of boosted `model` as a peft folder at `checkpoint` (replaced atomically);
    call on every rank. The fp32 masters of the optimizer boosted with it are saved when it keeps
    them (rounded half-precision working weights otherwise)."""
    peft = require_peft()
    peft_model = unwrap_model(model)
    if not isinstance(peft_model, peft.PeftModel):
        raise TypeError(f"save_lora_as_pretrained needs the model returned by booster.enable_lora (then boosted), "
                        f"got {type(peft_model).__name__}; booster.save_model saves a whole model")
    roles = save_roles(mesh)
    optimizer = model.boosted_optimizer if isinstance(model, ModelWrapper) else None
    masters = optimizer.master_weight if optimizer is not None and optimizer.keeps_masters else None
    state = {}
    for name, tensor in peft_model.state_dict(keep_vars=True).items():
        if not getattr(tensor, "requires_grad", False):       # the frozen base: not part of the adapters
            continue
        full = gather_entry(tensor, roles, masters)      # a collective under ZeRO and FSDP2: every rank joins
        if full is not None:
            state[name] = full
    stages = None
    if roles.num_stages > 1:
        # peft picks the adapter tensors by visiting the model's own LoRA layers, and each stage holds only its
        # layers': every stage writer picks its own, and rank 0 writes them all into the one weights file
        if len(peft_model.peft_config) > 1:
            raise NotImplementedError("save_lora_as_pretrained with pipeline stages saves one adapter; this model "
                                      f"has {sorted(peft_model.peft_config)}: delete_adapter the others first")
        from peft.utils import get_peft_model_state_dict
        mine = get_peft_model_state_dict(peft_model, state_dict=state) if roles.stage_writer else {}
        parts = [None] * dist.get_world_size(roles.group) if roles.main_writer else None
        dist.gather_object(mine, parts, dst=0, group=roles.group)
        stages = {name: t for part in parts for name, t in part.items()} if roles.main_writer else None
    if roles.main_writer:
        target = None
        try:
            target = AtomicTarget(checkpoint, is_file=False)     # e.g. refuses a path that is a file
            peft_model.save_pretrained(target.path, state_dict=state, safe_serialization=use_safetensors)
            if stages is not None:
                _write_adapter_weights(target.path, stages, use_safetensors)
            target.commit()
        except BaseException:
            if target is not None:
                target.abort()
            agree([1.0], roles)                # the other ranks learn of it, then this one raises
            raise
    if agree([0.0], roles)[0]:
        raise RuntimeError(f"save_lora_as_pretrained: rank 0 failed to write {checkpoint!r} (its error is above)")


def _write_adapter_weights(folder: str, state: dict, use_safetensors: bool) -> None:
    """Replace the adapter weights peft wrote in `folder` by `state` (keys as peft writes them), in the
    file and format peft's own save_pretrained uses."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    state = {name: t.contiguous() for name, t in state.items()}
    if use_safetensors:
        from safetensors.torch import save_file
        save_file(state, os.path.join(folder, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(folder, WEIGHTS_NAME))
