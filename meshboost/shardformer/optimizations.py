"""The kernel switches of `ShardConfig` (issue 13): the attention kernel, fused normalization and
compiled pointwise chains.

Owns: choosing the attention implementation per backend (`enable_flash_attention`: flash-attn 2
when it is importable on CUDA, else torch's `scaled_dot_product_attention`, whose flash and
memory-efficient kernels torch picks itself); swapping each norm whose numbers a fused kernel
reproduces (`enable_fused_normalization`: apex's FusedRMSNorm / FusedLayerNorm on CUDA when
`apex.normalization` imports, else torch's `rms_norm` kernel for RMS norms); and swapping each
activation module whose forward is a chain of pointwise ops for one calling it `torch.compile`d
(`enable_jit_fused`). Every replacement is probed once per kind against the module it replaces and
used only when the numbers agree. A module carrying a hook (the sharder's guard against an uncovered
per-head norm, a style's hook) is kept, so no check or gradient rule is lost. Each switch logs one
line saying what it chose. Must not shard or fork a HuggingFace forward: it runs after the sharder,
on the per-rank heads and shards it left, swaps leaf modules only, and keeps every weight (same
`nn.Parameter`).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger("meshboost.shardformer")


def say(message: str, *args) -> None:
    """The one line a switch prints about its choice: a warning (shown by default), on global rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message, *args)


def attention_implementation(device_type: str) -> str:
    """flash-attn 2 on CUDA when importable, else torch's SDPA."""
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def use_fast_attention(model: nn.Module, device_type: str, allowed: tuple[str, ...] | None = None) -> str:
    """Set the model's attention implementation (transformers' `set_attn_implementation`): the
    first of flash-attn 2 / SDPA the model supports and `allowed` names (context parallelism wraps only
    implementations taking a dense mask; None: any), else it keeps its own. Returns the choice."""
    wanted = attention_implementation(device_type)
    chain = [wanted, "sdpa"] if wanted != "sdpa" else ["sdpa"]
    chain = [impl for impl in chain if allowed is None or impl in allowed]
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    setter = getattr(model, "set_attn_implementation", None)
    for impl in chain:
        if setter is None:
            break
        try:
            setter(impl)
        except (ValueError, ImportError) as e:          # transformers: the model or kernel does not support it
            logger.info("meshboost: attention %s not available for %s (%s)", impl, type(model).__name__, e)
            continue
        why = "" if impl == "flash_attention_2" else \
            " (flash-attn 2 needs CUDA, the flash_attn package and model support)" if allowed is None else \
            f" (under context parallelism: its attention wraps {', '.join(allowed)})"
        say("meshboost: enable_flash_attention -> attention %r%s, was %r", impl, why, current)
        return impl
    say("meshboost: enable_flash_attention -> %s supports neither flash-attn 2 nor SDPA; keeps %r",
         type(model).__name__, current)
    return current


def _hooked(module: nn.Module) -> bool:
    """Whether a module hook lives on `module` (a guard, a style's gradient rule): a swap would drop it."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


# -- enable_fused_normalization ------------------------------------------------------------------

# Probe tolerances (rtol, atol): fp32 round-off; bf16 about two units in the last place, since a
# fused kernel may round once where the module rounds between its steps.
_NORM_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 3e-2)}


class FusedRMSNorm(nn.Module):
    """An RMS norm computed by torch's fused `rms_norm` kernel in fp32, cast back to the input dtype,
    then scaled by the same weight, in the order transformers' Llama-style norms use."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.eps)
        return self.weight * normed.to(dtype)


def _rms_parts(module: nn.Module):
    """(weight, eps) of a module that looks like an RMS norm over the last dim, else None."""
    if not type(module).__name__.endswith("RMSNorm") or type(module) is FusedRMSNorm \
            or type(module).__module__.startswith("apex."):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    return weight, eps


def _apex_normalization(device_type: str):
    """(`apex.normalization`, "") when apex is usable here, else (None, why not). apex is optional."""
    if device_type != "cuda":
        return None, "apex kernels need CUDA"
    try:
        import apex.normalization as apex_normalization
    except Exception as e:                  # not installed, or built for another torch / without CUDA
        return None, f"apex.normalization does not import: {type(e).__name__}"
    return apex_normalization, ""


