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

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh, comm, get_current_device
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.inputs import cast_floating
from meshboost.distributed.p2p import StageComm
from meshboost.fsdp import is_sharded, no_gradient_sync, reshard_all
from meshboost.lazy import lazy_seed, materialize
from meshboost.optim import MixedPrecisionOptimizer, ZeroOptimizer
from meshboost.pipeline import PipelineSchedule, build_stages, get_layout, prune_optimizer, split_layers
from meshboost.pipeline.checkpointing import checkpoint_plan, install_checkpoint_plan
from meshboost.pipeline.normalization import TOKENS, count_items
from meshboost.plugins.config import DDP, FSDP, PIPELINE, ZERO, HybridParallelConfig, dp_reducer
from meshboost.plugins.ddp_hooks import fp8_refusal, register_counting_allreduce, register_fp8_allreduce
from meshboost.plugins.hybrid_zero3 import check_zero3_model, shard_zero3
from meshboost.plugins import input_checks
from meshboost.plugins.input_checks import ALWAYS, InputCheck, LabelledItemsGuard, next_pipeline_batch
from meshboost.plugins.router_bias import check_model as check_router_bias, install as install_router_bias
from meshboost.plugins.router_statistics import GLOBAL, loss_function, with_global_router_loss
from meshboost.plugins.speed import apply_compile, apply_float8, to_device
from meshboost.shardformer import (PipelineGradientCheckpointConfig, ShardConfig, ShardFormer, pipeline_layout,
                                   uses_causal_lm_loss)
