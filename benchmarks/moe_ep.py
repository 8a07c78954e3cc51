"""Expert-parallel mixture-of-experts: expert parameters, all-to-all bytes and step time per rank of a
small Qwen3-MoE trained through the Booster with `HybridParallelConfig(tp_size=tp, ep_size=ep)` on
dp = 2 data-parallel ranks (world = tp x dp processes, each fed its own batch), fp32, against the
formulas of meshboost/shardformer/layers/expert_parallel.py:

    python benchmarks/moe_ep.py [--ep 1 2] [--tp 1] [--dp 2] [--batch 4] [--seq 64] [--steps 20] [--warmup 2]

    (--tp 1 2 adds world 4: tp=2 x ep=1 and tp=2 x ep=2)

- Expert parameters per rank (elements of the parameters named `.experts.`) = the experts' total /
  (ep x tp): ep splits each MoE layer's experts, whole, over the ep ranks; tp cuts inside each expert
  (its intermediate dim). ep=1 replicates every expert on every dp rank.
- All-to-all bytes: one untimed training step (forward, backward, optimizer step) under meshboost's
  `comm_counter`, op "all_to_all", which counts the tensor a rank SENDS to `all_to_all_single`, whole
  (the rows it "sends to itself" included). `_AllToAll.backward` calls `all_to_all_single` too, so
  the backward exchanges are counted as well (told apart here by autograd node: forward / backward).
  The payloads are told apart by dtype (a wrapper around `comm.record_collective` for that step):
  the int64 per-expert counts, and the fp32 token rows. Per MoE layer, with T = local batch x seq
  tokens on this rank, k = top_k, H = hidden, E = experts, and R_r = the (token, expert) rows rank r
  receives (the pairs every rank of its ep group routed to r's experts, counted from the routers'
  expert ids by a forward pre-hook on each experts module, independently of the communication):
      counts,   forward only (not differentiable):         (E + ep) x 8 (the per-expert counts, and
                the out-of-range-id flag sent to each ep rank with them)
      dispatch, forward (rank r sends all its pairs):      T x k x H x 4
      combine,  forward (r sends back the rows it got):    R_r x H x 4
      backward twin of the combine (gradient of the T x k rows r got back):   T x k x H x 4
      backward twin of the dispatch (gradient of the R_r rows r received):    R_r x H x 4
  so a rank's token bytes per step are L x 2 x (T x k + R_r) x H x 4, exact per rank. R_r depends on
  the routing; summed over the ep group R_r adds up to ep x T x k (every pair is sent exactly once),
  so the mean over the ep ranks is exactly L x 4 x T x k x H x 4 (2 x T x k x H x 4 forward, the same
  backward): one rank equals it only when the router balances the ranks. At ep=1 nothing is sent.
- Step time: median over the timed steps of the slowest rank's step (`benchmarks.timing.timed`, after
  a barrier), after the warm-up steps; ep > 1 against ep=1 at the same tp and world. On this CPU
  (gloo, 1 thread per process) the ratio says nothing about GPUs.

Prints a table and one JSON line per configuration (prefix "JSON "), like the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # before transformers loads; inherited by workers

import torch
import torch.distributed as dist

from benchmarks.moe_tp import LR, make_config, moe_layers, timed_steps, training_step
from benchmarks.tally import CollectiveTally

FP32, COUNT = 4, 8                # bytes of a token-row element, of one int64 per-expert count


def all_to_all_tally() -> CollectiveTally:
    """The all_to_all bytes this rank sends, by payload ("tokens": floating rows, "counts": the int64
    per-expert counts) and phase."""
    return CollectiveTally(lambda op, group, t: ("tokens" if t.is_floating_point() else "counts")
                           if op == "all_to_all" else None)

class RouterCounts:
    """Per experts module, the (token, slot) pairs this rank's router sent to each (global) expert,
    read from the expert ids the module is called with, while `recording`."""

    def __init__(self, model, num_experts: int):
        self.recording, self.num_experts, self.counts = False, num_experts, []
        self.layers = 0
        for module in model.modules():
            if isinstance(getattr(module, "down_proj", None), torch.nn.Parameter):
                module.register_forward_pre_hook(self._seen, with_kwargs=True)
                self.layers += 1

    def _seen(self, module, args, kwargs):
        if self.recording:
            ids = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and not t.is_floating_point()]
            self.counts.append(torch.bincount(ids[0].reshape(-1), minlength=self.num_experts).tolist())


def _worker(rank: int, world: int, args, tp: int, ep: int, out_file: str) -> None:
    import transformers

    from meshboost import Booster
    from meshboost.distributed.profiling import comm_counter
    from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin

    config = make_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    experts_total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # check_inputs="first": the step's traffic is the model's (as benchmarks/runners.py)
    plugin = HybridParallelPlugin(HybridParallelConfig(tp_size=tp, ep_size=ep, check_inputs="first"))
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    inner = model.unwrap()
    router = RouterCounts(inner, config.num_experts)
    mesh = plugin.mesh
    # every dp rank its own batch; the tp ranks of one dp rank the same one
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1 + mesh.dp_rank))
    batch = {"input_ids": ids, "labels": ids}

    step = training_step(booster, model, optimizer, batch)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    tally = all_to_all_tally()
    with comm_counter(mesh) as total, tally.listen():
        router.recording = True
        loss = step()
        router.recording = False
    times = timed_steps(step, args.steps)
    ep_ranks = dist.get_process_group_ranks(plugin.ep_group) if ep > 1 else [rank]
    result = {"rank": rank, "ep_rank": mesh.ep_rank, "ep_ranks": ep_ranks, "dp_rank": mesh.dp_rank,
              "expert_params": sum(p.numel() for n, p in inner.named_parameters() if ".experts." in n),
              "experts_total": experts_total, "moe_layers": router.layers, "router_counts": router.counts,
              "comm": total.summary(), "a2a_bytes": dict(tally.bytes), "a2a_calls": dict(tally.calls),
              "step_s": times, "loss": float(loss.detach())}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_file, "a") as f:
            f.write(json.dumps({"tp": tp, "ep": ep, "world": world, "ranks": gathered}) + "\n")


def _op_bytes(summary: dict, op: str) -> tuple[int, int]:
    """(calls, payload bytes) of `op`, summed over groups."""
    calls = sum(g["by_op"].get(op, 0) for g in summary.values())
    return calls, sum(g["bytes_by_op"].get(op, 0) for g in summary.values())


def received_rows(r: dict, by_rank: dict, ep: int) -> list[int]:
    """Per MoE layer, the (token, expert) rows rank `r` receives: the pairs every rank of its ep group
    routed to r's experts [ep_rank E/ep, (ep_rank + 1) E/ep)."""
    c = make_config()
    local = c.num_experts // ep
    lo, hi = r["ep_rank"] * local, (r["ep_rank"] + 1) * local
    return [sum(sum(by_rank[s]["router_counts"][layer][lo:hi]) for s in r["ep_ranks"])
            for layer in range(len(r["router_counts"]))]


