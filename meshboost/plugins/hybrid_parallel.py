"""HybridParallelPlugin: data x pipeline x tensor parallelism, composed from the pieces.

Owns: taking its one `HybridParallelConfig` (`plugins/config.py`, checked before any collective; the
shortcuts tp_size / pp_size / zero_stage / precision build one), building the mesh, and wiring
sharding, pipeline stages, device placement, the data-parallel reducer and the optimizer wrapper
together. Must not contain
parallel algorithms itself: those live in shardformer/, pipeline/, optim/ and distributed/.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh, comm, get_current_device
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.inputs import cast_floating
from meshboost.distributed.p2p import StageComm
from meshboost.distributed.quantized import cast_keeping_nf4
from meshboost.fsdp import is_sharded, no_gradient_sync, reshard_all
from meshboost.lazy import materialize
from meshboost.optim import MixedPrecisionOptimizer, ZeroOptimizer
from meshboost.pipeline import PipelineSchedule, build_stages, prune_optimizer
from meshboost.pipeline.checkpointing import install_checkpoint_plan
from meshboost.shardformer.offload import install_offload
from meshboost.shardformer.selective import enable_checkpointing
from meshboost.pipeline.normalization import TOKENS, count_items
from meshboost.plugins.config import DDP, FSDP, PIPELINE, ZERO, HybridParallelConfig, dp_reducer
from meshboost.plugins.data_parallel import reductions as dp_reductions, wrap_ddp
from meshboost.plugins.ddp_hooks import fp8_refusal
from meshboost.plugins.hybrid_zero3 import shard_zero3
from meshboost.plugins.model_checks import check_model
from meshboost.plugins import input_checks
from meshboost.plugins.input_checks import ALWAYS, InputCheck, LabelledItemsGuard, next_pipeline_batch
from meshboost.plugins.router_bias import install as install_router_bias
from meshboost.plugins.router_statistics import GLOBAL, loss_function, with_global_router_loss
from meshboost.plugins.shortcuts import config_from
from meshboost.plugins.speed import apply_compile, apply_float8, to_device, transformer_blocks
from meshboost.shardformer import (PipelineGradientCheckpointConfig, ShardConfig, ShardFormer, pipeline_layout,
                                   uses_causal_lm_loss)
from meshboost.shardformer import packed_rows
from meshboost.shardformer.context import ContextInputs, install
from meshboost.shardformer.layers.expert_parallel import shard_expert_parallel_
from meshboost.shardformer.lora_experts import shard_ep_adapters_


def positional_by_name(model: nn.Module, args: tuple) -> dict:
    """Positional inputs of `model`'s forward under their parameter names (ColossalChat's trainers call
    `model(input_ids, attention_mask=...)`)."""
    params = list(inspect.signature(model.forward).parameters.values())[:len(args)]
    if len(params) < len(args) or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise TypeError(f"{type(model).__name__}.forward takes no {len(args)} named positional inputs; pass them "
                        "by keyword (input_ids=..., attention_mask=...)")
    return dict(zip((p.name for p in params), args))


class HybridParallelModule(ModelWrapper):
    """The boosted model: the sharded HF model, inside torch DDP over the dp group when the plugin
    chose DDP to reduce gradients. check_inputs: agree over tp (and pp) that every rank got the same
    inputs on every call ("always"), the first call ("first") or never (`input_checks.InputCheck`).
    count_items: a causal LM with loss_normalization="tokens" outside a pipeline: count the labelled
    tokens of every dp replica; at dp > 1 its loss is normalised by them (HF's num_items_in_batch),
    and `items_guard` tells the optimizer when a global batch had none."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, shard_config: ShardConfig, check_inputs: str = ALWAYS,
                 count_items: bool = False, input_dtype: torch.dtype = torch.float32, router_group=None,
                 context: ContextInputs | None = None):
        super().__init__(module)
        # Floating-point inputs (pixel_values, input_features, inputs_embeds) are cast to the working
        # precision, as the weights are (ColossalAI's HybridParallelModule does the same).
        self.input_dtype = input_dtype
        self.mesh = mesh
        self.shard_config = shard_config
        self.pipeline: PipelineSchedule | None = None
        self.input_check = InputCheck(mesh, check_inputs)
        self.position_limit = input_checks.learned_position_limit(super().unwrap())    # GPT-2's n_positions, ...
        self.items_guard = LabelledItemsGuard() if count_items else None
        self.fully_sharded = is_sharded(module)       # zero_stage=3: torch FSDP2 over dp
        # router_statistics="global": the load-balancing loss on every replica's routing (router_statistics.py)
        self.router_group = router_group
        # cp_size > 1: this cp rank's piece of every sequence in, the whole sequences' loss out (context.py)
        self.context = context

    def check_same_inputs(self, *inputs, immediate: bool = False) -> None:
        """Raise on every rank of the group when the ranks that must share a batch (tp, and pp with
        stages) got different ones (InputCheck: on CUDA judged at the next call unless `immediate`)."""
        self.input_check(*inputs, immediate=immediate)

    def forward(self, *args, **kwargs):
        input_checks.check_positions(self.position_limit, args, kwargs)
        self.check_same_inputs(args, kwargs)
        if self.mesh.ep_size > 1:              # an empty replica would strand its ep peers in the token exchange
            input_checks.refuse_empty_batch(self.mesh, args, kwargs)
        args, kwargs = cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)
        if self.items_guard is not None and self.training and torch.is_tensor(kwargs.get("labels")):
            items = self._global_items(kwargs["labels"], kwargs.get("num_items_in_batch"))
            self.items_guard.record(items)
            if self.context is not None:       # every rank holds a piece: normalise by the whole count
                kwargs["num_items_in_batch"] = items / (self.mesh.dp_size * self.mesh.cp_size)
            elif self.mesh.dp_size > 1:        # the gradient reduction averages over the replicas
                kwargs["num_items_in_batch"] = items / self.mesh.dp_size
        if self.context is not None:
            if args:                           # model(input_ids, ...): the sequence split reads inputs by name
                args, kwargs = (), {**positional_by_name(super().unwrap(), args), **kwargs}
            labels = kwargs.get("labels")
            if torch.is_tensor(labels) and kwargs.get("num_items_in_batch") is None:     # eval: the replica's own
                kwargs["num_items_in_batch"] = count_items(labels, shifted=True) / self.mesh.cp_size
            kwargs = self.context.shard(kwargs)
        output = self.module(*args, **kwargs)
        if self.context is not None:
            output = self.context.combine(output, kwargs, self.training)
        if self.router_group is not None:
            output = with_global_router_loss(super().unwrap(), output, kwargs.get("attention_mask"), self.router_group)
        return output

    def _global_items(self, labels: torch.Tensor, given) -> torch.Tensor:
        """The labelled tokens of every replica (this replica's own count, or the `num_items_in_batch`
        the caller passed for an accumulation window): one 8-byte all-reduce over dp, no host sync."""
        local = given if given is not None else count_items(labels, shifted=True)
        total = torch.as_tensor(local, dtype=torch.float32, device=labels.device).reshape(1).clone()
        comm.all_reduce(total, self.mesh.dp_group)
        return total[0]

    def unwrap(self) -> nn.Module:
        inner = super().unwrap()
        return reshard_all(inner) if self.fully_sharded else inner      # zero_stage=3: the DTensor shards

    def no_sync(self):
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        if self.fully_sharded:                   # zero_stage=3: FSDP2 keeps unreduced gradients inside
            return no_gradient_sync(self.module)
        return contextlib.nullcontext()


