"""Tensor-parallel mixture-of-experts: parameters, communication and step time per rank of a small
Qwen3-MoE trained through the Booster at tp=1 (one process) and tp=2 (two processes), fp32, against
the formulas of meshboost/shardformer/layers/experts.py:

    python benchmarks/moe_tp.py [--tp 1 2] [--batch 4] [--seq 64] [--steps 10] [--warmup 2]

- Expert parameters per rank (elements of the parameters named `.experts.`) = the experts' total / tp:
  every expert is cut on its intermediate dim I, none is replicated.
- Communication: one untimed training step (forward, backward, optimizer step) under meshboost's
  `comm_counter`, per group and collective kind. The MoE layers' own all-reduces are told apart by a
  second counter that only listens inside the experts' forward (g: the all-reduce of their output) and
  inside the backward of the f nodes created at their inputs (identified by autograd node), and are
  compared with, per MoE layer and T = batch x seq tokens (4 bytes per fp32 element):
      forward  g: T x hidden x 4            (the experts' output, a partial sum over I)
      backward f: T x hidden x 4            (the hidden-state gradient)
                + T x top_k x 4             (the routing-weight gradient)
  `comm_counter` reports both the payload (bytes of the logical tensor) and the ring bytes a rank sends
  (2(P-1)/P x payload for an all-reduce: 1 x at P = 2); both columns are printed against the formula.
  The rest of the tp traffic (attention, vocab-parallel embedding, LM head, cross-entropy) is compared
  with benchmarks/theory.py's terms with the MLP removed (attention: 1 forward + 1 backward all-reduce),
  plus Qwen3's per-head q/k RMSNorm weights: replicated, used by each rank on its heads only, so their
  gradients (head_dim x 4 bytes each, 2 per layer) are all-reduced over tp.
- Step time: median over the timed steps of the slowest rank's step (`benchmarks.timing.timed`, after
  a barrier), after the warm-up steps.

Prints a table and one JSON line per tp (prefix "JSON "), like the other benchmarks.
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

from benchmarks.theory import ring_factor
from benchmarks.timing import timed

CONFIG = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
          "num_hidden_layers": 2, "vocab_size": 1024, "intermediate_size": 512, "moe_intermediate_size": 256,
          "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "use_cache": False}
LR = 1e-4



def training_step(booster, model, optimizer, batch: dict):
    """One forward, backward and optimizer step of the boosted model on `batch`, as a closure returning
    the loss (the step both MoE benchmarks time)."""
    def step():
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def timed_steps(step, steps: int) -> list[float]:
    """Seconds of `steps` calls of `step`, each after a barrier (`benchmarks.timing.timed`)."""
    times = []
    for _ in range(steps):
        dist.barrier()
        times.append(timed(step))
    return times

def make_config():
    import transformers
    return transformers.Qwen3MoeConfig(**CONFIG)


def _is_experts(module) -> bool:
    return isinstance(getattr(module, "down_proj", None), torch.nn.Parameter) and \
        isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)


class MoeWindow:
    """Says whether a collective belongs to an experts module: inside its forward (g), or inside the
    backward of an f node made at its inputs (the autograd nodes seen by a pre-hook that runs after
    meshboost's, so it receives f's outputs)."""

    def __init__(self, model):
        self.recording, self.depth, self.nodes = False, 0, []
        self.layers = 0
        for module in model.modules():
            if _is_experts(module):
                module.register_forward_pre_hook(self._enter, with_kwargs=True)
                module.register_forward_hook(self._leave)
                self.layers += 1

    def _enter(self, module, args, kwargs):
        if self.recording:
            self.depth += 1
            self.nodes += [t.grad_fn for t in (*args, *kwargs.values())
                           if torch.is_tensor(t) and t.grad_fn is not None]

    def _leave(self, module, args, output):
        if self.recording:
            self.depth -= 1

    def active(self) -> bool:
        node = torch._C._current_autograd_node()
        return self.depth > 0 or (node is not None and any(node is n for n in self.nodes))

    def listen(self, counter):
        """Make `counter` (a `comm_counter`) count only the experts' collectives."""
        add = counter.add
        counter.add = lambda op, group, nbytes: add(op, group, nbytes) if self.active() else None
        return counter


