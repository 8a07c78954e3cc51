"""The BERT example's plugin: the one `--plugin` names with the layout flags, or (`--plugin auto`) the
fastest HybridParallelPlugin layout meshboost's planner predicts fits `--memory_gb` per process; and the
layout a rank reads back from any plugin's mesh. Pure choices: every rank makes the same one.
"""

from __future__ import annotations

import os

from common.train_loop import UsageError


def planned_plugin(args, model_path: str, world_size: int):
    """--plugin auto: the fastest layout meshboost's planner predicts fits --memory_gb per process, for
    the global batch --batch_size x world size (what pure data parallelism would train); the per-replica
    batch and micro-batches follow the layout. The planner is pure: every rank chooses the same."""
    from meshboost import get_current_device
    from meshboost.plan import Planner
    planner = Planner(model_path, architecture="BertForSequenceClassification", gpus=world_size,
                      memory_gb=args.memory_gb, seq=args.max_length, global_batch=args.batch_size * world_size,
                      precision=args.precision, device=get_current_device().type)   # this run's processes
    # this script neither recomputes activations nor accumulates gradients outside a pipeline
    fitting = [e for e in planner.rank(checkpointing=(False,))[0] if e.layout.pp > 1 or e.layout.microbatches == 1]
    if not fitting:
        raise UsageError(f"--plugin auto: no layout of {world_size} processes fits {args.memory_gb} GiB per process "
                         f"with a global batch of {args.batch_size * world_size} x {args.max_length} tokens; raise "
                         "--memory_gb or lower --batch_size / --max_length")
    best = fitting[0]
    lay = best.layout
    args.tp, args.pp, args.zero = lay.tp, lay.pp, lay.zero
    args.batch_size = args.batch_size * world_size // lay.dp
    args.microbatch_size = lay.microbatch_size if lay.pp > 1 else None
    return best


def build_plugin(args, model_path: str | None = None, world_size: int = 1):
    """The Booster for --plugin; the plugin's own error names anything not available yet."""
    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.plugins import TorchDDPPlugin
    if args.plugin == "auto":
        best = planned_plugin(args, model_path, world_size)
        mem = best.memory_bytes_per_rank
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"--plugin auto: the planner chose {best.layout.describe()} (predicted {mem['total'] / 2**30:.2f} GiB "
                  f"per process of {args.memory_gb} GiB: weights {mem['weights'] / 2**30:.3f}, activations "
                  f"{mem['activations'] / 2**30:.3f}); per-replica batch {args.batch_size}", flush=True)
        plugin = best.plugin()
        return plugin, Booster(plugin=plugin)
    if args.plugin == "torch_ddp":
        plugin, amp = TorchDDPPlugin(), None
    elif args.plugin == "torch_ddp_fp16":
        plugin, amp = TorchDDPPlugin(), "fp16"
    elif args.plugin == "low_level_zero":
        try:
            from meshboost.plugins import LowLevelZeroPlugin
        except ImportError as e:
            raise UsageError(f"--plugin low_level_zero: LowLevelZeroPlugin is not available in this meshboost "
                             f"({e}); use --plugin torch_ddp or hybrid_parallel") from e
        plugin, amp = LowLevelZeroPlugin(stage=args.zero or 1, precision=args.precision), None
    else:
        kwargs = {"microbatch_size": args.microbatch_size or 1} if args.pp > 1 else {}
        plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero or 0,
                                      precision=args.precision, **kwargs)
        amp = None
    return plugin, Booster(plugin=plugin, mixed_precision=amp)


def plugin_layout(plugin) -> dict:
    """dp/pp/tp sizes and coordinates of this rank, for any plugin (each declares its mesh)."""
    mesh = plugin.mesh
    return dict(dp=mesh.dp_size, pp=mesh.pp_size, tp=mesh.tp_size, dp_rank=mesh.dp_rank, pp_rank=mesh.pp_rank,
                tp_rank=mesh.tp_rank, dp_group=mesh.dp_group)
