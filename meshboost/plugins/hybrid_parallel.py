"""HybridParallelPlugin: data x pipeline x tensor parallelism, composed from the pieces.

Owns: checking the configuration (before any collective), building the mesh, and wiring sharding,
device placement, the data-parallel wrapper and the optimizer wrapper together. Must not contain
parallel algorithms itself: those live in shardformer/, optim/ and pipeline/.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshboost.booster.plugin import Plugin
from meshboost.booster.wrappers import ModelWrapper, OptimizerWrapper
from meshboost.launch import get_current_device
from meshboost.mesh import ParallelMesh
from meshboost.plugins.dataloader import build_dataloader
from meshboost.plugins.ddp_hooks import register_counting_allreduce
from meshboost.shardformer import Policy, ShardConfig, ShardFormer

PRECISIONS = ("fp32", "fp16", "bf16")


class HybridParallelModule(ModelWrapper):
    """The boosted model: the sharded HF model, inside torch DDP over the dp group when
    dp > 1 and ZeRO is off."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, shard_config: ShardConfig):
        super().__init__(module)
        self.mesh = mesh
        self.shard_config = shard_config

    def no_sync(self):
        if isinstance(self.module, DDP):
            return self.module.no_sync()
        import contextlib
        return contextlib.nullcontext()


class HybridParallelPlugin(Plugin):
    """Tensor (Megatron 1D), pipeline and data parallelism over a (dp, pp, tp) mesh.

    tp_size: tensor-parallel degree (ranks tp-adjacent). pp_size: pipeline stages.
    precision: "fp32" | "fp16" | "bf16". zero_stage: 0, 1 or 2 (partition optimizer state over dp).
    parallel_output: keep LM logits vocab-split in training (loss computed vocab-parallel).
    make_vocab_size_divisible_by: vocab padded to a multiple of this times tp_size.
    custom_policy: a `meshboost.shardformer.Policy` to use instead of the registry's.
    max_norm: clip gradients by their global norm when > 0.
    find_unused_parameters, ddp_bucket_cap_mb, broadcast_buffers: passed to torch DDP (dp > 1).
    """

    def __init__(self, tp_size: int, pp_size: int = 1, precision: str = "fp32", zero_stage: int = 0,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 custom_policy: Policy | None = None, enable_tensor_parallelism: bool = True,
                 enable_sequence_parallelism: bool = False, max_norm: float = 0.0,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 find_unused_parameters: bool = False, ddp_bucket_cap_mb: int = 25, broadcast_buffers: bool = True):
        # -- pure checks first: every rank raises the same error before any collective ----------
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}; expected one of {PRECISIONS}")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1 or 2")
        if custom_policy is not None and not isinstance(custom_policy, Policy):
            raise TypeError(f"custom_policy must be a meshboost.shardformer.Policy, got {type(custom_policy).__name__}")
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm!r} must be >= 0 (0 disables clipping)")
        if pp_size != 1:
            raise NotImplementedError(f"pp_size={pp_size}: pipeline parallelism is not implemented yet; use pp_size=1")
        if precision != "fp32":
            raise NotImplementedError(f"precision={precision!r} is not implemented yet; use precision='fp32'")
        if zero_stage != 0:
            raise NotImplementedError(f"zero_stage={zero_stage} is not implemented yet; use zero_stage=0")
        if max_norm > 0:
            raise NotImplementedError(f"max_norm={max_norm}: gradient clipping is not implemented yet; use 0")
        if num_microbatches is not None or microbatch_size is not None:
            raise ValueError("num_microbatches/microbatch_size only apply with pp_size > 1")
        self.tp_size, self.pp_size = tp_size, pp_size
        self.precision, self.zero_stage, self.max_norm = precision, zero_stage, max_norm
        self.custom_policy = custom_policy
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, bucket_cap_mb=ddp_bucket_cap_mb,
                               broadcast_buffers=broadcast_buffers)
        self.mesh = ParallelMesh(tp_size=tp_size, pp_size=pp_size)       # collective: after the checks
        self.shard_config = ShardConfig(
            tensor_parallel_process_group=self.mesh.tp_group, enable_tensor_parallelism=enable_tensor_parallelism,
            parallel_output=parallel_output, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            enable_sequence_parallelism=enable_sequence_parallelism)

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        if isinstance(model, ModelWrapper):
            raise RuntimeError("this model was already boosted; pass the original model to boost() once")
        model, _shared = ShardFormer(self.shard_config).optimize(model, self.custom_policy)
        device = get_current_device()
        model = model.to(device)           # in place: the optimizer's parameters stay the same objects
        module: nn.Module = model
        if self.mesh.dp_size > 1 and self.zero_stage == 0:
            module = DDP(model, process_group=self.mesh.dp_group,
                         device_ids=[device] if device.type == "cuda" else None, **self.ddp_kwargs)
            register_counting_allreduce(module, self.mesh.dp_group)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return HybridParallelModule(module, self.mesh, self.shard_config), optimizer, criterion, dataloader, lr_scheduler

    def prepare_dataloader(self, dataset, batch_size, shuffle=False, seed=1024, drop_last=False, pin_memory=False,
                           num_workers=0, **kwargs):
        return build_dataloader(dataset, batch_size, self.mesh.dp_size, self.mesh.dp_rank, shuffle, seed,
                                drop_last, pin_memory, num_workers, **kwargs)

    def no_sync(self, model, optimizer=None):
        if not isinstance(model, HybridParallelModule):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        return model.no_sync()
