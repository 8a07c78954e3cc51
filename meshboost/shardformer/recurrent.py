"""Recurrent mixers (Gated DeltaNet in Qwen3-Next, Mamba in Jamba, Nemotron-H, Falcon-H1, Bamba): which
modules of a model carry a state along the sequence, and the refusal of layouts that would cut that state.

Owns: finding these mixers structurally (a module holding its own `A_log`, the decay every Gated DeltaNet and
Mamba mixer learns; no family names), which of them a tp layout leaves whole (`whole_mixers`: the sweep's
report), and `refuse_context`: context parallelism runs each rank on a chunk of
the sequence, and a recurrent mixer run on a chunk starts from a zero state instead of the state the earlier
chunks leave, a silently wrong result, so it is refused until state passing between chunks is built.
Must not issue collectives (the checks are pure, so every rank raises alike before the first one).
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.distributed.param_info import is_tp_sharded

DECAY = "A_log"


def recurrent_mixers(model: nn.Module) -> list[str]:
    """The class names of `model`'s recurrent mixers, sorted, each once. Pure."""
    return sorted({type(m).__name__ for m in model.modules() if DECAY in m._parameters})


def whole_mixers(model: nn.Module) -> list[str]:
    """The class names of the recurrent mixers whose recurrence every tp rank runs over all heads: their
    per-head decay is not split (the projections may be, and gathered back), sorted, each once. Pure."""
    return sorted({type(m).__name__ for m in model.modules()
                   if DECAY in m._parameters and not is_tp_sharded(m._parameters[DECAY])})


def replicated_note(model: nn.Module) -> str:
    """What the sweep adds to an exact verdict when mixers stay whole ("" when none do): a model whose recurrence
    runs whole on every rank is "ok (replicated: ...)" in docs/models.md, never a plain "ok". Pure."""
    whole = whole_mixers(model)
    return f"replicated: {', '.join(whole)} whole on every rank" if whole else ""


def refuse_context(model: nn.Module, cp_size: int) -> None:
    """Raise, naming the mixers and the fix, when `model` has recurrent mixers. Pure."""
    mixers = recurrent_mixers(model)
    if mixers:
        raise NotImplementedError(f"cp_size={cp_size} (ColossalAI's sp_size): {type(model).__name__} has recurrent "
                                  f"mixers ({', '.join(mixers)}) whose state runs along the whole sequence; context "
                                  "parallelism does not pass that state between sequence chunks yet; use cp_size=1 "
                                  "(tp_size splits these models)")
