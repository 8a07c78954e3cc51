"""PipelineStageManager: ColossalAI's "which pipeline stage am I" interface, read from a mesh.

Owns: stage / num_stages, first- and last-stage questions (with interleaved chunks), the
neighbouring stages' ranks and the layer ranges of a given split. Must not schedule anything or
build groups: meshboost's schedule (meshboost/pipeline) runs the stages; this only answers.
"""

from __future__ import annotations

import contextlib
import itertools

import torch.distributed as dist

from meshboost.cluster.process_group_mesh import ProcessGroupMesh


class PipelineStageManager:
    """Stage questions about `pg_mesh` along `pipeline_axis` (1 in meshboost's (dp, pp, tp) mesh).

    With interleaving each rank holds `num_model_chunks` chunks; `model_chunk_id` is the chunk a
    caller is asking about (set with `switch_model_chunk_id`); left None, the first/last-stage
    questions are about the device, as with `ignore_chunk=True` (ColossalAI raises instead).
    """

    def __init__(self, pg_mesh: ProcessGroupMesh, pipeline_axis: int = 1, enable_interleave: bool = False,
                 use_zbv: bool = False, num_model_chunks: int = 1, num_layers_per_stage: list[int] | None = None):
        if use_zbv:
            raise NotImplementedError("use_zbv=True: the zero-bubble V schedule is not in meshboost; use "
                                      "pp_style='1f1b' or 'interleaved'")
        if not enable_interleave and num_model_chunks != 1:
            raise ValueError(f"num_model_chunks={num_model_chunks} needs enable_interleave=True")
        self.pg_mesh = pg_mesh
        self.pipeline_axis = pipeline_axis
        self.is_interleave = enable_interleave
        self.use_zbv = False
        self.num_model_chunks = num_model_chunks
        self.model_chunk_id: int | None = None
        if num_layers_per_stage is not None and len(num_layers_per_stage) != self.num_stages * num_model_chunks:
            raise ValueError(f"num_layers_per_stage={num_layers_per_stage} needs num_stages x num_model_chunks = "
                             f"{self.num_stages * num_model_chunks} entries")
        self.num_layers_per_stage = num_layers_per_stage
        self.p2p_group = pg_mesh.get_group_along_axis(pipeline_axis)
        ranks = pg_mesh.get_ranks_in_group(self.p2p_group)
        self.prev_rank = ranks[(self.stage - 1) % self.num_stages]    # the first stage's is the last (a ring)
        self.next_rank = ranks[(self.stage + 1) % self.num_stages]

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (chunks not counted)."""
        return self.pg_mesh.size(self.pipeline_axis)

    @property
    def stage(self) -> int:
        """This rank's position along the pipeline axis."""
        return self.pg_mesh.coordinate(self.pipeline_axis)

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        if not self.is_interleave or ignore_chunk or self.model_chunk_id is None:
            return self.stage == 0
        return self.stage == 0 and self.model_chunk_id == 0

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        if not self.is_interleave or ignore_chunk or self.model_chunk_id is None:
            return self.stage == self.num_stages - 1
        return self.stage == self.num_stages - 1 and self.model_chunk_id == self.num_model_chunks - 1

    def get_rank(self) -> int:
        return dist.get_rank()

    def get_prev_rank(self) -> int:
        return self.prev_rank

    def get_next_rank(self) -> int:
        return self.next_rank

    def get_p2p_process_group(self) -> dist.ProcessGroup:
        return self.p2p_group

    @contextlib.contextmanager
    def switch_model_chunk_id(self, model_chunk_id: int):
        """Ask the first/last-stage questions about chunk `model_chunk_id` inside the block."""
        old, self.model_chunk_id = self.model_chunk_id, model_chunk_id
        try:
            yield
        finally:
            self.model_chunk_id = old

    def get_stage_index(self, layers_per_stage: list[int], stage: int | None = None,
                        num_model_chunks: int | None = None, num_stages: int | None = None):
        """[start, end) of this stage's layers given the layer count of every virtual stage (chunk c of
        stage s is virtual stage c * num_stages + s); a list of ranges with several chunks."""
        stage = self.stage if stage is None else stage
        chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        num_stages = self.num_stages if num_stages is None else num_stages
        bounds = [0, *itertools.accumulate(layers_per_stage)]
        ranges = [[bounds[c * num_stages + stage], bounds[c * num_stages + stage + 1]] for c in range(chunks)]
        return ranges[0] if chunks == 1 else ranges