def moe_layers(c) -> int:
    """MoE decoder layers by the config (transformers' Qwen3-MoE rule), not by what the model built."""
    return sum(1 for i in range(c.num_hidden_layers) if i not in c.mlp_only_layers and c.num_experts > 0
               and (i + 1) % c.decoder_sparse_step == 0)


def formulas(tp: int, tokens: int, layers: int) -> dict:
    """Per-step all-reduce payload bytes (and calls) the formulas give, fp32."""
    c = make_config()
    h, k = c.hidden_size, c.num_experts_per_tok
    if tp == 1:
        return {"moe_calls": 0, "moe_payload": 0, "rest_calls": 0, "rest_payload": 0}
    act = tokens * h * 4
    moe_fwd, moe_bwd = act, act + tokens * k * 4
    # attention 1 fwd (o_proj) + 1 bwd (f at q/k/v) per layer; embedding fwd; lm head bwd; CE max + sums;
    # Qwen3's q_norm / k_norm weights ([head_dim], replicated, each rank applies them to its heads only):
    # their gradients are summed over tp (linear.sum_grad_over_tp), 2 per layer
    rest = [(2 * c.num_hidden_layers, act), (1, act), (1, act), (1, tokens * 4), (1, 2 * tokens * 4),
            (2 * c.num_hidden_layers, c.head_dim * 4)]
    return {"moe_calls": 3 * layers, "moe_payload": layers * (moe_fwd + moe_bwd),
            "moe_fwd_per_layer": moe_fwd, "moe_bwd_per_layer": moe_bwd,
            "rest_calls": sum(n for n, _ in rest), "rest_payload": sum(n * b for n, b in rest)}


def _worker(rank: int, world: int, args, out_file: str) -> None:
    import transformers

    from meshboost import Booster
    from meshboost.distributed.profiling import comm_counter
    from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin

    config = make_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    experts_total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    params_total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # check_inputs="first": the step's traffic is the model's (as benchmarks/runners.py)
    plugin = HybridParallelPlugin(HybridParallelConfig(tp_size=world, check_inputs="first"))
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    inner = model.unwrap()
    window = MoeWindow(inner)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    step = training_step(booster, model, optimizer, batch)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    with comm_counter(plugin.mesh) as total, comm_counter(plugin.mesh) as moe:
        window.listen(moe)
        window.recording = True
        loss = step()
        window.recording = False
    times = timed_steps(step, args.steps)
    result = {"rank": rank, "expert_params": sum(p.numel() for n, p in inner.named_parameters() if ".experts." in n),
              "params": sum(p.numel() for p in inner.parameters()), "experts_total": experts_total,
              "params_total": params_total, "moe_layers": window.layers, "comm": total.summary(),
              "comm_moe": moe.summary(), "step_s": times, "loss": float(loss.detach())}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_file, "a") as f:
            f.write(json.dumps({"tp": world, "ranks": gathered}) + "\n")


def _op_totals(summary: dict) -> dict:
    """op -> [calls, payload bytes, ring bytes sent], summed over groups."""
    out: dict = {}
    for g in summary.values():
        for op, calls in g["by_op"].items():
            acc = out.setdefault(op, [0, 0, 0.0])
            acc[0] += calls
            acc[1] += g["bytes_by_op"][op]
    return out