def rank_record(r: dict, by_rank: dict, tp: int, ep: int, tokens: int, layers: int) -> dict:
    c = make_config()
    k, h, e = c.num_experts_per_tok, c.hidden_size, c.num_experts
    calls, measured = _op_bytes(r["comm"], "all_to_all")
    parts = {key: r["a2a_bytes"].get(key, 0) for key in
             ("tokens_forward", "tokens_backward", "counts_forward", "counts_backward")}
    if ep > 1:
        rows = received_rows(r, by_rank, ep)
        routed = [sum(layer) for layer in r["router_counts"]]     # T x k per layer, as the router saw it
        if routed != [tokens * k] * layers:
            raise AssertionError(f"rank {r['rank']}: routed pairs {routed}, expected {tokens * k} per layer")
        phase = sum((tokens * k + n) * h * FP32 for n in rows)    # one phase (forward or backward)
        counts = layers * (e + ep) * COUNT                         # E counts and one id flag per ep rank
        balanced = layers * 4 * tokens * k * h * FP32
    else:
        rows, phase, counts, balanced = [0] * layers, 0, 0, 0
    formula = {"tokens_forward": phase, "tokens_backward": phase, "counts_forward": counts, "counts_backward": 0}
    return {
        "rank": r["rank"], "ep_rank": r["ep_rank"], "expert_params": r["expert_params"],
        "received_rows_per_layer": rows, "sent_rows_per_layer": tokens * k if ep > 1 else 0,
        "a2a_calls": calls, "a2a_measured_bytes": measured, "a2a_parts": parts, "a2a_part_calls": r["a2a_calls"],
        "a2a_formula_parts": formula, "a2a_formula_bytes": sum(formula.values()),
        "tokens_measured_bytes": parts["tokens_forward"] + parts["tokens_backward"],
        "tokens_formula_bytes": 2 * phase, "tokens_balanced_formula_bytes": balanced,
        "parts_add_up": sum(parts.values()) == measured,
        "matches_formula": parts == formula and measured == sum(formula.values()),
        "step_s": r["step_s"], "loss": r["loss"],
    }