SHORTCUTS = ("tp_size", "pp_size", "zero_stage", "precision", "ep_size", "compile", "moe_router_bias_update_rate",
             "dp_replicate_size")


def plugin_config(config, shortcuts: dict, unknown: dict) -> HybridParallelConfig:
    """The plugin's one config: `config`, or `HybridParallelConfig.of(**shortcuts)` for the shortcuts
    given (pure: the same error on every rank)."""
    pp = shortcuts.get("pp_size")
    if config is None and not unknown and isinstance(pp, int) and not isinstance(pp, bool) and pp > 1:
        raise ValueError(f"HybridParallelPlugin(pp_size={pp}) needs a micro-batch setting, which the shortcuts do "
                         f"not take: pass HybridParallelConfig(pp_size={pp}, pipeline=PipelineConfig("
                         "num_microbatches=...)), or ColossalAI's keywords through meshboost.booster.plugin's "
                         f"HybridParallelPlugin(pp_size={pp}, num_microbatches=...)")
    return config_from("HybridParallelPlugin", HybridParallelConfig, HybridParallelConfig.of, config, shortcuts, unknown,
                       "ColossalAI's flat keywords are taken by `from meshboost.booster.plugin import "
                       "HybridParallelPlugin`, ColossalAI's path, which maps them onto the config (docs/colossalai.md)",
                       hint=f"tp_size={config!r}" if isinstance(config, int) else None)