def _apex_rms(apex_normalization, module: nn.Module) -> nn.Module:
    weight, eps = _rms_parts(module)
    fused = apex_normalization.FusedRMSNorm(tuple(weight.shape), eps=eps)
    fused.weight = weight                   # the same parameter; apex's fresh one is dropped
    return fused


def _apex_layer_norm(apex_normalization, module: nn.LayerNorm) -> nn.Module:
    fused = apex_normalization.FusedLayerNorm(module.normalized_shape, eps=module.eps)
    fused.weight, fused.bias = module.weight, module.bias
    return fused


def _norm_chain(module: nn.Module, apex_normalization) -> list:
    """(label, build) replacements to try for a norm, best first; `build(module)` makes one holding
    the module's own parameters. Empty for a module that is no norm this switch handles."""
    chain = []
    if _rms_parts(module) is not None:
        if apex_normalization is not None:
            chain.append(("apex FusedRMSNorm", functools.partial(_apex_rms, apex_normalization)))
        chain.append(("torch's fused rms_norm", lambda m: FusedRMSNorm(*_rms_parts(m))))
    elif apex_normalization is not None and type(module) is nn.LayerNorm and module.bias is not None \
            and module.weight is not None:
        chain.append(("apex FusedLayerNorm", functools.partial(_apex_layer_norm, apex_normalization)))
    return chain


def _same_numbers(module: nn.Module, build, device: str = "cpu") -> bool:
    """Probe a copy with random parameters and input (fp32, then bf16): the replacement `build`
    makes from it must give the module's numbers (a norm scaling by 1 + weight, Gemma's, or keeping
    fp32, does not). A replacement whose kernel fails here (apex built without it) is refused."""
    generator = torch.Generator().manual_seed(0)
    original = copy.deepcopy(module)
    original = original.to_empty(device=device) if any(t.is_meta for t in original.parameters()) \
        else original.to(device=device)
    x = torch.randn(3, *original.weight.shape, generator=generator) * 3
    try:
        with torch.no_grad():
            for p in original.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
            for dtype, (rtol, atol) in _NORM_TOLERANCE.items():
                original.to(dtype)
                want = original(x.to(device, dtype))
                got = build(original)(x.to(device, dtype))
                if want.dtype != got.dtype or not torch.allclose(want.float(), got.float(), rtol=rtol, atol=atol):
                    return False
    except Exception as e:                  # e.g. apex without its fused_layer_norm_cuda extension
        logger.info("meshboost: fused norm probe failed for %s: %r", type(module).__name__, e)
        return False
    return True


def fuse_norms(model: nn.Module, device_type: str) -> int:
    """Swap every norm for the first fused replacement whose numbers match (checked once per class
    and backend by a probe), holding the same weights: apex's kernels on CUDA when apex imports, else
    torch's fused rms_norm for RMS norms. Returns how many were swapped."""
    apex_normalization, no_apex = _apex_normalization(device_type)
    verdict: dict[tuple[type, str], bool] = {}
    swaps, on, hooked = [], {}, 0
    for name, module in model.named_modules():
        chain = _norm_chain(module, apex_normalization)
        if not chain:
            continue
        if _hooked(module):
            hooked += 1
            continue
        for label, build in chain:
            key = (type(module), label)
            if key not in verdict:
                verdict[key] = _same_numbers(module, build, device_type if label.startswith("apex") else "cpu")
            if verdict[key]:
                swaps.append((name, build(module)))
                on[label] = on.get(label, 0) + 1
                break
    for name, fused in swaps:
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fused)
    kept = sorted({t.__name__ for t, _ in verdict} - {t.__name__ for (t, _), ok in verdict.items() if ok})
    backend = "apex.normalization" if apex_normalization is not None else f"torch ({no_apex})"
    say("meshboost: enable_fused_normalization -> backend %s: %s%s%s", backend,
         ", ".join(f"{n} norms on {label}" for label, n in on.items()) or "no norm swapped",
         "" if apex_normalization is not None else "; LayerNorm is torch's fused kernel already",
         (f"; kept, the fused kernels differ from their numbers: {kept}" if kept else "")
         + (f"; kept {hooked} carrying module hooks" if hooked else ""))
    return len(swaps)


