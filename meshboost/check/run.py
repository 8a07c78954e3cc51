"""Running a layout on the shrunk model against one process, and the verdict per layer type.

Owns: the spawned body (`run_cases`, `run_layout`: the world the layout's degrees multiply to, gloo on
CPU, fp32), the batch, the one-process reference from the same weights and batch, and
`compare` (the comparison of loss and gradients, grouped by the module type that owns each parameter:
the child of a layer-list entry, `Qwen3MoeSparseMoeBlock (mlp)`, or, outside the layer lists, the owning
module, `Embedding (embed_tokens)`). The gradient a layout applied is read back from the weights after one
SGD step of rate 1 (`(before - after) / LR`), whole (tp, ep, FSDP2 shards gathered), which holds for every
optimizer wrapper and ZeRO stage alike. Must not shrink configs (shrink.py) or print (__main__.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import torch

from meshboost.testing.tolerance import TOLERANCE

LR = 1.0
LOSS_RTOL = 2e-5
EXACT, REFUSED, WRONG, NOT_RUN = "exact", "refused", "wrong", "not run"


def group_of(model, name: str) -> str:
    """The layer type a parameter belongs to: the child of a layer-list entry that holds it
    (`LlamaAttention (self_attn)`), else its owning module (`Embedding (embed_tokens)`)."""
    parts = name.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit() and i + 1 < len(parts):
            path = ".".join(parts[:i + 2])
            return f"{type(model.get_submodule(path)).__name__} ({parts[i + 1]})"
    owner = model.get_submodule(".".join(parts)) if parts else model
    return f"{type(owner).__name__} ({parts[-1] if parts else name})"


def compare(got: dict, want: dict, groups: dict) -> dict:
    """{group: (verdict, detail)}: exact where every gradient of the group in `want` has its `got` within
    the fp32 tolerance (a name no rank applied a gradient to is wrong), else wrong with the largest
    difference and the parameter it is in. got, want: {name: tensor}; groups: {name: group}."""
    rtol, atol = TOLERANCE[torch.float32]
    worst: dict = {}
    for name in sorted(set(got) - set(want)):       # no gradient on one process: at most a zero one here
        if got[name].abs().max().item() > atol:
            worst[groups[name]] = (True, float("inf"), name, "only")
    for name, w in want.items():
        g = got.get(name)
        group = groups[name]
        if g is None or g.shape != w.shape:
            diff, bad = float("inf"), True
        else:
            err = (g.double() - w.double()).abs()
            diff, bad = err.max().item(), bool((err > atol + rtol * w.double().abs()).any())
        best = worst.get(group)
        if best is None or (bad, diff) > (best[0], best[1]):
            worst[group] = (bad, diff, name, "missing" if g is None or g.shape != w.shape else "")
    out = {}
    for group, (bad, diff, name, how) in sorted(worst.items()):
        if not bad:
            out[group] = (EXACT, f"max |grad diff| {diff:.1e}")
        elif how == "only":
            out[group] = (WRONG, f"{name}: a gradient only in this layout (none on one process)")
        elif how:
            out[group] = (WRONG, f"{name}: no gradient applied (or a shape changed)")
        else:
            out[group] = (WRONG, f"max |grad diff| {diff:.3g} in {name}")
    return out


def batch_for(config, rows: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_cases(rank: int, world: int, cases: list, out: str) -> None:
    """The spawned body: for each (shrunk config, plan.Layout) of `cases` (layouts of this world), rank 0
    writes {"loss": (verdict, detail), "groups": {group: (verdict, detail)}} to the JSON list in `out`."""
    import warnings

    import torch.distributed as dist
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    results = [run_layout(config, layout) for config, layout in cases]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()


def run_layout(config, layout) -> dict:
    """One case of `run_cases`, on every rank: the reference, the layout's step, the verdicts."""
    from meshboost.plan.model import model_class

    rows = layout.dp * layout.microbatches * layout.microbatch_size
    seq = 16 * layout.cp * (layout.tp if layout.sequence_parallel else 1)
    torch.manual_seed(0)
    try:
        ref = model_class(config)._from_config(copy.deepcopy(config)).float()
        par = copy.deepcopy(ref)
        batch = batch_for(config, rows, seq)
        before = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        ref_loss = ref(**batch).loss
        ref_loss.backward()
    except Exception as e:  # noqa: BLE001 - not meshboost's: the shrunk model does not run on one process
        return {"loss": (NOT_RUN, f"the shrunk model does not run on one process: {_first_line(e)}"), "groups": {}}
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    first = {}
    for n, p in ref.named_parameters(remove_duplicate=False):      # a tied weight's names: its first one
        first.setdefault(id(p), n)
    canonical = {n: first[id(p)] for n, p in ref.named_parameters(remove_duplicate=False)}
    groups = {n: group_of(ref, n) for n in canonical.values()}
    return _sharded(par, layout, batch, (before, want, groups, canonical), ref_loss.item())


def _sharded(par, layout, batch: dict, reference: tuple, ref_loss: float) -> dict:
    """Boost `par` under the layout, one step, and the verdicts (every rank; the gradient check gathers).
    reference: (weights before, one process's gradients, groups, each name's canonical name)."""
    before, want, groups, canonical = reference
    import torch.distributed as dist

    from meshboost.booster import Booster
    from meshboost.plan.layout import plugin_config
    from meshboost.plugins import HybridParallelPlugin
    from meshboost.shardformer.regions import SequenceLayoutError
    from meshboost.shardformer.sharder import UncoveredParameterError
    from meshboost.testing.sharded_training import dp_step, whole_weights

    try:
        plugin = HybridParallelPlugin(plugin_config(replace(layout, precision="fp32")))
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
    except (ValueError, TypeError, NotImplementedError) as e:
        return _refused(e, groups)
    try:
        loss = dp_step(booster, plugin, model, opt, batch)
        opt.step()
    except (UncoveredParameterError, SequenceLayoutError) as e:        # refused at the first call
        return _refused(e, groups, "at the first call: ")
    except Exception as e:  # noqa: BLE001 - accepted, then broke: a defect, never a silent pass
        return {"loss": (WRONG, f"the step crashed: {_first_line(e)}"), "groups": {}}
    applied = {n: (before[n] - w) / LR for n, w in whole_weights(model).items() if n in before}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, applied)
    got = worst_copies(everyone, want, canonical)
    ok = abs(loss - ref_loss) <= LOSS_RTOL * max(abs(ref_loss), 1e-6)
    return {"loss": (EXACT if ok else WRONG, f"{loss:.6f} vs one process's {ref_loss:.6f}"),
            "groups": compare(got, want, {n: groups.get(n, "other") for n in {*want, *got}})}


def worst_copies(parts: list, want: dict, canonical: dict) -> dict:
    """One tensor per name from every rank's {name: applied gradient} (data-parallel replicas and ZeRO ranks
    each hold a copy): the one furthest from `want` (a replica that diverged is not hidden by one that did
    not), names under their canonical (first tied) name."""
    def distance(name, t):
        w = want.get(name)
        if w is None:
            return t.abs().max().item()
        return float("inf") if t.shape != w.shape else (t.double() - w.double()).abs().max().item()
    got: dict = {}
    for part in parts:
        for name, t in part.items():
            name = canonical.get(name, name)
            if name not in got or distance(name, t) > distance(name, got[name]):
                got[name] = t
    return got


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:300]


def _refused(e: Exception, groups: dict, where: str = "") -> dict:
    message = where + _first_line(e)
    return {"loss": (REFUSED, message), "groups": {g: (REFUSED, message) for g in sorted(set(groups.values()))}}