from meshboost.shardformer.context import ContextInputs, check_context, install
from meshboost.shardformer.layers.expert_parallel import check_expert_parallel, shard_expert_parallel_
from meshboost.shardformer.lora import lora_dropout, transformers_model
from meshboost.shardformer.lora_experts import check_ep_adapters, shard_ep_adapters_


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
        # sp_size > 1: this cp rank's piece of every sequence in, the whole sequences' loss out (context.py)
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
            labels = kwargs.get("labels")
            if torch.is_tensor(labels) and kwargs.get("num_items_in_batch") is None:     # eval: the replica's own
                kwargs["num_items_in_batch"] = count_items(labels, shifted=True) / self.mesh.cp_size
            kwargs = self.context.shard(kwargs, self.training)
        output = self.module(*args, **kwargs)
        if self.context is not None:
            output = self.context.combine(output, self.training)
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
    if unknown:
        names = ", ".join(sorted(unknown))
        raise TypeError(f"HybridParallelPlugin() got {names}: meshboost.plugins.HybridParallelPlugin takes "
                        f"config=HybridParallelConfig(...) (or the shortcuts {', '.join(SHORTCUTS)}); ColossalAI's "
                        "flat keywords are taken by `from meshboost.booster.plugin import HybridParallelPlugin`, "
                        "ColossalAI's path, which maps them onto the config (docs/colossalai.md)")
    given = {k: v for k, v in shortcuts.items() if v is not None}
    if config is None:
        pp = given.get("pp_size", 1)
        if isinstance(pp, int) and not isinstance(pp, bool) and pp > 1:
            raise ValueError(f"HybridParallelPlugin(pp_size={pp}) needs a micro-batch setting, which the shortcuts do "
                             f"not take: pass HybridParallelConfig(pipeline=PipelineConfig(pp_size={pp}, "
                             "num_microbatches=...)), or ColossalAI's keywords through meshboost.booster.plugin's "
                             f"HybridParallelPlugin(pp_size={pp}, num_microbatches=...)")
        return HybridParallelConfig.of(**given)
    if not isinstance(config, HybridParallelConfig):
        hint = f"tp_size={config!r}" if isinstance(config, int) else "config=HybridParallelConfig(...)"
        raise TypeError(f"HybridParallelPlugin(config={config!r}): pass a meshboost.plugins.HybridParallelConfig, "
                        f"or {hint}")
    if given:
        raise ValueError(f"HybridParallelPlugin(config=..., {', '.join(f'{k}={v!r}' for k, v in given.items())}): "
                         "set these inside the config (HybridParallelConfig(tp_size=..., pipeline=PipelineConfig(...), "
                         "zero=ZeroConfig(stage=...), precision=PrecisionConfig(...))), not beside it")
    return config


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
        pc = config.pipeline
        # collective: after the checks
        self.mesh = ParallelMesh(tp_size=config.tp_size, pp_size=pc.pp_size, ep_size=config.ep_size,
                                 cp_size=config.sp_size, dp_replicate_size=config.dp_replicate_size)
        self.shard_config = dataclasses.replace(config.sharding, tensor_parallel_process_group=self.mesh.tp_group)
        # the replicas of a dense weight: dp, times the cp ranks (each saw other pieces of the sequences)
        self.dp_reducer = dp_reducer(self.mesh.size(*self.mesh.dims.grad_axes()), pc.pp_size, config.zero.stage)

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
        # A model built under torch.device("meta") stays on meta until booster.load_model materialises
        # it; DDP needs real weights at construction, so that combination is refused (every rank).
        lazy = lazy_seed(model)          # built under LazyInitContext: materialised below, this rank's part only
        original = copy.deepcopy(model) if lazy is not None else None        # on meta: no memory
        on_meta = lazy is None and any(p.is_meta for p in model.parameters())
        if on_meta and self.dp_reducer == DDP:
            raise ValueError(f"a meta-device model cannot be boosted with dp_size={self.mesh.dp_size} and "
                             "zero_stage=0 (torch DDP needs real weights); use zero_stage=1 or 2, or build the "
                             "model with real weights")
        if self.dp_reducer == FSDP:
            check_zero3_model(model, optimizer, on_meta)
        # plans, stages and checks read the transformers model (inside a peft model: its adapters are sharded
        # and staged with the linears they adapt); the wrappers below hold `model` itself
        hf = transformers_model(model)
        checkpointed = self._checkpointed_layers(hf)          # pure: raises on every rank alike
        if self.ep_size > 1:                                  # pure: raise on every rank alike
            check_expert_parallel(hf, self.ep_size)
            check_ep_adapters(hf, self.ep_size)               # LoRA on experts
        check_router_bias(hf, self.config.moe_router_bias_update_rate)      # pure
        attention = None
        if self.config.sp_size > 1:                              # pure: raises on every rank alike
            attention = check_context(hf, self.config.sp_size, self.tp_size, self.config.sp_mode)
            p = lora_dropout(model)
            if p > 0:
                raise NotImplementedError(f"lora_dropout={p} with sp_size={self.config.sp_size}: every context-parallel "
                                          "rank would draw the same mask on its own piece of the sequence, not one "
                                          "mask over the whole; use lora_dropout=0.0 with context parallelism")
            if not uses_causal_lm_loss(hf):
                raise NotImplementedError(f"sp_size={self.config.sp_size}: {type(hf).__name__} does not compute its "
                                          "causal-LM loss through transformers' loss_function; use sp_size=1")
        ShardFormer(self.shard_config).optimize(hf, self.config.custom_policy)
        apply_float8(hf, self.config.float8, self.mesh, self.dp_reducer == FSDP, optimizer)   # speed.py
        if self.ep_size > 1:        # after tp, which cut inside the experts: now split the experts over ep
            shard_expert_parallel_(hf, self.mesh.group("ep"), self.ep_size, self.mesh.ep_rank)
            shard_ep_adapters_(hf, self.mesh.group("ep"), self.ep_size, self.mesh.ep_rank)   # LoRA on experts
        stages = self._build_stages(hf, optimizer) if self.pp_size > 1 else None
        if checkpointed is not None:
            install_checkpoint_plan(hf, checkpointed(stages))
        if lazy is not None:
            materialize(model, original, self.mesh.device, lazy)
        if not on_meta:
            model = to_device(model, self.mesh.device)  # in place, records kept (speed.py): the same parameters
        sharding = None                 # FSDP2 over dp: its fp32 shards are the masters; compute dtype by its policy
        if self.dp_reducer == FSDP:     # with stages: the cut HF model is the root the schedule runs
            optimizer, sharding = shard_zero3(stages.model if stages else model, optimizer, self.mesh,
                                              self.config.precision, stages, self.config.reshard_after_forward)
        else:
            if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
                optimizer = self._wrap_optimizer(optimizer)  # fp32 masters from the fp32 weights, before the cast
            model = model.to(self.config.precision.dtype)   # working weights (in place, same objects)
        module: nn.Module = model
        if self.dp_reducer == DDP:
            device, reductions = self.mesh.device, self._reductions(model)
            group = reductions[0][1]
            # DDP averages the dense weights and must not see the experts, frozen ones (LoRA) included: it would
            # broadcast dp rank 0's over ranks holding others. The optimizer averages the experts, at step
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [
                n for n, p in model.named_parameters() if self.mesh.reduction_axes(p) != self.mesh.dims.grad_axes()])
            if len(reductions) > 1:
                if isinstance(optimizer, MixedPrecisionOptimizer):
                    optimizer.average_at_step(reductions[1:])
                elif optimizer is not None:          # nothing would average the experts: refuse (every rank)
                    raise TypeError(f"expert parallelism with torch DDP averages the experts' gradients in "
                                    f"meshboost's optimizer step; {type(optimizer).__name__} is not one: pass the "
                                    "torch optimizer itself to boost")
        if self.dp_reducer == DDP and reductions[0][0]:     # none trains (LoRA on experts alone): DDP would refuse
            module = DistributedDataParallel(model, process_group=group,
                                             device_ids=[device] if device.type == "cuda" else None,
                                             **self.config.ddp.kwargs())
            if self.fp8_communication:
                register_fp8_allreduce(module, group)
            else:
                register_counting_allreduce(module, group)
        apply_compile(hf, self.config.compile, stages, self.config.custom_policy)     # plugins/speed.py
        count = self.config.loss_normalization == TOKENS and stages is None and uses_causal_lm_loss(hf)
        context = None
        if attention is not None:
            context = ContextInputs(install(hf, self.mesh.group("cp"), self.config.sp_size, attention,
                                            self.config.sp_mode), self.mesh.cp_rank, hf.config)
        router_group = self.mesh.dp_group if self.config.router_statistics == GLOBAL and self.mesh.dp_size > 1 else None
        if router_group is not None:
            loss_function(hf)                         # pure: a model without a router loss is refused here
        boosted = HybridParallelModule(module, self.mesh, self.shard_config, self.config.check_inputs, count,
                                       input_dtype=self.config.precision.dtype, router_group=router_group,
                                       context=context)
        if boosted.items_guard is not None and isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.check_before_update(boosted.items_guard)     # no labelled token: refuse the update
        if stages is not None:
            boosted.pipeline = self._build_schedule(stages, context, sharding)
        install_router_bias(hf, optimizer, self.config.moe_router_bias_update_rate, self.mesh,    # router_bias.py
                            seq_parallel=self.shard_config.enable_sequence_parallelism and self.mesh.tp_size > 1)
        return boosted, optimizer, criterion, dataloader, lr_scheduler

    def _reductions(self, model: nn.Module) -> list[tuple[list, object]]:
        """[(trainable parameters, the group averaging their gradients)], grouped as their records say
        (the mesh answers `reduction_axes`: dp for dense weights, edp for expert-parallel ones), dense
        first; always one entry for the dense weights, even when there are none."""
        by_axes: dict[tuple[str, ...], list] = {self.mesh.dims.grad_axes(): []}
        for p in model.parameters():
            if p.requires_grad:
                by_axes.setdefault(self.mesh.reduction_axes(p), []).append(p)
        return [(params, self.mesh.group(*axes)) for axes, params in by_axes.items()]

    def _checkpointed_layers(self, model: nn.Module):
        """With gradient_checkpoint_config: check its counts against every stage's layers (all stages,
        on every rank, before any collective) and return what gives (layer, checkpointed) for this
        rank's stages once they are built."""
        config = self.gradient_checkpoint_config
        if config is None:
            return None
        layout = get_layout(model, pipeline_layout(model, self.config.custom_policy))
        base = model.base_model
        lists = [base.get_submodule(segment.layers) for segment in layout.segments]
        pc = self.config.pipeline
        num_stages = pc.pp_size * pc.num_model_chunks
        ranges = split_layers(sum(len(layers) for layers in lists), num_stages, pc.num_layers_per_stage)
        for v, r in enumerate(ranges):
            config.layers_to_checkpoint(v, len(r), num_stages)

        def plan(stages):
            if stages is None:
                return checkpoint_plan([(0, [layer for layers in lists for layer in layers])], 1, config)
            mine = [stages.virtual(c) for c in range(stages.num_chunks)]
            return checkpoint_plan([(v, [stages.kept[i] for i in stages.layer_ranges[v]]) for v in mine],
                                   num_stages, config)
        return plan

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
        stages = build_stages(model, self.mesh.pp_rank, cfg.pp_size, cfg.num_model_chunks, cfg.num_layers_per_stage,
                              layout=pipeline_layout(model, self.config.custom_policy))
        # sequence parallelism: boundaries carry 1/sp of the sequence (the shard config's one answer)
        stages.seq_split = self.shard_config.sequence_parallel_size
        prune_optimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer, model)
        return stages

    def _build_schedule(self, stages, context: ContextInputs | None = None, sharding=None) -> PipelineSchedule:
        cfg = self.config.pipeline
        # collective: every rank builds the group of each set of pp ranks sharing a weight, in the same order
        tied = [(self.mesh.stage_group(ranks), params) for ranks, params in stages.ties]
        reductions = self._reductions(stages.model) if self.dp_reducer == PIPELINE else ()
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
