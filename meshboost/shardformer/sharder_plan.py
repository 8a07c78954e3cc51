"""The sharder's plan: what `ShardFormer.validate` decides before anything is modified (every module a
policy entry matched, with every path it is reached by; the parameter styles; the attribute values; the
split-input guards; sequence parallelism's layer list and gathering blocks) and the pure questions that
decide it (is a block closed, does it hold experts, which modules sit unguarded beside split activations).

Owns: `Match`, `ShardPlan` and those questions. Pure: reads modules, never changes one; sharder.py applies
the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.shardformer import sequence
from meshboost.shardformer.layers import is_conv1d
from meshboost.shardformer.regions import RegionPlan
from meshboost.shardformer.styles import BLOCK_INPUT, EXPERT_STYLES, SPLITTING_STYLES, ShardStyle


@dataclass
class Match:
    """One module a plan entry matched, with every path it is reached by (a module may be shared)."""

    module: nn.Module
    paths: list[str]
    style: ShardStyle
    args: tuple[int, ...]


@dataclass
class ShardPlan:
    """Everything `_apply` will do, decided by `validate` (the dry run: pure, nothing modified) before anything is modified."""

    matches: list[Match]
    attributes: list[tuple[nn.Module, str, object]] = field(default_factory=list)   # (module, attr, value)
    embedding_paths: list[list[str]] = field(default_factory=list)    # per module: every path to it
    head_paths: list[list[str]] = field(default_factory=list)
    guards: list[tuple[str, nn.Module]] = field(default_factory=list)      # see split_input_guard
    seq_stack: str | None = None        # sequence parallelism: the layer list's path (base-relative)
    seq_stack_full: str | None = None   # ... and from the model's root
    seq_blocks: list[tuple[str, nn.Module]] = field(default_factory=list)   # see sequence_blocks
    regions: RegionPlan = field(default_factory=RegionPlan)    # the block regions; every linear's role
    params: list[tuple[str, nn.Parameter, ShardStyle, tuple]] = field(default_factory=list)   # parameter styles
    adapters: list[nn.Module] = field(default_factory=list)   # peft LoRA layers whose base the plan shards


def module_paths(root: nn.Module, target: nn.Module) -> list[str]:
    """Every path under `root` that reaches `target` (T5's shared embedding has three)."""
    return [name for name, module in root.named_modules(remove_duplicate=False) if module is target]


def holders(root: nn.Module, params: list[torch.Tensor]) -> dict[int, tuple[nn.Module, list[str]]]:
    """Every module holding one of `params` as a parameter of its own, with all its paths."""
    wanted = {id(p) for p in params}
    out: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if any(id(p) in wanted for p in module._parameters.values() if p is not None):
            out.setdefault(id(module), (module, []))[1].append(name)
    return out


def closed_block(block: nn.Module, matched: dict) -> bool:
    """A block input may apply Megatron's f once for its children only when every linear inside the
    block is sharded by the plan and it holds no tensor-parallel experts: a linear left whole there,
    or an MoE block's router (whatever its class) beside its experts, also reads the block's input,
    and its input gradient must not be summed over tp. Otherwise each column-parallel child (and each
    experts module) applies f itself (more collectives, the same numbers). A norm inside an attention
    (OLMo2's whole-hidden q/k norm) reads a projection's output and leaves the block closed."""
    return all(id(m) in matched for m in block.modules() if isinstance(m, nn.Linear) or is_conv1d(m)) and \
        not holds_experts(block, matched)


def holds_experts(block: nn.Module, matched: dict) -> bool:
    """An MoE block: it holds tensor-parallel experts (under sequence parallelism it reads the chunk: sequence.py)."""
    return any(matched[id(m)].style.name in EXPERT_STYLES for m in block.modules() if id(m) in matched)


def split_input_guards(model: nn.Module, matches: list[Match], matched: dict) -> list[tuple[str, nn.Module]]:
    """Modules with parameters of their own that sit in a block whose column-parallel children split
    the activations, and that the plan does not cover (a learnable activation, a per-head norm).
    Fed a split activation, such a module would compute a partial gradient (or fail on shapes) on
    every rank; `split_input_guard` refuses that at its first call. Fed the whole hidden state (a
    layer norm before the projections, as in OPT's decoder layer) it is fine."""
    blocks = {p.rpartition(".")[0] for m in matches if m.style.name in SPLITTING_STYLES for p in m.paths[:1]}
    out, seen = [], set()
    for block_path in sorted(blocks):
        for name, sub in model.get_submodule(block_path).named_modules():
            if id(sub) not in matched and id(sub) not in seen and any(True for _ in sub.parameters(recurse=False)):
                seen.add(id(sub))
                out.append((f"{block_path}.{name}", sub))
    return out


def sequence_blocks(model: nn.Module, plan: ShardPlan, matched: dict) -> list[tuple[str, nn.Module]]:
    """Under sequence parallelism, each module holding column-parallel linears (an attention, an MLP; or
    sharded by a block style) in the stack's layers that is not a block input gathers its input at entry:
    HF attention code views its projections by its input's sequence length, which must be the whole one.
    Its linears must all be sharded (a whole router would read the gathered input: gradient wrong)."""
    blocks = {p for m in plan.matches if m.style.name == BLOCK_INPUT for p in m.paths}
    stack = plan.seq_stack_full
    out = []
    parents = sorted({p if m.style.block else p.rpartition(".")[0] for m in plan.matches
                      if m.style.block or m.style.name.startswith("colwise")
                      for p in m.paths if p.startswith(stack + ".")})
    for path in parents:
        if path in blocks or any(path.startswith(b + ".") for b in blocks) or path.count(".") <= stack.count(".") + 1:
            continue        # already a block input, inside one, or the layer itself (its columns gather alone)
        module = model.get_submodule(path)
        if not closed_block(module, matched):
            raise ValueError(f"{path} ({type(module).__name__}): under sequence parallelism it gathers its input once, "
                             "but it holds a linear the plan leaves whole (a router), whose gradient would then be "
                             "wrong; use enable_sequence_parallelism=False for this model")
        out.append((path, module))
    return out


def plan_sequence(model: nn.Module, base: nn.Module, plan: ShardPlan, policy, by_module: dict, covered: dict,
                  full: Callable[[str], str], tp_size: int) -> None:
    """Sequence parallelism's part of the plan: the layer list it splits, and the blocks that gather their
    input once (a block whose linears are not all sharded cannot; an MoE block reads the chunk: sequence.py)."""
    sequence.check_model(model, tp_size)
    plan.seq_stack = sequence.stack_path(model, policy.pipeline_layout)
    try:
        stack = base.get_submodule(plan.seq_stack)
    except AttributeError:
        stack = None
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: {plan.seq_stack!r} is not the model's layer list "
                         "(nn.ModuleList), which sequence parallelism splits")
    plan.seq_stack_full = full(plan.seq_stack)
    unclosed = [m.paths[0] for m in by_module.values() if m.style.name == BLOCK_INPUT    # MoE blocks: below
                and not closed_block(m.module, covered) and not holds_experts(m.module, covered)
                and m.paths[0].startswith(plan.seq_stack_full + ".")]
    if unclosed:
        raise ValueError(f"{unclosed[0]}: a block whose linears are not all sharded cannot gather its input "
                         "once under sequence parallelism; use enable_sequence_parallelism=False for it")
    plan.seq_blocks = sequence_blocks(model, plan, covered)
