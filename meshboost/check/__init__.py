"""meshboost.check: the pre-flight check of a user's own model at one layout, on one machine's CPU.

Owns the package's entry `check(model, layout)` (also `python -m meshboost.check`): the user's config read
as the planner reads it (`plan.model.load_config`: an HF folder, a config.json, or a model type), the
layout parsed by the planner's parser (`plan.parse_layout`), a shrunk copy of the config (shrink.py)
run at that layout against one process (run.py), and the planner's memory per rank for the REAL config
at the layout. The top floor: it may import plan/ and testing/; nothing imports it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace

from meshboost.check.shrink import shrink

__all__ = ["check", "Report", "layout_for", "shrink"]


@dataclass
class Report:
    """What `check` found: the shrink's lines, the loss's and each layer type's (verdict, detail), the planner's
    line."""

    shrunk: list[str]
    loss: tuple
    groups: dict
    planner: str
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = list(self.shrunk)
        verdict, detail = self.loss
        if verdict in ("refused", "not run") or not self.groups:
            return out + [f"{verdict}: {detail}", self.planner]
        out.append(f"loss: {verdict} ({detail})")
        out += [f"{g}: {v}" + (f" ({d})" if d else "") for g, (v, d) in self.groups.items()]
        return out + [self.planner]


def layout_for(text: str):
    """The Layout of `--layout` text (the planner's parser): dp 1 unless named, at least pp micro-batches."""
    from meshboost.plan.layout import layout_fields, parse_layout

    layout = parse_layout(text)
    if layout.pp > 1 and "microbatches" not in layout_fields(text):
        layout = replace(layout, microbatches=layout.pp * layout.num_model_chunks)
    return layout


def planner_line(config, layout, seq: int, memory_gb: float) -> str:
    """The planner's predicted memory per rank for `config` (the real one) at `layout`, or why it cannot say."""
    from meshboost.plan import Planner
    from meshboost.plan.planner import GIB

    try:
        planner = Planner(config, gpus=layout.world, seq=seq, memory_gb=memory_gb, precision=layout.precision,
                          global_batch=layout.dp * layout.microbatches * layout.microbatch_size)
        e = planner.explain(layout)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return f"planner: cannot estimate {layout.describe()}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    m = e.memory_bytes_per_rank
    kinds = ", ".join(f"{k} {m[k] / GIB:.2f}" for k in ("weights", "gradients", "optimizer_states", "masters",
                                                         "activations") if k in m)
    return (f"planner (real size, {layout.describe()}, seq {seq}): peak {m['peak'] / GIB:.2f} GiB per rank "
            f"({kinds}); fits {memory_gb:g} GiB: {'yes' if e.fits else 'no'}")


def check(model, layout: str, overrides: dict | None = None, seq: int = 2048, memory_gb: float = 80.0,
          max_world: int = 16) -> Report:
    """Run `layout` ('tp=2,pp=2,ep=2,...') on a shrunk copy of `model` (an HF folder, config.json, model
    type or transformers config) against one process; the planner's line for the real size. A layout of
    more than `max_world` processes is refused (each is a process on this machine's CPU)."""
    from meshboost.check.run import run_cases
    from meshboost.plan.model import load_config, model_class
    from meshboost.testing.spawn import spawn

    config = load_config(model, overrides)
    cls = model_class(config)
    if not cls.__name__.endswith("ForCausalLM"):
        raise ValueError(f"{type(config).__name__} builds {cls.__name__}: meshboost.check runs causal LMs "
                         "(a *ForCausalLM class) only")
    parsed = layout_for(layout)
    if parsed.world > max_world:
        raise ValueError(f"--layout {layout}: {parsed.world} processes, more than --max-world {max_world} on this "
                         "machine's CPU; check a smaller dp (the splits per rank stay the same) or raise --max-world")
    small, lines = shrink(config, parsed)
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "verdict.json")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""         # the check runs on CPU (gloo) on any machine
        try:
            spawn(run_cases, parsed.world, [(small, parsed)], out)
        finally:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        import json
        with open(out) as f:
            result = json.load(f)[0]
    return Report(lines, tuple(result["loss"]), {g: tuple(v) for g, v in result["groups"].items()},
                  planner_line(config, parsed, seq, memory_gb))