def record(tp: int, ranks: list[dict], tokens: int) -> dict:
    first = ranks[0]
    layers = moe_layers(make_config())
    if first["moe_layers"] != layers:
        raise AssertionError(f"the model has {first['moe_layers']} experts modules, the config says {layers}")
    theory = formulas(tp, tokens, layers)
    ops = _op_totals(first["comm"])
    for op, acc in ops.items():
        acc[2] = ring_factor(op, tp) * acc[1]
    moe = _op_totals(first["comm_moe"]).get("all_reduce", [0, 0, 0.0])
    all_reduce = ops.get("all_reduce", [0, 0, 0.0])
    tp_group = first["comm"].get("tp", {"sent_bytes": 0.0})
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(first["step_s"]))]
    ring = ring_factor("all_reduce", tp) if tp > 1 else 0.0
    return {
        "tp": tp, "tokens": tokens, "moe_layers": layers,
        "expert_params_per_rank": [r["expert_params"] for r in ranks], "expert_params_formula": first["experts_total"] / tp,
        "params_per_rank": [r["params"] for r in ranks], "params_total": first["params_total"],
        "comm_by_op": {op: {"calls": c, "payload_bytes": p, "ring_sent_bytes": s} for op, (c, p, s) in ops.items()},
        "comm_by_group": first["comm"], "tp_group_sent_bytes": tp_group["sent_bytes"],
        "moe_all_reduce_calls": moe[0], "moe_all_reduce_payload_bytes": moe[1],
        "moe_all_reduce_sent_bytes": ring * moe[1],
        "moe_formula_calls": theory["moe_calls"], "moe_formula_payload_bytes": theory["moe_payload"],
        "moe_formula_sent_bytes": ring * theory["moe_payload"],
        "rest_all_reduce_calls": all_reduce[0] - moe[0], "rest_all_reduce_payload_bytes": all_reduce[1] - moe[1],
        "rest_formula_calls": theory["rest_calls"], "rest_formula_payload_bytes": theory["rest_payload"],
        "moe_matches_formula": (moe[0], moe[1]) == (theory["moe_calls"], theory["moe_payload"]),
        "rest_matches_formula": (all_reduce[0] - moe[0], all_reduce[1] - moe[1]) ==
                                (theory["rest_calls"], theory["rest_payload"]),
        "step_ms_median": 1e3 * statistics.median(steps), "step_ms_all": [1e3 * t for t in steps],
        "loss": first["loss"],
    }


def format_table(records: list[dict]) -> str:
    head = ("tp", "expert params/rank", "total/tp", "all params/rank", "step comm by op (calls, payload B)",
            "MoE all-reduce calls", "MoE payload B (formula)", "MoE ring sent B (formula)",
            "other all-reduce B (formula)", "step ms")
    rows = [head]
    for r in records:
        by_op = " ".join(f"{op}:{v['calls']}x/{v['payload_bytes']}" for op, v in r["comm_by_op"].items()) or "none"
        experts = "/".join(str(n) for n in sorted(set(r["expert_params_per_rank"])))
        params = "/".join(str(n) for n in sorted(set(r["params_per_rank"])))
        rows.append((str(r["tp"]), experts, f"{r['expert_params_formula']:.0f}", params, by_op,
                     f"{r['moe_all_reduce_calls']} ({r['moe_formula_calls']})",
                     f"{r['moe_all_reduce_payload_bytes']} ({r['moe_formula_payload_bytes']})",
                     f"{r['moe_all_reduce_sent_bytes']:.0f} ({r['moe_formula_sent_bytes']:.0f})",
                     f"{r['rest_all_reduce_payload_bytes']} ({r['rest_formula_payload_bytes']})",
                     f"{r['step_ms_median']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp sizes (one process group each)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from meshboost.testing import spawn
    with tempfile.TemporaryDirectory() as root:
        out_file = os.path.join(root, "moe_tp.jsonl")
        for tp in args.tp:
            spawn(_worker, tp, args, out_file)
        with open(out_file) as f:
            runs = [json.loads(line) for line in f]
    tokens = args.batch * args.seq
    records = [record(run["tp"], run["ranks"], tokens) for run in runs]
    c = make_config()
    print(f"Qwen3-MoE: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_experts} experts "
          f"(I={c.moe_intermediate_size}, top-{c.num_experts_per_tok}), vocab {c.vocab_size}; batch {args.batch} x "
          f"seq {args.seq} = {tokens} tokens, fp32, {dist.Backend.GLOO if not torch.cuda.is_available() else 'nccl'}, "
          f"1 thread/process; comm of one step (fwd+bwd+optimizer) on rank 0; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(format_table(records))
    print("payload B = bytes of the logical tensors (what comm_counter's payload_bytes counts); ring sent B = what "
          "a rank sends, 2(P-1)/P x payload per all-reduce (comm_counter's sent_bytes; 1 x at P=2).\n"
          "MoE formula per layer: fwd g T*h*4, bwd f T*h*4 + T*top_k*4; other = attention (2/layer), embedding, "
          "LM head, cross-entropy (3*T*4),\n"
          "q/k-norm weight grads (2/layer x head_dim*4). (formula) in parentheses; MoE counted by autograd node.")
    for r in records:
        print("JSON " + json.dumps(r))
    return records


if __name__ == "__main__":
    main()
