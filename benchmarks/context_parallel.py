"""Context parallelism (`HybridParallelConfig(cp_size=cp, cp_mode=...)`, meshboost/shardformer/context.py)
against one process and against Megatron-style sequence parallelism over tp ("split_gather",
`HybridParallelConfig(tp_size=tp, sequence_parallel=True)`): activation
bytes saved for backward per rank, the longest sequence that fits a memory budget, and the cp group's
bytes per layer against each mode's formula. A small Llama causal LM built from a `LlamaConfig` (hidden
128, 4 layers, 8 heads, 4 kv heads, head_dim 16, vocab 512, SDPA), fp32, trained through the Booster
(AdamW); world = sp (or tp) processes, dp = 1, every rank fed the same batch:

    python benchmarks/context_parallel.py [--sp 1 2 4] [--tp 2 4] [--modes all_to_all ring_attn]
        [--batch 1] [--seq 512] [--start-seq 256] [--max-seq 8192] [--budget BYTES] [--layers 4]
        [--budget-factor 1.25] [--kv-heads 4] [--attn sdpa]

- Saved activations per rank: the bytes of the tensors autograd saves for backward during one
  training forward (`torch.autograd.graph.saved_tensors_hooks`), each storage counted once (deduped by
  `untyped_storage().data_ptr()`, its whole `nbytes()`), parameters excluded (a saved tensor sharing a
  storage with a parameter: the weights themselves, their transposes). The figure is the largest over
  the ranks; "ratio" is it over sp=1's at the same batch x seq. Expected ~1/sp for all_to_all (every
  activation outside attention is the rank's S/sp tokens; inside it, the whole sequence of H/sp
  heads), ~1/tp for split_gather, and more than 1/sp for ring_attn: every rank also saves the whole
  sequence's keys and values (of each layer; as SDPA is handed them: repeated to the H query heads,
  [B, H, S, D] each) and the mask of its queries over every key, which torch's CPU SDPA saves as fp32
  ([B, 1, S/sp, S] x 4 bytes: quadratic in S). all_to_all sits slightly above 1/sp: the attention output
  after its all-to-all back is a storage of its own ([B, S/sp, H x D] per layer: exactly the measured
  excess), where in one process o_proj's input shares the storage of the output SDPA saves.
- Longest sequence: with those saved bytes as the memory model, the sequence length is doubled from
  --start-seq (measuring each) until a rank's saved activations exceed --budget (default:
  --budget-factor x sp=1's at --seq: one process fits --seq and not 2 x --seq, as its bytes grow
  linearly in S with SDPA; the 1.25 leaves room for the few per-rank bytes that do not shrink 1/sp, at
  1.0 all_to_all sp=2 misses 2 x --seq by ~5%) or --max-seq is reached; reported is the longest
  power-of-two length measured within the budget (">=" when the cap stopped the search).
- Communication per layer: one training step (forward, backward, optimizer step) at --seq under
  meshboost's `comm_counter(mesh)`, the cp group's payload bytes (what `comm.record_collective`
  counts), divided by the layers; forward and backward told apart by autograd node. With B = batch,
  S = sequence, D = head_dim, H = query heads, Hkv = kv heads (per tp rank; tp = 1 here), 4 bytes:
    all_to_all: `comm.all_to_all_single` counts the tensor a rank passes in, whole (the 1/sp of it it
      keeps included): forward q: B x H x S/sp x D x 4, k and v: B x Hkv' x S/sp x D x 4 each (Hkv' =
      Hkv, or H when Hkv % sp != 0: the kv heads are repeated to the query heads first), the output
      [B, S, H/sp, D] back: B x S x H/sp x D x 4 (= q's); backward `_AllToAll.backward` sends each
      gradient back, the same sizes. Per layer: 2 x 2 x B x (S/sp) x D x (H + Hkv') x 4.
    ring_attn: `comm.all_gather` counts its output, the gathered tensor (every rank's piece): forward
      k and v: B x Hkv x S x D x 4 each; `comm.reduce_scatter` (the backward of `gather_from_seq`)
      counts its input, the whole-sequence gradient: the same sizes. Per layer: 4 x B x Hkv x S x D x 4.
  Both must equal the measured bytes exactly ("eq"). The cp group also carries one fp32 all-reduce
  (4 bytes) forward: the loss averaged over the cp ranks, printed apart. comm_counter's other figure, the ring bytes a
  rank sends, is (sp - 1)/sp of these payloads for every op here. sp=1 and split_gather have no cp
  group (split_gather's tp traffic is benchmarks/sequence_parallel.py's subject).
  The loss of that step is printed too: the same weights and batch, so every layout's should agree.

Prints three tables and one JSON line per layout (prefix "JSON "), like the other benchmarks. On this
CPU (gloo) the bytes are exact; times are not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # before transformers loads; inherited by workers

import torch
import torch.distributed as dist

from benchmarks.moe_tp import LR, training_step
from benchmarks.tally import CollectiveTally

FP32 = 4
ALL_TO_ALL, RING_ATTN, SPLIT_GATHER = "all_to_all", "ring_attn", "split_gather"
CP_OPS = {ALL_TO_ALL: ("all_to_all",), RING_ATTN: ("all_gather", "reduce_scatter")}


def make_config(args):
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=args.layers, num_attention_heads=8,
                                      num_key_value_heads=args.kv_heads, head_dim=16,
                                      max_position_embeddings=max(args.max_seq, args.seq), use_cache=False)
    config._attn_implementation = args.attn
    return config


def layouts(args) -> list[dict]:
    """Every layout to run: (name, world, mode, size), sp=1 first (the reference)."""
    out = [{"name": "sp=1", "world": 1, "mode": None, "size": 1}] if 1 in args.sp else []
    for mode in args.modes:
        out += [{"name": f"{mode} sp={s}", "world": s, "mode": mode, "size": s} for s in args.sp if s > 1]
    out += [{"name": f"split_gather tp={t}", "world": t, "mode": SPLIT_GATHER, "size": t} for t in args.tp if t > 1]
    return out


def plugin_config(layout: dict):
    from meshboost.plugins import HybridParallelConfig
    # check_inputs="never": the cp group's traffic is the model's only
    if layout["mode"] is None:
        return HybridParallelConfig(check_inputs="never")
    if layout["mode"] == SPLIT_GATHER:
        return HybridParallelConfig(tp_size=layout["size"], sequence_parallel=True, check_inputs="never")
    return HybridParallelConfig(cp_size=layout["size"], cp_mode=layout["mode"], check_inputs="never")


def saved_storage_bytes(run, params) -> tuple[int, int, object]:
    """(bytes, storages) autograd saves for backward during `run()`, each storage once, the storages of
    `params` excluded; and run's result. Unlike `meshboost.optim.memory.saved_activation_bytes` (each
    view once, its own elements, parameters included) this counts what the saved tensors keep alive."""
    excluded = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            if storage.data_ptr() not in excluded:
                storages[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return sum(storages.values()), len(storages), result


def group_tally(group) -> CollectiveTally:
    """Payload bytes of the collectives over `group`, by op and phase."""
    return CollectiveTally(lambda op, g, t: op if g is group else None)

def batch_of(config, batch: int, seq: int) -> dict:
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "labels": ids}


def _largest(value: int) -> int:
    """The largest `value` over the world (every rank then takes the same decisions)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _saved(model, config, params, batch: int, seq: int) -> tuple[int, int]:
    """(largest saved bytes over the ranks, this rank's storages) of one training forward of `model`."""
    nbytes, count, out = saved_storage_bytes(lambda: model(**batch_of(config, batch, seq)), params)
    del out                                  # frees the graph: no backward
    return _largest(nbytes), count


