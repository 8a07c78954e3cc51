"""Apply a Policy to a model: match module paths, swap leaves in place, fix attributes, shard the
vocabulary.

Owns: validation (every check runs before anything is modified or communicated, so every rank
raises the same error), the plan's block regions (a `regions.RegionPlan` built with the plan: one
`BlockRegion` per block input and per sequence-parallel block, which decides every parallel
linear's `LinearRole` once and owns the record of column-parallel outputs the split-input guards
read), applying each matched style from the registry (`styles.py`) at every path the module is
reached by, the per-rank attribute values, the vocab-parallel embedding / LM head with the
loss-function swap, and (`optimize`) materialising a LazyInitContext model once it is sharded. Must
not copy or fork any HuggingFace forward, must not know a model family (those are tables in
`policies/`), and must not pass state through a module's `__dict__` or attributes set on tensors:
the regions carry it.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn

from meshboost.distributed.launch import get_current_device
from meshboost.distributed.param_info import get_tp_info
from meshboost.lazy import lazy_seed, materialize
from meshboost.shardformer import sequence
from meshboost.shardformer.layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    make_causal_lm_loss,
)
from meshboost.shardformer.context_checks import WRAPPED
from meshboost.shardformer.layers.chunked_loss import install_chunked_loss
from meshboost.shardformer.layers.vocab import embedding_extras, uses_causal_lm_loss
from meshboost.shardformer.lora import adapter_base, adapter_linears, is_peft_module, shard_adapter_
from meshboost.shardformer.optimizations import fuse_norms, jit_fuse, say, use_fast_attention
from meshboost.shardformer.policies import Policy, get_policy
from meshboost.shardformer.policies.base import pattern_to_regex, plan_root  # noqa: F401 - plan_root re-exported
from meshboost.shardformer.regions import ColumnOutputs, RegionPlan
from meshboost.shardformer.sharder_plan import (
    Match,
    ShardPlan,
    closed_block,
    holders,
    module_paths,
    plan_sequence,
    split_input_guards,
)
from meshboost.shardformer.rng import install_tp_rank_rng
from meshboost.shardformer.shard_config import ShardConfig
from meshboost.shardformer.styles import (
    BLOCK_INPUT,
    STYLES,
    ShardContext,
    attribute_rule,
    parse_style,
)


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)



class UncoveredParameterError(ValueError):
    """A module with parameters reads split activations the sharding plan does not account for."""


def split_input_guard(path: str, outputs: ColumnOutputs):
    """A forward pre-hook that raises when the module receives a column-parallel output (or a view
    of one), as recorded in `outputs` by the column layers: its parameters would see only this
    rank's features. Removes itself after a clean call (the dataflow does not change between steps)."""
    def hook(module, args, kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        if any(outputs.holds(t) for t in tensors):
            raise UncoveredParameterError(
                f"{path} ({type(module).__name__}) has parameters and is fed this rank's slice of a column-parallel "
                "output, which the tensor-parallel plan does not cover: its gradient (or its shape) would be wrong "
                "on every rank. Cover it in a custom_policy ('head_norm(<heads>)' for a q/k norm applied per head: a "
                "[head_dim] weight has its gradient summed over tp, a [heads, head_dim] one is split by heads) or "
                "keep tp_size=1 for this model")
        handle.remove()
        outputs.done()
    handle = None

    def install(module: nn.Module):
        nonlocal handle
        outputs.watch()
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    return install


def tied_parameters(model: nn.Module) -> list[dict[str, nn.Parameter]]:
    """Parameters reached under several names ({name: param} per shared weight, e.g. GPT-2's `wte`
    and `lm_head`): the weights whose gradients must be summed wherever the copies are split up."""
    names: dict[int, dict[str, nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), {})[name] = p
    return [group for group in names.values() if len(group) > 1]


def _parameter_matches(base: nn.Module, compiled: list, full: Callable, tp_size: int) -> list:
    """The parameters the plan names with a parameter style, each validated (pure)."""
    out = []
    for name, param in base.named_parameters():
        hit = next(((style, args) for regex, style, args in compiled if style.on_parameter and regex.match(name)),
                   None)
        if hit is not None:
            hit[0].validate(full(name), param, tp_size, *hit[1])
            out.append((full(name), param, *hit))
    return out


def _warn_if_mostly_whole(model: nn.Module, policy: Policy, tp_size: int) -> None:
    """Say so (rank 0) when the plan left more than half of the model's parameters whole on every rank:
    tensor parallelism then buys little memory (GPT-OSS's shipped plan splits only its embedding)."""
    total = whole = 0
    for p in model.parameters():
        total += p.numel()
        whole += p.numel() if get_tp_info(p) is None else 0
    if total and whole * 2 > total:
        say("meshboost: policy %r leaves %.0f%% of %s's parameters whole on every rank at tp_size=%d (only what "
            "it names is split); pass a custom_policy covering the rest for the memory tensor parallelism should "
            "save", policy.name, 100.0 * whole / total, type(model).__name__, tp_size)


class ShardFormer:
    """Shards a HuggingFace model in place with 1D tensor parallelism.

    >>> model, shared = ShardFormer(ShardConfig(mesh=mesh)).optimize(model)
    """

    def __init__(self, shard_config: ShardConfig):
        shard_config.check_overlap()        # the switch unset (ColossalAI's form) means off here
        self.shard_config = shard_config

    def optimize(self, model: nn.Module, policy: Policy | None = None) -> tuple[nn.Module, list]:
        """Shard `model` in place; returns (model, shared_params) as ColossalAI's ShardFormer does.

        shared_params lists the weights the model reaches under several names (`tied_parameters`),
        which keep being one parameter after sharding. A model built under `LazyInitContext` (every
        parameter on meta) is materialised after sharding, on this process's device, as ColossalAI's
        sharder does: each rank initialises only its shards, with the values the unsharded model gets
        from the same seed (`meshboost.lazy`).
        """
        seed = lazy_seed(model)
        original = copy.deepcopy(model) if seed is not None else None      # on meta: no memory
        shared = self.shard(model, policy)[1]
        if seed is not None:
            materialize(model, original, get_current_device(), seed)
        return model, shared

    def shard(self, model: nn.Module, policy: Policy | None = None) -> tuple[nn.Module, list]:
        """`optimize` without materialising: a lazy model's parameters stay on meta, for a caller that
        cuts it further first (the plugin keeps only its pipeline stages, then materialises those)."""
        if self.shard_config.pipeline_stage_manager is not None and self.shard_config.mesh is None:
            raise NotImplementedError("ShardConfig(pipeline_stage_manager=...): ShardFormer shards over the "
                                      "tensor-parallel group only and never cuts pipeline stages; boost the model with "
                                      "HybridParallelPlugin(pp_size=..., num_microbatches=...), which cuts them")
        tp_size = self.shard_config.tensor_parallel_size
        sharded = [n for n, p in model.named_parameters() if get_tp_info(p) is not None]
        if sharded:
            raise ValueError(f"{type(model).__name__} is already sharded ({sharded[0]} holds a tensor-parallel shard): "
                             "boosting shards the model in place, so boost or shard the original model once; to "
                             "start over, build a fresh model (or load its checkpoint into one)")
        if tp_size > 1:
            policy = policy or get_policy(model)
            plan = self.validate(model, policy, tp_size)
            self._apply(model, policy, plan)
            for what in policy.replicated:
                say("meshboost: %s of %s has no tensor-parallel plan: it stays whole on every tp rank (exact: every "
                    "rank feeds it the same inputs and its gradients are the same on every rank)", what,
                    type(model).__name__)
            _warn_if_mostly_whole(model, policy, tp_size)
            # dropout inside the split regions draws from a per-tp-rank stream (rng.py)
            rng = install_tp_rank_rng(model, self.shard_config.tp_group)
            if plan.seq_stack is not None:        # every activation of a layer is split: hold it per layer,
                for layer in model.base_model.get_submodule(plan.seq_stack):     # so every pipeline stage does
                    rng.hold_across(layer, layer)
        if self.shard_config.loss_chunk_tokens is not None:       # after the vocab-parallel head, at any tp
            install_chunked_loss(model, self.shard_config.loss_chunk_tokens)
        device_type = get_current_device().type
        if self.shard_config.enable_flash_attention:
            use_fast_attention(model, device_type, self._attention_kernels())
        if self.shard_config.enable_fused_normalization:
            fuse_norms(model, device_type)
        if self.shard_config.enable_jit_fused:
            jit_fuse(model, device_type)
        if self.shard_config.enable_sequence_parallelism and tp_size == 1:
            say("meshboost: enable_sequence_parallelism has no effect at tp_size=1 (the sequence is split over "
                "the tensor-parallel ranks)")
        return model, tied_parameters(model)

    def _attention_kernels(self) -> tuple[str, ...] | None:
        """The attention implementations the kernel switch may choose: under context parallelism only those
        its attention wraps (context.py installs around what the model runs after the switch; flash-attn 2
        takes no dense mask); None: any."""
        mesh = self.shard_config.mesh
        return WRAPPED if mesh is not None and mesh.cp_size > 1 else None

    # -- validation: pure, identical on every rank ---------------------------------------------
    def validate(self, model: nn.Module, policy: Policy, tp_size: int) -> ShardPlan:
        config = getattr(model, "config", None)
        if policy.check is not None:
            policy.check(config, tp_size)
        for field_name in policy.divisible:
            value = getattr(config, field_name, None)
            if value is not None and value % tp_size:
                raise ValueError(
                    f"{type(model).__name__}: config.{field_name}={value} is not divisible by tp_size={tp_size}; "
                    f"choose a tp_size that divides {value}")
        base = plan_root(model)
        prefix = (module_paths(model, base) or [""])[0]

        def full(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        compiled = [(pattern_to_regex(p), *parse_style(s)) for p, s in policy.plan.items()]
        by_module: dict[int, Match] = {}
        adapters: dict[int, nn.Module] = {}
        for name, module in base.named_modules(remove_duplicate=False):
            hit = next(((style, args) for regex, style, args in compiled
                        if name and not style.on_parameter and regex.match(name)), None)
            if hit is None:
                continue
            if is_peft_module(module):      # peft wrapped the named module: shard its base, the adapters with it
                layers, suffix, module = adapter_base(full(name), module, hit[0].name, self.shard_config)
                adapters.update({id(layer): layer for layer in layers})
                name += suffix
            match = by_module.get(id(module))
            if match is None:
                hit[0].validate(full(name), module, tp_size, *hit[1])
                by_module[id(module)] = Match(module, [full(name)], *hit)
            elif (match.style, match.args) != hit:
                raise ValueError(f"{full(name)} and {match.paths[0]} are one module that the plan gives two styles "
                                 f"({hit[0].name} and {match.style.name}); give both paths the same style")
        # A replaced module must be replaced wherever the model reaches it, matched by the plan or not:
        # its parameters are sliced in place, so a path left with the native module computes garbage.
        paths: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            if id(module) in by_module:
                paths.setdefault(id(module), []).append(name)
        matches = list(by_module.values())
        for m in matches:
            m.paths = [m.paths[0]] + [p for p in paths[id(m.module)] if p != m.paths[0]]
        # adapters' linears are covered by their base's match, a block style's linears by the block's
        covered = dict(by_module)
        for layer in adapters.values():
            covered.update({id(linear): by_module[id(layer.get_base_layer())] for linear in adapter_linears(layer)})
        covered.update({id(sub): m for m in matches if m.style.block for sub in m.module.modules()
                        if isinstance(sub, nn.Linear)})
        matches = [m for m in matches if m.style.name != BLOCK_INPUT or closed_block(m.module, covered)]
        if not any(m.style.name != BLOCK_INPUT for m in matches):
            raise ValueError(f"policy {policy.name!r} matched no module of {type(model).__name__}; check the "
                             "plan's paths against model.base_model.named_modules()")
        plan = ShardPlan(matches, guards=split_input_guards(model, matches, covered),
                     params=_parameter_matches(base, compiled, full, tp_size), adapters=list(adapters.values()))
        if self.shard_config.enable_sequence_parallelism:
            plan_sequence(model, base, plan, policy, by_module, covered, full, tp_size)
        for pattern, rules in policy.attributes.items():
            regex = pattern_to_regex(pattern)
            for name, module in base.named_modules():
                if regex.match(name):
                    for attr, rule in rules.items():
                        if hasattr(module, attr):
                            value = attribute_rule(rule)(full(name), attr, getattr(module, attr), tp_size)
                            plan.attributes.append((module, attr, value))
        if policy.vocab_parallel:
            self._validate_vocab(model, plan, by_module)
        plan.regions = self._regions(plan, policy)
        return plan

    def _regions(self, plan: ShardPlan, policy: Policy) -> RegionPlan:
        """One region per block input the plan keeps and per sequence-parallel block: gathering in
        the sequence-parallel stack, copying elsewhere. Built before anything is modified; the styles
        then ask it for each linear's role."""
        cfg = self.shard_config
        regions = RegionPlan(seq_stack=plan.seq_stack_full)
        for m in plan.matches:
            if m.style.name == BLOCK_INPUT:
                regions.add(m.paths, cfg.tp_group, cfg.tensor_parallel_size,
                            policy.block_input_kwargs)
        for path, _ in plan.seq_blocks:
            regions.add([path], cfg.tp_group, cfg.tensor_parallel_size, policy.block_input_kwargs)
        return regions

    @staticmethod
    def _validate_vocab(model: nn.Module, plan: ShardPlan, matched: dict) -> None:
        """The input embedding and the LM head, and every other module holding their weight (T5 5.x's
        encoder and decoder `embed_tokens` are modules of their own tied to `shared` by parameter):
        each becomes vocab-parallel, or the model is refused, since a module left native would read
        a weight sliced under it."""
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for module in (embedding, head):
            if module is not None and is_peft_module(module):
                raise NotImplementedError(
                    f"{type(model).__name__}'s {'input embedding' if module is embedding else 'LM head'} is wrapped by "
                    f"peft ({type(module).__name__}: a LoRA adapter, modules_to_save or trainable_token_indices on "
                    "it), and tensor parallelism splits it over the vocabulary, which meshboost does not do for "
                    "adapters; leave it out of target_modules / modules_to_save, or use tp_size=1")
        weights = [m.weight for m in (embedding, head) if isinstance(m, (nn.Embedding, nn.Linear))
                   and id(m) not in matched]             # a module the plan names is its style's business
        if not weights:
            return
        for module, paths in holders(model, weights).values():
            if isinstance(module, nn.Embedding):
                if module.max_norm is not None or module.sparse:
                    raise ValueError("VocabParallelEmbedding does not support max_norm or sparse embeddings; "
                                     "pass a custom_policy with vocab_parallel=False")
                embedding_extras(module)            # raises for a subclass whose behaviour would be lost
                plan.embedding_paths.append(paths)
            elif isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
                plan.head_paths.append(paths)
            else:
                raise ValueError(f"{paths[0]} ({type(module).__name__}) holds the vocabulary weight that tensor "
                                 "parallelism splits (the input embedding or the LM head), and meshboost cannot "
                                 "split it with them; pass custom_policy=Policy(..., vocab_parallel=False) to keep "
                                 "the vocabulary replicated")

    # -- application ---------------------------------------------------------------------------
    def _apply(self, model: nn.Module, policy: Policy, plan: ShardPlan) -> None:
        cfg = self.shard_config
        ctx = ShardContext(cfg.tp_group, cfg.tensor_parallel_size, plan.regions,
                           cfg.make_vocab_size_divisible_by)
        for path, module in plan.seq_blocks:
            STYLES[BLOCK_INPUT].apply(ctx, path, module)         # the sequence gather at its entry
        for m in plan.matches:
            new = m.style.apply(ctx, m.paths[0], m.module, *m.args)
            if new is not None:
                for path in m.paths:
                    _set_submodule(model, path, new)
        for layer in plan.adapters:
            shard_adapter_(layer, ctx.group)
        for path, param, style, args in plan.params:
            style.apply(ctx, path, param, *args)
        for module, attr, value in plan.attributes:
            setattr(module, attr, value)
        for path, module in plan.guards:
            split_input_guard(path, plan.regions.outputs)(module)
        for paths in plan.embedding_paths:
            embedding = model.get_submodule(paths[0])
            new = VocabParallelEmbedding.from_native(embedding, ctx.group, cfg.make_vocab_size_divisible_by)
            for path in paths:
                _set_submodule(model, path, new)
        # The loss runs vocab-parallel only for the model's one LM head (get_output_embeddings).
        parallel_loss = cfg.parallel_output and uses_causal_lm_loss(model) and len(plan.head_paths) == 1
        for paths in plan.head_paths:
            head = model.get_submodule(paths[0])
            new = VocabParallelLMHead.from_native(head, ctx.group, cfg.make_vocab_size_divisible_by,
                                                  parallel_output=parallel_loss)
            for path in paths:
                _set_submodule(model, path, new)
            if parallel_loss:
                model.loss_function = make_causal_lm_loss(new)
        if plan.seq_stack is not None:
            sequence.install(model, plan.seq_stack, ctx.group, ctx.tp_size)