class HybridParallelPlugin(Plugin):
    """Tensor (Megatron 1D), pipeline and data parallelism over a (dp, pp, tp) mesh, composed from
    `config` (`HybridParallelConfig`: sharding and kernels `ShardConfig`, `PipelineConfig`,
    `PrecisionConfig`, `ZeroConfig` (stage 3: torch FSDP2 under tp, docs/fsdp.md), `DDPConfig`, the
    gradient-checkpointing split, fp8 gradient communication, check_inputs, loss_normalization; each
    documented on its config). `HybridParallelPlugin(tp_size=2, zero_stage=1, precision="fp16")` is
    `HybridParallelPlugin(HybridParallelConfig.of(...))`. ColossalAI's flat keywords (all 51) are
    taken by the class at ColossalAI's path, `meshboost.booster.plugin.HybridParallelPlugin` (the
    compat package), which maps them onto this config.

    The groups and sizes are the mesh's (`plugin.mesh`; `dp_group`, `pp_group`, `tp_group`, `dp_size`,
    `pp_size`, `tp_size` read it); ColossalAI's `pg_mesh` and `stage_manager` views are the compat
    class's.
    """

    def __init__(self, config: HybridParallelConfig | None = None, *, tp_size: int | None = None,
                 pp_size: int | None = None, zero_stage: int | None = None, precision: str | None = None,
                 ep_size: int | None = None, compile=None, moe_router_bias_update_rate: float | None = None,
                 dp_replicate_size: int | None = None, **unknown):
        shortcuts = dict(tp_size=tp_size, pp_size=pp_size, zero_stage=zero_stage, precision=precision,
                         ep_size=ep_size, compile=compile, moe_router_bias_update_rate=moe_router_bias_update_rate,
                         dp_replicate_size=dp_replicate_size)
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({"config": config, **shortcuts, **unknown}, "HybridParallelPlugin arguments")
        # -- pure checks first: every rank raises the same error before any collective ----------
        self.config = config = plugin_config(config, shortcuts, unknown)
        if config.fp8_communication:
            refusal = fp8_refusal(get_current_device().type, "HybridParallelPlugin")
            if refusal:
                raise NotImplementedError(refusal)
        # collective: after the checks
        self.mesh = ParallelMesh(config.dims)     # the layout's one record, dp resolved over the world
        self.shard_config = dataclasses.replace(config.sharding, mesh=self.mesh)     # tp group and size: the mesh's
        # the replicas of a dense weight: dp, times the cp ranks (each saw other pieces of the sequences)
        self.dp_reducer = dp_reducer(self.mesh.size(*self.mesh.dims.grad_axes()), config.dims.pp, config.zero.stage)

    @property
    def fp8_communication(self) -> bool:
        return self.config.fp8_communication

    @property
    def gradient_checkpoint_config(self) -> PipelineGradientCheckpointConfig | None:
        return self.config.gradient_checkpoint

    # a LazyInitContext model is materialised in configure, after sharding: each rank initialises its part
    materializes_lazy_models = True

    # ColossalAI reads these off the plugin
    @property
    def dp_group(self):
        return self.mesh.dp_group

    @property
    def pp_group(self):
        return self.mesh.pp_group

    @property
    def tp_group(self):
        return self.mesh.tp_group

    @property
    def tp_size(self) -> int:
        return self.mesh.tp_size

    @property
    def ep_size(self) -> int:
        return self.mesh.ep_size

    @property
    def ep_group(self):
        """The ranks splitting the experts (None without expert parallelism)."""
        return self.mesh.group("ep") if self.mesh.ep_size > 1 else None

    @property
    def moe_dp_group(self):
        """The replicas of this rank's experts, over which their gradients are averaged (ColossalAI's name)."""
        return self.mesh.group("edp")

    @property
    def pp_size(self) -> int:
        return self.mesh.pp_size

    @property
    def precision(self) -> str:
        return self.config.precision.precision

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # every model check first (pure: the same refusal on every rank, nothing changed yet)
        plan = check_model(model, optimizer, self.config, self.mesh.dims, self.dp_reducer)
        hf = plan.hf        # plans and stages read the transformers model; the wrappers hold `model` itself
        enable_checkpointing(hf, self.config.checkpointing)      # transformers' own refusal, nothing changed yet
        original = copy.deepcopy(model) if plan.lazy is not None else None        # on meta: no memory
        ShardFormer(self.shard_config).shard(hf, self.config.custom_policy)       # materialised below, once cut
        apply_float8(hf, self.config.float8, self.mesh, self.dp_reducer == FSDP, optimizer)   # speed.py
        if self.ep_size > 1:        # after tp, which cut inside the experts: now split the experts over ep
            shard_expert_parallel_(hf, self.mesh.group("ep"), self.ep_size, self.mesh.ep_rank)
            shard_ep_adapters_(hf, self.mesh.group("ep"), self.ep_size, self.mesh.ep_rank)   # LoRA on experts
        stages = self._build_stages(hf, optimizer) if self.pp_size > 1 else None
        if plan.checkpointed is not None:
            install_checkpoint_plan(hf, plan.checkpointed(stages))
        offload = self.config.activation_offload      # this rank's blocks (its stages'): hooks only, outside FSDP2's
        offloader = install_offload(transformer_blocks(hf, stages, self.config.custom_policy, "activation_offload"),
                                    offload, self.mesh.device) if offload is not None else None
        if plan.lazy is not None:
            materialize(model, original, self.mesh.device, plan.lazy)
        if not plan.on_meta:
            model = to_device(model, self.mesh.device)  # in place, records kept (speed.py): the same parameters
        sharding = None                 # FSDP2 over dp: its fp32 shards are the masters; compute dtype by its policy
        if self.dp_reducer == FSDP:     # with stages: the cut HF model is the root the schedule runs
            optimizer, sharding = shard_zero3(stages.model if stages else model, optimizer, self.mesh,
                                              self.config.precision, stages, self.config.reshard_after_forward)
        else:
            if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
                optimizer = self._wrap_optimizer(optimizer)  # fp32 masters from the fp32 weights, before the cast
            model = cast_keeping_nf4(model, self.config.precision.dtype)   # working weights (in place, same objects)
        module = model
        if self.dp_reducer == DDP:
            module = wrap_ddp(model, optimizer, self.mesh, self.config.ddp.kwargs(), self.fp8_communication)
        apply_compile(hf, self.config.compile, stages, self.config.custom_policy)     # plugins/speed.py
        boosted = self._wrap_model(module, hf, plan.attention, stages)
        boosted.activation_offload = offloader      # its `stats`: what moved to host
        if boosted.items_guard is not None and isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.check_before_update(boosted.items_guard)     # no labelled token: refuse the update
        if stages is not None:
            boosted.pipeline = self._build_schedule(stages, boosted.context, sharding)
        install_router_bias(hf, optimizer, self.config.moe_router_bias_update_rate, self.mesh,    # router_bias.py
                            seq_parallel=self.mesh.dims.sequence_parallel and self.mesh.tp_size > 1)
        return boosted, optimizer, criterion, dataloader, lr_scheduler

    def _wrap_model(self, module: nn.Module, hf: nn.Module, attention, stages) -> HybridParallelModule:
        """The boosted model: input checks, token counting, context parallelism's input split, the global
        router loss."""
        count = self.config.loss_normalization == TOKENS and stages is None and uses_causal_lm_loss(hf)
        context = None
        if attention is not None:
            dims = self.mesh.dims
            # wraps what the model runs now: check_model vetted its own implementation (`attention`), the
            # sharder's kernel switch may since have chosen SDPA (never one context parallelism cannot wrap)
            context = ContextInputs(install(hf, self.mesh.group("cp"), dims.cp, mode=dims.cp_mode),
                                    self.mesh.cp_rank, hf)
        # packed rows with the cache on attend across documents as transformers decides: say so once, at every layout
        hf.register_forward_pre_hook(packed_rows.tell_hook, with_kwargs=True)
        router_group = self.mesh.dp_group if self.config.router_statistics == GLOBAL and self.mesh.dp_size > 1 else None
        if router_group is not None:
            loss_function(hf)                         # pure: a model without a router loss is refused here
        return HybridParallelModule(module, self.mesh, self.shard_config, self.config.check_inputs, count,
                                    input_dtype=self.config.precision.dtype, router_group=router_group,
                                    context=context)

    def _wrap_optimizer(self, optimizer) -> MixedPrecisionOptimizer:
        """user optimizer -> MixedPrecisionOptimizer, or ZeroOptimizer when ZeRO reduces over dp."""
        if self.dp_reducer != ZERO:
            return MixedPrecisionOptimizer(optimizer, self.mesh, self.config.precision)
        return ZeroOptimizer(optimizer, self.mesh, self.config.precision, self.config.zero)

    def lora_refusal(self) -> str | None:
        # tp and pp shard and stage the adapters with their linears (shardformer/lora.py)
        # sp: the adapters are replicated weights like the rest, averaged over dp x cp (lora_dropout checked at boost)
        # ep: adapters on experts are dealt out with them (shardformer/lora_experts.py), the others are dense
        return None

    # -- pipeline parallelism (meshboost/pipeline) ---------------------------------------------------
    @property
    def supports_pipeline(self) -> bool:
        return self.pp_size > 1

    def _build_stages(self, model: nn.Module, optimizer):
        """Cut the (tp-sharded) model down to this rank's stages; drop the other stages' parameters
        from the user's optimizer before any wrapper builds masters from it."""
        cfg = self.config.pipeline
        stages = build_stages(model, self.mesh.pp_rank, self.pp_size, cfg.num_model_chunks, cfg.num_layers_per_stage,
                              layout=pipeline_layout(model, self.config.custom_policy))
        # sequence parallelism: boundaries carry 1/sp of the sequence (the shard config's one answer)
        stages.seq_split = self.shard_config.sequence_parallel_size
        prune_optimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer, model)
        return stages

    def _build_schedule(self, stages, context: ContextInputs | None = None, sharding=None) -> PipelineSchedule:
        cfg = self.config.pipeline
        # collective: every rank builds the group of each set of pp ranks sharing a weight, in the same order
        tied = [(self.mesh.stage_group(ranks), params) for ranks, params in stages.ties]
        reductions = dp_reductions(stages.model, self.mesh) if self.dp_reducer == PIPELINE else ()
        return PipelineSchedule(stages, StageComm(self.mesh.pp_group, self.mesh.device), cfg.num_microbatches,
                                cfg.microbatch_size, reductions=reductions, tied=tied,
                                loss_normalization=self.config.loss_normalization, count_group=self.mesh.dp_group,
                                count_size=self.mesh.dp_size, shifted_labels=uses_causal_lm_loss(stages.model),
                                input_dtype=self.config.precision.dtype, context=context, sharding=sharding)

    def execute_pipeline(self, data_iter, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        """One pipeline step on `next(data_iter)`: forward (and backward when `optimizer` is given) over its
        micro-batches. Returns {"loss": mean micro-batch loss on every rank, "outputs": last stage only}.
        StopIteration on every rank when every iterator ran out; an error on every rank when only some did
        (`input_checks.next_pipeline_batch`)."""
        pipeline = model.pipeline if isinstance(model, HybridParallelModule) else None
        if pipeline is None:
            raise TypeError("execute_pipeline needs the model returned by booster.boost(...) with pp_size > 1")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"execute_pipeline takes an iterator (e.g. iter(dataloader)), got "
                            f"{type(data_iter).__name__}")
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            raise TypeError("execute_pipeline needs the optimizer returned by booster.boost(...) (or None to evaluate)")
        # ZeRO: keep gradients local over all micro-batches and reduce-scatter them once per step, not
        # once per micro-batch (stage 1 at step(); stage 2 when the schedule is done, freeing the full
        # gradients: ZeroOptimizer.accumulate_then_reduce).
        local = optimizer.accumulate_then_reduce() if optimizer is not None and self.dp_reducer == ZERO \
            else contextlib.nullcontext()
        # Every rank has a batch (or none: StopIteration everywhere) and the global batch a labelled
        # token, agreed over the world before anything runs; the step waits for the host here anyway.
        batch, items = next_pipeline_batch(data_iter, self.mesh, pipeline.count_items, training=optimizer is not None,
                                           position_limit=model.position_limit)
        model.check_same_inputs(batch, immediate=True)
        with local:
            return pipeline.run(batch, criterion, optimizer, return_loss, return_outputs, items=items)

    def no_sync(self, model, optimizer=None):
        """Whoever reduces the gradients skips it inside the block: DDP's no_sync, FSDP2's (zero_stage=3), or
        the ZeRO optimizer's (stage 1: gradients stay local until step; stage 2: an error, see
        ZeroOptimizer.no_sync)."""
        if not isinstance(model, HybridParallelModule):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        if self.dp_reducer == ZERO:
            if not isinstance(optimizer, ZeroOptimizer):
                raise TypeError(f"no_sync with zero_stage={self.zero_stage} needs the boosted optimizer: "
                                "booster.no_sync(model, optimizer)")
            return optimizer.no_sync()
        return model.no_sync()
