"""Model and plugin set-up for the causal-LM example: the config (`--model` or `--model-config` x
`--size`), the model built under `LazyInitContext` (each rank initialises only its shards at `boost`),
the plugin the layout flags describe (ColossalAI's keywords, `meshboost.booster.plugin`) or the one
meshboost's planner picks (`--plugin auto`); the flops per token are examples/common/train_loop.py's.

Flags whose features other parts of meshboost may not have yet (--fp8, --compile, --dp-replicate, HSDP with
--zero 3) and --lora-experts are passed on as the plugin's or peft's keywords, never emulated: where this meshboost
refuses them, its refusal is what the script prints.
"""

from __future__ import annotations


# --model-config FAMILY --size SIZE: transformers config fields (random weights; no download).
SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, head_dim=16),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1408, head_dim=64),
}
# per family: its fields beyond SIZES (experts sized from the size's intermediate_size / 4)
FAMILIES = {
    "llama": {}, "qwen3": {}, "mistral": {}, "qwen2": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                      moe_intermediate_size="I/4"),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads="H", moe_intermediate_size="I/4", n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                        q_lora_rank="h/2", kv_lora_rank="h/4", qk_rope_head_dim="d/2", qk_nope_head_dim="d/2",
                        v_head_dim="d", rope_scaling=None),
}


# what a hub id's snapshot needs here: config, tokenizer and chat template, weights (.bin only without safetensors)
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def local_model(args) -> None:
    """--model (and --tokenizer) given as a hub id become the local snapshot folder (downloaded or cached;
    every rank reads the same files), so the config, the tokenizer and `booster.load_model` read one folder.
    A hub id that is not there raises the hub's OSError (the caller names the flag)."""
    from pathlib import Path
    for dest in ("model", "tokenizer"):
        value = getattr(args, dest)
        if value is None or Path(value).expanduser().is_dir():
            continue
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(value, allow_patterns=HUB_FILES))
        if dest == "model" and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(value, allow_patterns=HUB_FILES + ["*.bin"]))
        setattr(args, dest, str(folder))


