"""ShardConfig: the knobs of tensor-parallel sharding, checked when built, and which ranks shard: the
mesh's tp axis (meshboost's form: `ShardConfig(mesh=mesh)`, the group, size and tp mode (Megatron sequence
parallelism) read from the mesh's layout record) or ColossalAI's `tensor_parallel_process_group=` (its size
asked of torch once, when the config is built; a config built before the process group exists asks on
reading; its own `enable_sequence_parallelism` switch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from meshboost.distributed.mesh import ParallelMesh
from meshboost.shardformer.layers.chunked_loss import check_chunk_tokens
from meshboost.shardformer.sequence import check_mode


@dataclass
class ShardConfig:
    """How `ShardFormer` shards a model.

    mesh: the `ParallelMesh` whose tp axis shards the model (its `tp_group` and `tp_size`); what
        HybridParallelPlugin passes.
    tensor_parallel_process_group: ColossalAI's form: the tp group itself (None = torch's default group,
        every rank), for sharding and for every collective of the sharded layers; with `mesh`, leave it
        None (or pass the mesh's own tp group).
    enable_tensor_parallelism: False leaves every module replicated (useful for pp/dp only).
    parallel_output: keep LM-head logits split over the vocabulary in training, with the loss
        computed by the vocab-parallel cross-entropy; evaluation always sees full logits.
    make_vocab_size_divisible_by: vocab is padded to a multiple of this times tp_size.
    loss_chunk_tokens: None (off, the default: the chunked weight gradient is equal to rounding, not bitwise)
        or N: a causal LM's training loss runs its LM head and cross-entropy N tokens at a time, each
        chunk's logits recomputed in the backward, so the logits are never whole (layers/chunked_loss.py,
        docs/optimizations.md); at any tp, with parallel_output under tp.
    enable_sequence_parallelism: Megatron sequence parallelism over the tp group: norms, dropouts and
        residuals of the layer stack hold 1/tp of the sequence (sequence.py, docs/sequence_parallel.md).
        With `mesh`, the layout record's tp mode (`mesh.dims.sequence_parallel`), read here, once (a value
        given that contradicts it is refused); without one, ColossalAI's switch (None: off).
    sequence_parallelism_mode: None or "split_gather" (the one implemented; ColossalAI's "all_to_all",
        "ring" and "ring_attn" raise NotImplementedError).
    enable_flash_attention: flash-attn 2 when importable on CUDA, else torch's SDPA (optimizations.py).
    enable_fused_normalization: norms on apex's fused kernels (CUDA, when importable) or torch's fused
        kernels, where they reproduce the norm's numbers.
    enable_jit_fused: the pointwise chains (bias + activation, ...) compiled by torch.compile.
    enable_sequence_overlap: with sequence parallelism (ColossalAI requires it): the column-parallel
        input-gradient collective overlaps the weight-gradient product. meshboost does this for every
        column-parallel linear with a collective of its own anyway, so the flag only checks its pairing.
    enable_all_optimization: enable_flash_attention, enable_fused_normalization and enable_jit_fused
        (ColossalAI's meaning: sequence parallelism and overlap stay as set).
    pipeline_stage_manager: ColossalAI's view of the pipeline, read by its tests: the stage manager of the
        plugin whose config this is (None without pipeline parallelism). The plugin cuts the stages; a
        `ShardFormer` never does, so one given a stage manager without a mesh refuses, naming the plugin.
    """

    tensor_parallel_process_group: dist.ProcessGroup | None = None
    enable_tensor_parallelism: bool = True
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    loss_chunk_tokens: int | None = None
    enable_sequence_parallelism: bool | None = None
    sequence_parallelism_mode: str | None = None
    enable_flash_attention: bool = False
    enable_fused_normalization: bool = False
    enable_jit_fused: bool = False
    enable_sequence_overlap: bool = False
    enable_all_optimization: bool = False
    mesh: ParallelMesh | None = None
    pipeline_stage_manager: object | None = field(default=None, repr=False, compare=False)
    # (tp group, tp size), resolved once from `mesh` or the group when built (dataclasses.replace rebuilds it;
    # size None: built before the process group, read from the group then)
    _tp: tuple = field(init=False, repr=False, compare=False, default=(None, 1))

    def __post_init__(self):
        self._tp = self._resolve_tp()
        self.enable_sequence_parallelism = self._resolve_sequence()
        if self.enable_all_optimization:
            self.enable_flash_attention = self.enable_fused_normalization = self.enable_jit_fused = True
        if self.enable_sequence_parallelism is not None:      # known: given, or the mesh's record
            self.check_overlap()
        if not isinstance(self.make_vocab_size_divisible_by, int) or self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by!r} must be a "
                             "positive integer (64 is a good default; 1 disables padding beyond tp_size)")
        check_chunk_tokens(self.loss_chunk_tokens)
        if self.enable_sequence_parallelism:
            self.sequence_parallelism_mode = check_mode(self.sequence_parallelism_mode)

    def _resolve_sequence(self) -> bool | None:
        """Megatron sequence parallelism: the mesh's record says (None without a mesh: not set, off; the
        overlap pairing is then checked by whoever decides, HybridParallelConfig or ShardFormer)."""
        given = self.enable_sequence_parallelism
        if self.mesh is None:
            return given
        record = self.mesh.dims.sequence_parallel
        if given is not None and bool(given) != record:
            raise ValueError(f"ShardConfig(enable_sequence_parallelism={given}) with a mesh whose layout record has "
                             f"sequence_parallel={record}: the tp axis' mode is set once, in the record; pass "
                             f"ParallelDims(..., sequence_parallel={bool(given)}) (HybridParallelConfig("
                             f"sequence_parallel={bool(given)})), or leave the switch unset")
        return record

    def check_overlap(self) -> None:
        """enable_sequence_overlap pairs with sequence parallelism (pure: the same error on every rank)."""
        if self.enable_sequence_overlap and not self.enable_sequence_parallelism:
            raise ValueError("enable_sequence_overlap=True needs enable_sequence_parallelism=True (it overlaps "
                             "sequence parallelism's collectives); without it, column-parallel input gradients are "
                             "all-reduced overlapped anyway")

    def _resolve_tp(self) -> tuple:
        group = self.tensor_parallel_process_group
        if self.mesh is not None:
            if not isinstance(self.mesh, ParallelMesh):
                raise TypeError(f"ShardConfig(mesh={self.mesh!r}): pass a meshboost ParallelMesh")
            if group is not None and group is not self.mesh.tp_group:
                raise ValueError("ShardConfig got both mesh= and another tensor_parallel_process_group=: the mesh's "
                                 "tp axis shards the model; pass one of them")
            return self.mesh.tp_group, self.mesh.tp_size
        # ColossalAI's group: its size asked once, now (None when built before the process group: on reading)
        return group, dist.get_world_size(group) if dist.is_initialized() else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The group the model is split over (the mesh's tp group, or ColossalAI's
        tensor_parallel_process_group; None: torch's default group)."""
        return self._tp[0]

    @property
    def tensor_parallel_size(self) -> int:
        """How many ranks split each sharded weight (1 with enable_tensor_parallelism=False)."""
        group, size = self._tp
        if not self.enable_tensor_parallelism:
            return 1
        if size is None:            # no process group when built: the group's size now, 1 without one
            return dist.get_world_size(group) if dist.is_initialized() else 1
        return size

    # ColossalAI's views of sequence parallelism, read by its model tests. Derived, never set: meshboost's
    # sequence parallelism ("split_gather") splits the sequence over the tensor-parallel group.
    @property
    def sequence_parallel_size(self) -> int:
        """How many ranks split the sequence: tensor_parallel_size with sequence parallelism on, else 1."""
        return self.tensor_parallel_size if self.enable_sequence_parallelism else 1

    @property
    def sequence_parallel_process_group(self) -> dist.ProcessGroup | None:
        """The group over which the sequence is split (its size is `sequence_parallel_size`): the tp group
        with sequence parallelism on at tp > 1; otherwise this rank alone (each rank holds the whole
        sequence, its rank in the group is 0, as in ColossalAI's size-1 sequence axis). None without a
        process group."""
        if self.sequence_parallel_size > 1:
            return self.tp_group
        return self._own_group if dist.is_initialized() else None

    @cached_property
    def _own_group(self) -> dist.ProcessGroup:
        # A group of this rank only, built by this rank alone (use_local_synchronization: no other rank
        # takes part, so reading the property on some ranks only cannot hang), once per config.
        return dist.new_group([dist.get_rank()], use_local_synchronization=True)