# -- enable_jit_fused ----------------------------------------------------------------------------

# Where the activation modules live whose forward may be a pointwise chain worth compiling.
_ACTIVATION_HOMES = ("transformers.activations", "torch.nn.modules.activation")
# Probe tolerances (rtol, atol) against the eager module, on top of eager's own error: fp32 round-off of
# terms near 1 (where GELU's 1 + tanh cancels, inductor's tanh gives 0 and ATen's 1e-7, a few 1e-6 in
# the gradient); bf16 two units in the last place (the compiled chain rounds once, eager after each op).
_CHAIN_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


class JitFusedActivation(nn.Module):
    """Stands in for a parameterless activation module: `run(x)` is a `torch.compile`d function (dynamic
    shapes) calling one private instance of the activation, one per kind, so the modules of a kind share
    one compiled function and dynamo never sees, guards on or recompiles for each instance."""

    def __init__(self, run, replaces: str):
        super().__init__()
        self.run, self.replaces = run, replaces

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.run(hidden_states)

    def extra_repr(self) -> str:
        return f"{self.replaces}, torch.compile'd"


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, arg_types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _activation_kind(module: nn.Module):
    """(class, settings) of a parameterless, bufferless activation module of `_ACTIVATION_HOMES` whose
    settings are plain values (GELUActivation's choice of function, nn.GELU's `approximate`), else None.
    The modules of one kind compute the same function."""
    cls = type(module)
    if cls.__module__ not in _ACTIVATION_HOMES or any(True for _ in module.children()) \
            or any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return None
    settings = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        if callable(value):
            value = getattr(getattr(value, "__func__", value), "__qualname__", repr(value))
        elif not isinstance(value, (bool, int, float, str, type(None))):
            return None
        settings.append((key, value))
    return cls, tuple(settings)


def _why_not_a_chain(module: nn.Module, x: torch.Tensor) -> str | None:
    """None when `module` runs a chain of pointwise ops on `x` (several ops, each element computed from
    its own input alone), else why compiling it is not worth it or not safe."""
    counter, probe = _OpCounter(), x.clone()
    try:
        with torch.no_grad():
            with counter:
                y = module(probe)
            perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0)).to(x.device)
            shuffled = module(x.flatten()[perm].view_as(x))
    except Exception as e:                  # not a one-tensor function
        return f"probe failed: {type(e).__name__}"
    if counter.ops < 2:
        return "one kernel already"
    if y.shape != x.shape or not torch.allclose(shuffled.flatten(), y.flatten()[perm], rtol=1e-6, atol=1e-6):
        return "not pointwise"
    return None


def _compiled_matches(module: nn.Module, run, x: torch.Tensor) -> bool:
    """fp32 and bf16: the compiled function's output and input gradient equal the eager module's within
    the tolerance plus eager's own rounding error (its distance from the fp64 result): where bf16 eager
    rounds 1 + tanh to 0, the compiled chain, rounding once, is nearer the exact value, not wrong."""
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device)

    def output_and_grad(fn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        leaf = x.detach().to(dtype).clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad_out.to(dtype))
        return out.detach(), leaf.grad

    exact = output_and_grad(module, torch.float64)
    for dtype, (rtol, atol) in _CHAIN_TOLERANCE.items():
        if dtype == torch.bfloat16 and x.is_cuda and not torch.cuda.is_bf16_supported():
            continue                        # a GPU without bf16 (V100) would refuse fp32 use too
        want, got = output_and_grad(module, dtype), output_and_grad(run, dtype)
        if got[0].dtype != want[0].dtype or got[0].shape != want[0].shape or got[1] is None:
            return False
        for g, w, e in zip(got, want, exact):
            g, w = g.double(), w.double()
            if ((g - w).abs() > atol + rtol * w.abs() + (w - e).abs()).any():
                return False
    return True


