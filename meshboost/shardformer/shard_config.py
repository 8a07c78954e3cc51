"""ShardConfig: the knobs of tensor-parallel sharding, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from meshboost.shardformer.sequence import check_mode


@dataclass
class ShardConfig:
    """How `ShardFormer` shards a model.

    tensor_parallel_process_group: the tp group (e.g. `ParallelMesh.tp_group`); None = torch's
        default group (every rank), for sharding and for every collective of the sharded layers.
    enable_tensor_parallelism: False leaves every module replicated (useful for pp/dp only).
    parallel_output: keep LM-head logits split over the vocabulary in training, with the loss
        computed by the vocab-parallel cross-entropy; evaluation always sees full logits.
    make_vocab_size_divisible_by: vocab is padded to a multiple of this times tp_size.
    enable_sequence_parallelism: Megatron sequence parallelism over the tp group: norms, dropouts and
        residuals of the layer stack hold 1/tp of the sequence (sequence.py, docs/sequence_parallel.md).
    sequence_parallelism_mode: None or "split_gather" (the one implemented; ColossalAI's "all_to_all",
        "ring" and "ring_attn" raise NotImplementedError).
    enable_flash_attention: flash-attn 2 when importable on CUDA, else torch's SDPA (optimizations.py).
    enable_fused_normalization: RMS norms on torch's fused kernel where it reproduces their numbers.
    enable_jit_fused, enable_sequence_overlap: not implemented yet (raise, naming what exists).
    enable_all_optimization: every switch above (ColossalAI's meaning); raises while one is missing.
    """

    tensor_parallel_process_group: dist.ProcessGroup | None = None
    enable_tensor_parallelism: bool = True
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    enable_flash_attention: bool = False
    enable_fused_normalization: bool = False
    enable_jit_fused: bool = False
    enable_sequence_overlap: bool = False
    enable_all_optimization: bool = False

    def __post_init__(self):
        missing = [name for name in ("enable_jit_fused", "enable_sequence_overlap") if getattr(self, name)]
        if self.enable_all_optimization and "enable_jit_fused" not in missing:
            missing.insert(0, "enable_jit_fused")
        if missing:
            what = "enable_all_optimization=True needs " if self.enable_all_optimization else ""
            raise NotImplementedError(
                f"{what}{', '.join(missing)}, which meshboost does not implement yet; use enable_flash_attention=True "
                "and enable_fused_normalization=True (both implemented) and leave the others False")
        if not isinstance(self.make_vocab_size_divisible_by, int) or self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by!r} must be a "
                             "positive integer (64 is a good default; 1 disables padding beyond tp_size)")
        if self.enable_sequence_parallelism:
            self.sequence_parallelism_mode = check_mode(self.sequence_parallelism_mode)

    @property
    def tensor_parallel_size(self) -> int:
        if not self.enable_tensor_parallelism:
            return 1
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(self.tensor_parallel_process_group)