def _worker(rank: int, world: int, args, todo: list[dict], budget: int | None, out_file: str) -> None:
    import transformers

    from meshboost import Booster
    from meshboost.distributed.profiling import comm_counter
    from meshboost.plugins import HybridParallelPlugin

    for layout in todo:
        config = make_config(args)          # a fresh one: the cp modes switch the model's config to their attention
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        plugin = HybridParallelPlugin(plugin_config(layout))
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, optimizer)
        params = list(model.unwrap().parameters())
        mesh = plugin.mesh
        cp = layout["mode"] in CP_OPS
        fixed = batch_of(config, args.batch, args.seq)

        training_step(booster, model, optimizer, fixed)()            # warm-up (lazy state)
        dist.barrier()
        tally = group_tally(mesh.group("cp") if cp else None)
        with comm_counter(mesh) as counter, tally.listen():
            loss = training_step(booster, model, optimizer, fixed)()
        summary = counter.summary()
        cp_bytes = {op: summary.get("cp", {}).get("bytes_by_op", {}).get(op, 0) for op in CP_OPS.get(layout["mode"], ())}

        at_seq, storages = _saved(model, config, params, args.batch, args.seq)
        limit = budget if budget is not None else int(args.budget_factor * at_seq)
        search, seq = [], args.start_seq
        while seq <= args.max_seq:
            if seq % (2 * layout["size"]):
                seq *= 2
                continue
            nbytes = at_seq if seq == args.seq else _saved(model, config, params, args.batch, seq)[0]
            search.append([seq, nbytes])
            if nbytes > limit:
                break
            seq *= 2
        result = {"rank": rank, "saved_bytes": at_seq, "saved_storages": storages, "loss": float(loss.detach()),
                  "cp_bytes": cp_bytes, "phase_bytes": dict(tally.bytes), "phase_calls": dict(tally.calls),
                  "search": search, "budget": limit}
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(out_file, "a") as f:
                f.write(json.dumps({**layout, "ranks": gathered}) + "\n")
        del model, optimizer, booster, plugin
        import gc
        gc.collect()