def model_config(args, vocab_size: int):
    """The transformers config of --model (its own) or of --model-config at --size, with the
    tokenizer's vocabulary and positions for --seq."""
    from transformers import AutoConfig
    if args.model:
        return AutoConfig.from_pretrained(args.model)
    fields = dict(SIZES[args.size])
    sizes = {"I/4": fields["intermediate_size"] // 4, "H": fields["num_attention_heads"],
             "h/2": fields["hidden_size"] // 2, "h/4": fields["hidden_size"] // 4,
             "d/2": fields["head_dim"] // 2, "d": fields["head_dim"]}
    for key, value in FAMILIES[args.model_config].items():
        fields[key] = sizes.get(value, value) if isinstance(value, str) else value
    return AutoConfig.for_model(args.model_config, vocab_size=vocab_size, max_position_embeddings=max(args.seq, 128),
                                use_cache=False, tie_word_embeddings=False, **fields)


def build_model(args, config):
    """The causal LM on the meta device (LazyInitContext): `boost` initialises each rank's shards from
    the layout-independent seeds; --model's weights are then read by `booster.load_model` (only each
    rank's slices). With --quantize, built whole instead (see below), its weights already in place.
    --checkpointing: transformers' own activation checkpointing."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshboost.lazy import LazyInitContext
    if args.quantize:
        # QLoRA quantizes each base weight whole (its scales share one mean), so the base is built whole on every
        # rank: --model's weights, or the config's init from --seed (the same values at every layout)
        if args.model:
            model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=torch.float32)
        else:
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        # with --lora too: enable_lora builds the adapters on meta as well, and boost initialises them (peft's init)
        with LazyInitContext(seed=args.seed):
            model = AutoModelForCausalLM.from_config(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    return model


def lora_config(args):
    """peft's LoraConfig for --lora: adapters on --lora-targets; --lora-experts adds the packed expert
    weights (peft's target_parameters), which meshboost splits with their experts at any --tp / --ep."""
    import peft
    extra = {}
    if args.lora_experts:
        extra["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    return peft.LoraConfig(task_type="CAUSAL_LM", r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                           target_modules=[t for t in args.lora_targets.split(",") if t], **extra)


def plugin_keywords(args) -> dict:
    """ColossalAI's HybridParallelPlugin / MoeHybridParallelPlugin keywords for the layout flags."""
    kw = dict(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero, precision=args.precision,
              max_norm=args.max_grad_norm)
    if args.pp > 1:
        kw["microbatch_size"] = args.microbatch_size
    if args.sp_mode == "split_gather":
        kw.update(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    elif args.sp > 1:
        kw.update(sp_size=args.sp, enable_sequence_parallelism=True, sequence_parallelism_mode=args.sp_mode)
    if args.ep > 1:
        kw["ep_size"] = args.ep
    # features built elsewhere in meshboost: passed as the plugin's keywords, refused by it where absent
    if args.fp8:
        kw["use_fp8"] = True
    if args.compile:
        kw["compile"] = True
    if args.dp_replicate > 1:
        kw["dp_replicate_size"] = args.dp_replicate
    return kw


def build_plugin(args, config, world_size: int):
    """(plugin, planner's Estimate or None). --plugin auto: the fastest layout meshboost.plan predicts
    fits --memory-gb per process for the global batch --batch-size x world size; the flags take its
    values (pure: every rank chooses the same)."""
    from meshboost.booster.plugin import HybridParallelPlugin, MoeHybridParallelPlugin
    if args.plugin == "auto":
        best = planned_layout(args, config, world_size)
        return best.plugin(), best
    kw = plugin_keywords(args)
    if "ep_size" in kw:
        return MoeHybridParallelPlugin(**kw), None
    return HybridParallelPlugin(**kw), None


def planned_layout(args, config, world_size: int):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from meshboost import get_current_device
    from meshboost.plan import Planner
    architecture = (config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]])[0]
    planner = Planner(config, architecture=architecture,
                      gpus=world_size, memory_gb=args.memory_gb, seq=args.seq,
                      global_batch=args.batch_size * world_size, precision=args.precision,
                      device=get_current_device().type)       # the processes planned are this run's
    # this loop accumulates no gradients outside a pipeline; --checkpointing is the user's choice
    fitting = [e for e in planner.rank(checkpointing=(bool(args.checkpointing),))[0]
               if e.layout.pp > 1 or e.layout.microbatches == 1]
    if not fitting:
        raise ValueError(f"--plugin auto: no layout of {world_size} processes fits {args.memory_gb} GiB per process "
                         f"with a global batch of {args.batch_size * world_size} x {args.seq} tokens; raise "
                         "--memory-gb or lower --batch-size / --seq")
    best = fitting[0]
    lay = best.layout
    args.tp, args.pp, args.zero, args.ep = lay.tp, lay.pp, lay.zero, lay.ep
    # the planner's cp is this script's --sp (ColossalAI's sp_size); its split_gather is --sp-mode split_gather
    args.sp, args.sp_mode = lay.cp, "split_gather" if lay.sequence_parallel else lay.cp_mode
    args.batch_size = args.batch_size * world_size // lay.dp       # the sp ranks of a replica share its rows
    args.microbatch_size = lay.microbatch_size if lay.pp > 1 else None
    return best


def describe_plan(best, memory_gb: float) -> str:
    mem = best.memory_bytes_per_rank
    gib = 2**30
    return (f"--plugin auto: the planner chose {best.layout.describe()}; predicted peak per rank "
            f"{mem['total'] / gib:.3f} GiB of {memory_gb} GiB (weights {mem['weights'] / gib:.3f}, activations "
            f"{mem['activations'] / gib:.3f})")
