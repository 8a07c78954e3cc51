"""PipelineConfig: the pipeline knobs of HybridParallelPlugin, checked before any collective.
How they combine with ZeRO is the plugin's decision (`meshboost.plugins.config`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

PP_STYLES = ("1f1b", "interleaved")


@dataclass
class PipelineConfig:
    """How the model is split into stages and how a step is scheduled.

    pp_size: number of pipeline stages (ranks along the pp axis).
    pp_style: "1f1b" (one chunk per rank) or "interleaved" (num_model_chunks > 1 chunks per rank).
    num_model_chunks: model chunks per rank; the model has pp_size * num_model_chunks stages.
    num_microbatches / microbatch_size: how a batch is split; at least one is required with pp (ignored,
        with a warning, without one, as ColossalAI does). Both may be given (ColossalAI's scripts do): then
        every batch must hold num_microbatches x microbatch_size samples, checked at each batch.
    num_layers_per_stage: layers per stage (pp_size * num_model_chunks entries), else even split.
    """

    pp_size: int = 1
    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    num_layers_per_stage: list[int] | None = None

    def __post_init__(self):
        if not isinstance(self.pp_size, int) or self.pp_size < 1:
            raise ValueError(f"pp_size={self.pp_size!r} must be a positive integer")
        if self.pp_style not in PP_STYLES:
            raise ValueError(f"pp_style={self.pp_style!r}; expected one of {PP_STYLES}")
        if not isinstance(self.num_model_chunks, int) or self.num_model_chunks < 1:
            raise ValueError(f"num_model_chunks={self.num_model_chunks!r} must be a positive integer")
        if self.pp_size == 1:
            if self.num_microbatches is not None or self.microbatch_size is not None:
                # ColossalAI ignores them without a pipeline, and its guide passes microbatch_size=1 so
                logging.getLogger("meshboost.pipeline").warning(
                    "meshboost: num_microbatches=%s / microbatch_size=%s ignored: they only apply with pp_size > 1",
                    self.num_microbatches, self.microbatch_size)
            if self.num_model_chunks != 1 or self.num_layers_per_stage is not None or self.pp_style != "1f1b":
                raise ValueError("pp_style, num_model_chunks and num_layers_per_stage only apply with pp_size > 1")
            return
        if self.pp_style == "1f1b" and self.num_model_chunks != 1:
            raise ValueError(f"num_model_chunks={self.num_model_chunks} needs pp_style='interleaved' "
                             "(pp_style='1f1b' runs one chunk per rank)")
        if self.pp_style == "interleaved" and self.num_model_chunks < 2:
            raise ValueError("pp_style='interleaved' needs num_model_chunks >= 2 (e.g. num_model_chunks=2)")
        given = [n for n in ("num_microbatches", "microbatch_size") if getattr(self, n) is not None]
        if not given:
            raise ValueError(f"pp_size={self.pp_size} needs num_microbatches or microbatch_size (got neither), "
                             "e.g. num_microbatches=4")
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_layers_per_stage is not None and len(self.num_layers_per_stage) != self.num_stages:
            raise ValueError(f"num_layers_per_stage={self.num_layers_per_stage} needs {self.num_stages} entries "
                             f"(pp_size x num_model_chunks = {self.pp_size} x {self.num_model_chunks})")

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_model_chunks