def comm_formula(args, mode: str, sp: int) -> dict[str, int]:
    """Per layer per rank, the cp group's payload bytes by op and phase (see the module docstring)."""
    b, s, d, h, kv = args.batch, args.seq, 16, 8, args.kv_heads
    if mode == ALL_TO_ALL:
        kv_eff = kv if kv % sp == 0 else h
        phase = b * (s // sp) * d * (2 * h + 2 * kv_eff) * FP32          # q and output, k and v
        return {"all_to_all_forward": phase, "all_to_all_backward": phase}
    gathered = 2 * b * kv * s * d * FP32                                  # k and v, whole sequence
    return {"all_gather_forward": gathered, "reduce_scatter_backward": gathered}


def record(args, run: dict, reference: int | None) -> dict:
    ranks = run["ranks"]
    saved = max(r["saved_bytes"] for r in ranks)
    search = ranks[0]["search"]
    budget = ranks[0]["budget"]
    fits = [s for s, n in search if n <= budget]
    capped = bool(search) and search[-1][1] <= budget
    out = {"layout": run["name"], "mode": run["mode"] or "none", "size": run["size"], "world": run["world"],
           "batch": args.batch, "seq": args.seq, "saved_bytes_per_rank": saved,
           "saved_bytes_by_rank": [r["saved_bytes"] for r in ranks], "saved_storages_rank0": ranks[0]["saved_storages"],
           "ratio_to_sp1": saved / reference if reference else None,
           "budget_bytes": budget, "search": search, "longest_seq_within_budget": fits[-1] if fits else None,
           "stopped_by_cap": capped, "loss_per_rank": [r["loss"] for r in ranks]}
    if run["mode"] in CP_OPS:
        layers = args.layers
        per_layer = comm_formula(args, run["mode"], run["size"])
        expected = {k: v * layers for k, v in per_layer.items()}
        rank_rows = []
        for r in ranks:
            measured = sum(r["cp_bytes"].values())
            ops = CP_OPS[run["mode"]]
            phases = {k: v for k, v in r["phase_bytes"].items() if k.rsplit("_", 1)[0] in ops}
            rank_rows.append({"rank": r["rank"], "cp_bytes_by_op": r["cp_bytes"], "measured_bytes": measured,
                              "measured_per_layer": measured / layers, "phase_bytes": phases,
                              "other_cp_bytes": {k: v for k, v in r["phase_bytes"].items() if k not in phases},
                              "phase_calls": r["phase_calls"],
                              "matches_formula": measured == sum(expected.values()) and phases == expected
                              and sum(phases.values()) == measured})
        out.update({"comm_formula_per_layer": per_layer, "comm_formula_per_layer_total": sum(per_layer.values()),
                    "comm_ranks": rank_rows, "comm_matches_formula": all(x["matches_formula"] for x in rank_rows)})
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(f"{c!s:>{w}}" for c, w in zip(row, widths)) for row in rows)