@dataclass
class PipelineGradientCheckpointConfig:
    """ColossalAI's knob for how many layers of each pipeline stage are activation-checkpointed
    (`HybridParallelConfig(gradient_checkpoint=...)`, ColossalAI's `gradient_checkpoint_config=`), once
    HF checkpointing is on (`model.gradient_checkpointing_enable()`, before or after boost). A stage
    checkpoints its first layers: `int(gradient_checkpointing_ratio * its layers)`, or
    `num_ckpt_layers_per_stage[v]` for virtual stage v = chunk * pp_size + pp_rank. Without pipeline
    parallelism the model is one stage.
    num_stages, num_model_chunks, num_model_layers, num_layers_per_stage: accepted as ColossalAI takes
    them; meshboost reads the real values from the plugin and checks the list against them at boost.
    """

    gradient_checkpointing_ratio: float | None = None
    num_stages: int | None = None
    num_model_chunks: int | None = None
    num_model_layers: int | None = None
    num_layers_per_stage: list[int] | None = None
    num_ckpt_layers_per_stage: list[int] | None = None

    def __post_init__(self):
        ratio, counts = self.gradient_checkpointing_ratio, self.num_ckpt_layers_per_stage
        if ratio is None and counts is None:
            raise ValueError("PipelineGradientCheckpointConfig needs gradient_checkpointing_ratio (0..1) or "
                             "num_ckpt_layers_per_stage (one count per pipeline stage)")
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
            raise ValueError(f"gradient_checkpointing_ratio={ratio!r} must be a number in [0, 1]")
        if counts is not None and not all(isinstance(n, int) and n >= 0 for n in counts):
            raise ValueError(f"num_ckpt_layers_per_stage={counts!r} must list non-negative integers")

    def layers_to_checkpoint(self, stage: int, num_layers: int, num_stages: int = 1) -> int:
        """How many of the first `num_layers` layers of virtual stage `stage` (of `num_stages`) to checkpoint."""
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            return int(self.gradient_checkpointing_ratio * num_layers)
        if len(counts) != num_stages:
            raise ValueError(f"num_ckpt_layers_per_stage has {len(counts)} entries; the pipeline has {num_stages} "
                             "stages (pp_size x num_model_chunks): give one count per stage")
        if counts[stage] > num_layers:
            raise ValueError(f"num_ckpt_layers_per_stage[{stage}]={counts[stage]} exceeds the stage's {num_layers} "
                             "layers")
        return counts[stage]

    def get_num_ckpt_layers(self, stage: int, num_layers: int, model_chunk_id: int = 0) -> int:
        """ColossalAI's name: `stage` is the pp rank, `model_chunk_id` the chunk (num_stages = this config's)."""
        stages = self.num_stages or 1
        chunks = self.num_model_chunks or 1
        return self.layers_to_checkpoint(model_chunk_id * stages + stage, num_layers, stages * chunks)


def switch_config(cls, value, keyword: str):
    """A plugin switch that takes True (`cls()`, the defaults), False / None (off) or a `cls` instance:
    `compile=` (CompileConfig), `float8=` / ColossalAI's `use_fp8=` (Float8Config)."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    raise TypeError(f"{keyword}={value!r}: pass True, False or a {cls.__module__}.{cls.__name__}")

