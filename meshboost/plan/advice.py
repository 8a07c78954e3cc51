"""What to change when no layout fits: the smallest layout's need and the single changes that fit.

Owns `nothing_fits(planner, estimates)`: the layout needing the least device memory, what it needs
(the bytes `fits` compares with the device, as GiB of --memory-gb), and each single change of it
(full or selective activation checkpointing, the chunked loss, a smaller micro-batch, twice the
pipeline stages or context-parallel ranks in place of data-parallel ones, ZeRO-3, cpu offload of the
masters and moments, ZeRO-1's from a layout without ZeRO) that lowers what it needs, with the planner's
own estimate of the changed layout, those that fit first; last resort, the --memory-gb that would fit
it. Must not estimate anything itself: every figure is `Planner.explain`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshboost.shardformer.selective import FULL, SELECTIVE

GIB = 2 ** 30
ADVISED_LOSS_CHUNK = 1024       # tokens per chunk of the loss advised (docs/optimizations.md's example)


def needed_bytes(planner, estimate) -> float:
    """The device memory `estimate` needs to fit (what `fits` compares with --memory-gb)."""
    from meshboost.plan.peak import needed_bytes as needed

    return needed(estimate.memory_bytes_per_rank)


@dataclass
class Advice:
    smallest: object                       # the Estimate needing the least memory
    changes: list                          # [(what to change, the changed layout's Estimate)], fitting first

    def need_gib(self, planner) -> float:
        return needed_bytes(planner, self.smallest) / GIB

    def lines(self, planner) -> list[str]:
        need = self.need_gib(planner)
        out = [f"no layout fits {planner.gpus} devices of {planner.memory_bytes / GIB:g} GiB; the smallest, "
               f"{self.smallest.layout.describe()}, needs {need:.2f} GiB per device "
               f"(allocated peak {self.smallest.memory_bytes_per_rank['peak'] / GIB:.2f} GiB at its "
               f"{self.smallest.memory_bytes_per_rank['instant']}, {planner.device})"]
        for what, e in self.changes:
            out.append(f"  {what:44s} -> {e.layout.describe()}: needs {needed_bytes(planner, e) / GIB:.2f} GiB"
                       f" ({(needed_bytes(planner, e) / GIB - need):+.2f}){'  fits' if e.fits else ''}")
        return out

    def fix(self, planner) -> str:
        """The one change to make: the fastest single change that fits, else more device memory."""
        fitting = [(what, e) for what, e in self.changes if e.fits]
        if fitting:
            what, e = min(fitting, key=lambda c: c[1].step_seconds)
            return f"{what} ({e.layout.describe()}: --layout {e.layout.describe()})"
        need = self.need_gib(planner)
        return (f"no single layout change fits; devices of {need:.1f} GiB (--memory-gb {need:.1f}), more --gpus, "
                "a shorter --seq or a smaller model")


def _changes(planner, layout) -> list[tuple[str, object]]:
    """(what, changed layout) for each single change that could lower the peak."""
    out = []
    if layout.checkpointing != FULL:
        out.append(("activation checkpointing", replace(layout, checkpointing=FULL)))
    if not layout.checkpointing:
        out.append(("selective recomputation (ckpt=selective)", replace(layout, checkpointing=SELECTIVE)))
    if layout.loss_chunk is None:           # refused (no advice) where the model's loss cannot be chunked
        chunk = min(ADVISED_LOSS_CHUNK, layout.microbatch_size * planner.seq)
        out.append((f"chunked loss (loss_chunk={chunk})", replace(layout, loss_chunk=chunk)))
    if layout.microbatch_size > 1:
        size = layout.microbatch_size // 2 if layout.microbatch_size % 2 == 0 else 1
        out.append((f"micro-batches of {size}", replace(
            layout, microbatch_size=size, microbatches=layout.microbatches * layout.microbatch_size // size)))
    if layout.dp % 2 == 0:
        m = layout.microbatches * 2
        out.append((f"pp={2 * layout.pp} in place of dp={layout.dp}", replace(
            layout, dims=replace(layout.dims, pp=2 * layout.pp, dp=layout.dp // 2, ep=1), microbatches=m)))
        if planner.context_parallel_ok:
            out.append((f"context parallelism cp={2 * layout.cp} in place of dp={layout.dp}", replace(
                layout, dims=replace(layout.dims, cp=2 * layout.cp, dp=layout.dp // 2, ep=1, sequence_parallel=False,
                                     cp_mode=None if layout.cp == 1 else layout.cp_mode), microbatches=m)))
    if layout.zero != 3:
        out.append(("zero=3 (FSDP2)", replace(layout, dims=replace(layout.dims, ep=1), zero=3, cpu_offload=False)))
    if not layout.cpu_offload and layout.zero != 3:       # ZeRO-1/2's offload (from zero=0: ZeRO-1's)
        out.append(("cpu offload of masters and moments" + ("" if layout.zero else " (zero=1)"),
                    replace(layout, cpu_offload=True, zero=layout.zero or 1)))
    return out


def nothing_fits(planner, estimates) -> Advice:
    """Advice for `planner` when none of `estimates` (every valid layout, fitting or not) fits."""
    smallest = min(estimates, key=lambda e: e.memory_bytes_per_rank["peak"])
    need = needed_bytes(planner, smallest)
    tried = []
    for what, layout in _changes(planner, smallest.layout):
        try:
            changed = planner.explain(layout)
        except (ValueError, NotImplementedError, TypeError):
            continue                        # a change the model or the plugin refuses is no advice
        if needed_bytes(planner, changed) < need:       # a change that saves nothing is no advice either
            tried.append((what, changed))
    tried.sort(key=lambda c: (not c[1].fits, c[1].memory_bytes_per_rank["peak"]))
    return Advice(smallest, tried)