def _compile_kind(template: nn.Module):
    """`torch.compile` (dynamic shapes) a free function calling `template`, on tensors. Each kind gets a
    code object of its own, named after it: dynamo keeps its cache and recompile limit (8) per code
    object, which one shared function would spend across kinds, dtypes and grad modes, then silently run
    eager. (Compiling the class's forward instead gave the same kernels but ran them at half speed on
    2 threads here, for reasons not found.)"""
    def pointwise(hidden_states: torch.Tensor) -> torch.Tensor:
        return template(hidden_states)
    code = pointwise.__code__.replace(co_name=f"jit_fused_{type(template).__name__}")
    return torch.compile(types.FunctionType(code, pointwise.__globals__, code.co_name, None, pointwise.__closure__),
                         dynamic=True)


def _compile_probe(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * x + 1.0


def _why_no_compiler(device: torch.device) -> str | None:
    """None when torch.compile (inductor) compiles and runs a small pointwise function on `device`, else
    why not: no C++ compiler (CPU) or Triton (CUDA), a platform or torch build without inductor."""
    try:
        torch.compile(_compile_probe, dynamic=True)(torch.randn(2, 3, device=device))
    except Exception as e:                  # InductorError, BackendCompilerFailed, RuntimeError, ImportError
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return None


def jit_fuse(model: nn.Module, device_type: str) -> int:
    """Swap every activation module whose forward is a chain of pointwise ops (GPT-2's NewGELU tanh
    chain, a Python GELU, QuickGELU) for a `JitFusedActivation` running that forward `torch.compile`d
    with dynamic shapes, forward and backward each one fused kernel. Each kind is probed once (fp32 and
    bf16, output and gradient) and kept when the numbers differ; a single-op activation (F.gelu,
    SiLU) is one kernel already and stays. Falls back to eager, swapping nothing, when torch.compile
    cannot run here. Returns how many modules were swapped."""
    device = torch.device(device_type)
    # The probe compiles first, and inductor sizes its kernels from the first sizes it sees (a CPU loop
    # runs on several threads only above 512 elements a thread): probe at a training-like size.
    x = (torch.randn(4, 64, 1024, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    places: dict[tuple, list] = {}          # kind -> [(path, module)], a shared module under each path
    hooked = 0
    for name, module in model.named_modules(remove_duplicate=False):
        kind = _activation_kind(module)
        if kind is None:
            continue
        if _hooked(module):
            hooked += 1
            continue
        places.setdefault(kind, []).append((name, module))
    why_kept = {kind: _why_not_a_chain(found[0][1], x) for kind, found in places.items()}
    chains = [kind for kind, why in why_kept.items() if why is None]
    no_compiler = _why_no_compiler(device) if chains else None
    if no_compiler:
        say("meshboost: enable_jit_fused -> eager: torch.compile cannot run here (%s); %d activation modules "
             "(%s) stay eager", no_compiler, sum(len(places[k]) for k in chains),
             ", ".join(sorted({k[0].__name__ for k in chains})))
        return 0
    runs = {}
    for kind in chains:
        template = copy.deepcopy(places[kind][0][1])
        run = _compile_kind(template)
        try:
            matches = _compiled_matches(template, run, x)
        except Exception as e:              # a kind inductor cannot compile
            why_kept[kind] = f"compile failed: {type(e).__name__}"
            continue
        why_kept[kind] = None if matches else "compiled numbers differ"
        if matches:
            runs[kind] = run
    fused: dict[int, JitFusedActivation] = {}
    for kind, run in runs.items():
        for name, module in places[kind]:
            stand_in = fused.setdefault(id(module), JitFusedActivation(run, kind[0].__name__))
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, stand_in)
    kept = sorted(f"{k[0].__name__} x{len(places[k])} ({why})" for k, why in why_kept.items() if why is not None)
    say("meshboost: enable_jit_fused -> %d activation modules on torch.compile'd kernels (inductor, dynamic "
         "shapes): %s%s%s; bias, dropout and residual adds are not reached (the linears and the models' forwards "
         "hold them)", len(fused),
         ", ".join(f"{k[0].__name__} x{len(places[k])}" for k in runs) or "none",
         f"; kept: {', '.join(kept)}" if kept else "", f"; kept {hooked} carrying module hooks" if hooked else "")
    return len(fused)
