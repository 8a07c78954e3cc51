"""PipelineConfig: the pipeline knobs of HybridParallelPlugin (micro-batches and schedule), checked when
built, and `check(pp)`, their checks against the layout's pipeline degree, which lives only in the layout
record (`ParallelDims.pp`); the plugin's config calls it where the two meet, before any collective. How
they combine with ZeRO is the plugin's decision (`meshboost.plugins.config`)."""

from __future__ import annotations

import logging
from dataclasses import InitVar, dataclass, field

PP_STYLES = ("1f1b", "interleaved")


@dataclass
class PipelineConfig:
    """How the model is split into stages and how a step is scheduled; the number of stages, pp, is the
    layout record's (`HybridParallelConfig(pp_size=...)`, `ParallelDims(pp=...)`).

    pp_style: "1f1b" (one chunk per rank) or "interleaved" (num_model_chunks > 1 chunks per rank).
    num_model_chunks: model chunks per rank; the model has pp x num_model_chunks stages.
    num_microbatches / microbatch_size: how a batch is split; at least one is required with pp (ignored,
        with a warning, without one, as ColossalAI does). Both may be given (ColossalAI's scripts do): then
        every batch must hold num_microbatches x microbatch_size samples, checked at each batch.
    num_layers_per_stage: layers per stage (pp x num_model_chunks entries), else even split.
    """

    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    num_layers_per_stage: list[int] | None = None
    # the pipeline degree is the layout record's: given here, refused with the fix
    pp_size: InitVar[int | None] = field(default=None, kw_only=True)

    def __post_init__(self, pp_size):
        if pp_size is not None:
            raise TypeError(f"PipelineConfig(pp_size={pp_size!r}): the pipeline degree is the layout record's, "
                            f"set once: pass HybridParallelConfig(pp_size={pp_size!r}, pipeline=PipelineConfig("
                            "num_microbatches=...)) or dims=ParallelDims(pp=...)")
        if self.pp_style not in PP_STYLES:
            hint = (" (the pipeline degree is HybridParallelConfig(pp_size=...), no longer PipelineConfig's first "
                    "argument)" if isinstance(self.pp_style, int) else "")
            raise ValueError(f"pp_style={self.pp_style!r}; expected one of {PP_STYLES}{hint}")
        if not isinstance(self.num_model_chunks, int) or self.num_model_chunks < 1:
            raise ValueError(f"num_model_chunks={self.num_model_chunks!r} must be a positive integer")

    def check(self, pp: int) -> None:
        """These knobs against the layout's pipeline degree `pp` (pure: the same error on every rank)."""
        if pp == 1:
            if self.num_model_chunks != 1 or self.num_layers_per_stage is not None or self.pp_style != "1f1b":
                raise ValueError("pp_style, num_model_chunks and num_layers_per_stage only apply with pp_size > 1")
            if self.num_microbatches is not None or self.microbatch_size is not None:
                # ColossalAI ignores them without a pipeline, and its guide passes microbatch_size=1 so
                logging.getLogger("meshboost.pipeline").warning(
                    "meshboost: num_microbatches=%s / microbatch_size=%s ignored: they only apply with pp_size > 1",
                    self.num_microbatches, self.microbatch_size)
            return
        if self.pp_style == "1f1b" and self.num_model_chunks != 1:
            raise ValueError(f"num_model_chunks={self.num_model_chunks} needs pp_style='interleaved' "
                             "(pp_style='1f1b' runs one chunk per rank)")
        if self.pp_style == "interleaved" and self.num_model_chunks < 2:
            raise ValueError("pp_style='interleaved' needs num_model_chunks >= 2 (e.g. num_model_chunks=2)")
        given = [n for n in ("num_microbatches", "microbatch_size") if getattr(self, n) is not None]
        if not given:
            raise ValueError(f"pp_size={pp} needs num_microbatches or microbatch_size (got neither), "
                             "e.g. PipelineConfig(num_microbatches=4)")
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        stages = self.num_stages(pp)
        if self.num_layers_per_stage is not None and len(self.num_layers_per_stage) != stages:
            raise ValueError(f"num_layers_per_stage={self.num_layers_per_stage} needs {stages} entries "
                             f"(pp_size x num_model_chunks = {pp} x {self.num_model_chunks})")

    def num_stages(self, pp: int) -> int:
        """The model's stages at pipeline degree `pp`: pp x num_model_chunks."""
        return pp * self.num_model_chunks