def record(tp: int, ep: int, world: int, ranks: list[dict], tokens: int) -> dict:
    layers = moe_layers(make_config())
    if ranks[0]["moe_layers"] != layers:
        raise AssertionError(f"the model has {ranks[0]['moe_layers']} experts modules, the config says {layers}")
    by_rank = {r["rank"]: r for r in ranks}
    per_rank = [rank_record(r, by_rank, tp, ep, tokens, layers) for r in ranks]
    formula = ranks[0]["experts_total"] / (ep * tp)
    tokens_mean = statistics.mean(p["tokens_measured_bytes"] for p in per_rank)
    balanced = per_rank[0]["tokens_balanced_formula_bytes"]
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    return {
        "tp": tp, "ep": ep, "dp": world // tp, "edp": world // tp // ep, "world": world,
        "tokens_per_rank": tokens, "moe_layers": layers,
        "expert_params_per_rank": [p["expert_params"] for p in per_rank], "expert_params_total": ranks[0]["experts_total"],
        "expert_params_formula": formula,
        "expert_params_match": all(p["expert_params"] == formula for p in per_rank),
        "ranks": [{k: v for k, v in p.items() if k not in ("step_s", "loss")} for p in per_rank],
        "tokens_mean_over_ranks_bytes": tokens_mean, "tokens_balanced_formula_bytes": balanced,
        "tokens_mean_matches_balanced": tokens_mean == balanced,
        "a2a_matches_formula": all(p["matches_formula"] for p in per_rank),
        "step_ms_median": 1e3 * statistics.median(steps), "step_ms_all": [1e3 * t for t in steps],
        "loss_per_rank": [p["loss"] for p in per_rank],
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(records: list[dict]) -> str:
    head = ("tp", "ep", "dp", "rank", "expert params (total/(ep*tp))", "eq", "a2a calls", "a2a sent B (formula)",
            "eq", "tokens fwd+bwd B (formula)", "counts B (formula)", "rows sent/recv per layer", "step ms")
    rows = [head]
    for r in records:
        for p in r["ranks"]:
            f, m = p["a2a_formula_parts"], p["a2a_parts"]
            recv = "/".join(str(n) for n in p["received_rows_per_layer"])
            rows.append((str(r["tp"]), str(r["ep"]), str(r["dp"]), str(p["rank"]),
                         f"{p['expert_params']} ({r['expert_params_formula']:.0f})",
                         _yes(p["expert_params"] == r["expert_params_formula"]), str(p["a2a_calls"]),
                         f"{p['a2a_measured_bytes']} ({p['a2a_formula_bytes']})", _yes(p["matches_formula"]),
                         f"{m['tokens_forward']}+{m['tokens_backward']} ({f['tokens_forward']}+{f['tokens_backward']})",
                         f"{m['counts_forward'] + m['counts_backward']} ({f['counts_forward']})",
                         f"{p['sent_rows_per_layer']} / {recv}", f"{r['step_ms_median']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="ep sizes (each divides --dp)")
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tp sizes; world = tp x dp processes")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (ep x edp)")
    p.add_argument("--batch", type=int, default=4, help="local batch (per dp rank)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    args = p.parse_args(argv)
    for ep in args.ep:
        if args.dp % ep:
            p.error(f"--ep {ep} does not divide --dp {args.dp}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from meshboost.testing import spawn
    with tempfile.TemporaryDirectory() as root:
        out_file = os.path.join(root, "moe_ep.jsonl")
        for tp in args.tp:
            for ep in args.ep:
                spawn(_worker, tp * args.dp, args, tp, ep, out_file)
        with open(out_file) as f:
            runs = [json.loads(line) for line in f]
    tokens = args.batch * args.seq
    records = [record(run["tp"], run["ep"], run["world"], run["ranks"], tokens) for run in runs]
    c = make_config()
    print(f"Qwen3-MoE: {c.num_hidden_layers} layers ({moe_layers(c)} MoE), hidden {c.hidden_size}, "
          f"{c.num_experts} experts (I={c.moe_intermediate_size}, top-{c.num_experts_per_tok}), vocab "
          f"{c.vocab_size}; dp={args.dp} ranks, each its own batch {args.batch} x seq {args.seq} = {tokens} tokens; "
          f"fp32, {'nccl' if torch.cuda.is_available() else 'gloo'}, 1 thread/process; all-to-all of one step "
          f"(fwd+bwd+optimizer) per rank; median of {args.steps} steps (slowest rank) after {args.warmup} warm-up")
    print(format_table(records))
    print("a2a sent B = comm_counter's all_to_all payload (the tensor a rank sends, its own rows included), forward "
          "and backward; (formula) per layer: counts (E+ep)*8 (fwd only),\n"
          "tokens fwd = bwd = (T*k + R)*H*4, T*k rows dispatched, R rows received (from the routers' expert ids) "
          "and sent back; the backward twins send the gradients the same sizes.")
    for r in records:
        if r["ep"] > 1:
            print(f"tp={r['tp']} ep={r['ep']}: token bytes, mean over ranks {r['tokens_mean_over_ranks_bytes']:.0f} vs "
                  f"L*4*T*k*H*4 = {r['tokens_balanced_formula_bytes']} "
                  f"({_yes(r['tokens_mean_matches_balanced'])}: every pair sent once; one rank equals it only under "
                  f"balanced routing); expert params match: {_yes(r['expert_params_match'])}")
    base = {(r["tp"], r["world"]): r for r in records if r["ep"] == 1}
    for r in records:
        ref = base.get((r["tp"], r["world"]))
        if r["ep"] > 1 and ref is not None:
            print(f"step time, world {r['world']} tp={r['tp']}: ep={r['ep']} {r['step_ms_median']:.1f} ms vs ep=1 "
                  f"{ref['step_ms_median']:.1f} ms, ratio {r['step_ms_median'] / ref['step_ms_median']:.2f} "
                  "(CPU, gloo, 1 thread/process: not indicative of GPU speed)")
    for r in records:
        print("JSON " + json.dumps(r))
    return records


if __name__ == "__main__":
    main()
