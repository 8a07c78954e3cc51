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

import os
import re

import torch
import torch.nn as nn

from meshboost.booster.wrappers import ModelWrapper, unwrap_model
from meshboost.checkpoint.atomic import AtomicTarget
from meshboost.checkpoint.writer import agree, save_roles
from meshboost.distributed.param_info import full_on_cpu, get_tp_info

_WRAPPED = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.")


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft model (checked by class module, so peft is not imported for others)."""
    return any(c.__module__.startswith("peft.") for c in type(model).__mro__)


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
        raise ImportError("LoRA needs HuggingFace peft: pip install peft (or pip install meshboost[lora])") from e
    return peft


def enable_lora(plugin, model: nn.Module, pretrained_dir: str | None, lora_config, bnb_quantization_config,
                quantize: bool) -> nn.Module:
    """`model` wrapped with LoRA adapters (new from `lora_config`, or trainable ones loaded from the
    peft folder `pretrained_dir`), to be boosted next with the plugin that checked it."""
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
    if quantize or bnb_quantization_config is not None:
        raise NotImplementedError("booster.enable_lora(quantize=True / bnb_quantization_config=...): QLoRA's "
                                  "bitsandbytes 4-bit base weights are not supported by meshboost; drop them to "
                                  "train LoRA adapters on the unquantized model")
    if isinstance(model, peft.PeftModel):
        raise ValueError("this model already has peft adapters; call booster.enable_lora once, on the base model")
    if pretrained_dir is None:
        if lora_config is None:
            raise ValueError("booster.enable_lora needs lora_config=peft.LoraConfig(...) for new adapters, or "
                             "pretrained_dir= a folder saved by save_lora_as_pretrained / PeftModel.save_pretrained")
        if not isinstance(lora_config, peft.LoraConfig):
            raise TypeError(f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}")
        return peft.get_peft_model(model, lora_config)
    if lora_config is not None:
        raise ValueError("pass lora_config or pretrained_dir, not both: the adapter folder carries its own config")
    if not os.path.isfile(os.path.join(pretrained_dir, "adapter_config.json")):
        raise FileNotFoundError(f"pretrained_dir={pretrained_dir!r} holds no adapter_config.json; pass a folder "
                                "written by booster.save_lora_as_pretrained or PeftModel.save_pretrained")
    return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)


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
    if roles.num_stages > 1:
        raise NotImplementedError("save_lora_as_pretrained with pipeline stages is not supported")
    optimizer = model.boosted_optimizer if isinstance(model, ModelWrapper) else None
    masters = optimizer.master_weight if optimizer is not None and optimizer.keeps_masters else None
    state = {}
    for name, tensor in peft_model.state_dict(keep_vars=True).items():
        if not getattr(tensor, "requires_grad", False):       # the frozen base: not part of the adapters
            continue
        source = masters(tensor) if masters is not None else None   # a collective under ZeRO: every rank joins
        source = tensor if source is None else source
        if roles.gathers:
            state[name] = full_on_cpu(source, get_tp_info(tensor), reuse=source is not tensor)
    if roles.main_writer:
        target = None
        try:
            target = AtomicTarget(checkpoint, is_file=False)     # e.g. refuses a path that is a file
            peft_model.save_pretrained(target.path, state_dict=state, safe_serialization=use_safetensors)
            target.commit()
        except BaseException:
            if target is not None:
                target.abort()
            agree([1.0], roles)                # the other ranks learn of it, then this one raises
            raise
    if agree([0.0], roles)[0]:
        raise RuntimeError(f"save_lora_as_pretrained: rank 0 failed to write {checkpoint!r} (its error is above)")