def format_tables(records: list[dict]) -> str:
    memory = [("layout", "world", "saved B/rank", "MiB", "ratio to sp=1", "1/size", "storages", "loss")]
    for r in records:
        memory.append((r["layout"], r["world"], r["saved_bytes_per_rank"], f"{r['saved_bytes_per_rank'] / 2**20:.2f}",
                       "-" if r["ratio_to_sp1"] is None else f"{r['ratio_to_sp1']:.3f}", f"{1 / r['size']:.3f}",
                       r["saved_storages_rank0"], f"{r['loss_per_rank'][0]:.6f}"))
    longest = [("layout", "budget B", "longest seq", "its saved B/rank", "measured (seq: B)")]
    for r in records:
        at = dict(map(tuple, r["search"]))
        seq = r["longest_seq_within_budget"]
        longest.append((r["layout"], r["budget_bytes"], "none" if seq is None else
                        (">=" if r["stopped_by_cap"] else "") + str(seq), at.get(seq, "-"),
                        " ".join(f"{s}:{n}" for s, n in r["search"])))
    comm = [("layout", "rank", "cp ops (payload B, all layers)", "per layer fwd+bwd B", "formula per layer", "eq",
             "other cp ops B")]
    for r in records:
        for x in r.get("comm_ranks", ()):
            ops = " ".join(f"{k}={v}" for k, v in x["phase_bytes"].items())
            comm.append((r["layout"], x["rank"], ops, f"{x['measured_per_layer']:.0f}",
                         " + ".join(str(v) for v in r["comm_formula_per_layer"].values()) +
                         f" = {r['comm_formula_per_layer_total']}", _yes(x["matches_formula"]),
                         " ".join(f"{k}={v}" for k, v in x["other_cp_bytes"].items()) or "-"))
    return "\n\n".join((_table(memory), _table(longest), _table(comm)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, nargs="*", default=[1, 2, 4], help="context-parallel sizes (1: one process)")
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4], help="split_gather tp sizes")
    p.add_argument("--modes", nargs="*", default=[ALL_TO_ALL, RING_ATTN], choices=[ALL_TO_ALL, RING_ATTN])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512, help="the sequence of the saved bytes and the comm step")
    p.add_argument("--start-seq", type=int, default=256, help="the budget search starts here (doubling)")
    p.add_argument("--max-seq", type=int, default=8192, help="the budget search stops here")
    p.add_argument("--budget", type=int, default=None, help="bytes of saved activations per rank "
                   "(default: --budget-factor x sp=1's at --seq; needs 1 in --sp)")
    p.add_argument("--budget-factor", type=float, default=1.25)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4, help="kv heads of the 8 query heads")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = p.parse_args(argv)
    if args.budget is None and 1 not in args.sp:
        p.error("--budget is needed without sp=1 in --sp")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from meshboost.testing import spawn
    todo = layouts(args)
    with tempfile.TemporaryDirectory() as root:
        out_file = os.path.join(root, "context_parallel.jsonl")
        budget = args.budget
        for world in sorted({x["world"] for x in todo}):
            spawn(_worker, world, args, [x for x in todo if x["world"] == world], budget, out_file)
            if budget is None:                      # sp=1 ran first: its bytes at --seq
                with open(out_file) as f:
                    budget = int(args.budget_factor * json.loads(f.readline())["ranks"][0]["saved_bytes"])
        with open(out_file) as f:
            runs = {run["name"]: run for run in map(json.loads, f)}
    runs = [runs[x["name"]] for x in todo]
    reference = next((max(r["saved_bytes"] for r in run["ranks"]) for run in runs if run["mode"] is None), None)
    records = [record(args, run, reference) for run in runs]
    c = make_config(args)
    print(f"Llama: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads "
          f"({c.num_key_value_heads} kv) x head_dim {c.head_dim}, vocab {c.vocab_size}, {args.attn}, fp32, "
          f"{'nccl' if torch.cuda.is_available() else 'gloo'}; batch {args.batch} x seq {args.seq}, world = sp or tp, "
          "dp = 1, every rank the same batch")
    print(format_tables(records))
    print("saved B/rank: storages autograd saves in one training forward (each once, parameters excluded), largest "
          "over the ranks.\nbudget search: seq doubled from --start-seq, each measured; longest = the last within the "
          "budget ('>=': --max-seq reached).\ncp ops: comm_counter payload bytes of the cp group in one step, all "
          "layers; per layer = total / layers; formula: all_to_all fwd = bwd = B*(S/sp)*D*(2H + 2Hkv')*4, ring_attn "
          "all-gather fwd = reduce-scatter bwd = 2*B*Hkv*S*D*4; other cp ops: the loss averaged over the cp ranks "
          "(one fp32 all-reduce).")
    for r in records:
        print("JSON " + json.dumps(r))
    return records


if __name__ == "__main__":
    main()
