"""What the input checks of issue 23 cost per training step, fp32, on whatever device this runs on
(CPU here: gloo, one thread per process):

    python benchmarks/input_check.py [--steps 30] [--layers 4] [--hidden 256] [--seq 128] [--batch 8]
    python benchmarks/input_check.py --pipeline [...]

Default: a GPT-2 at tp=2 (2 processes), one training step (forward, backward, AdamW step) with
check_inputs="always" (the default: the tp ranks' 6-number input digests all-gathered on every
call) and with "never", rows alternating so both share the machine's noise; then the check alone
per call. --pipeline: 4 processes at pp=2 x dp=2, a whole pipeline step, and the agreement that
starts it (every rank has a batch, the global batch a labelled token: one world all-reduce of 3
integers, read on the host) alone per call. Medians over the rounds, printed by rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import alternate_times, timed  # noqa: E402


def _model(args):
    import transformers as tfm
    config = tfm.GPT2Config(vocab_size=4096, n_embd=args.hidden, n_head=4, n_layer=args.layers, n_positions=512,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = tfm.GPT2LMHeadModel(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _batch(args, rows: int):
    ids = torch.randint(0, 4096, (rows, args.seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _median_ms(run, rounds: int, warmup: int = 3) -> float:
    return statistics.median(alternate_times({"": run}, timed, rounds, warmup)[""]) * 1e3


def _tensor_parallel(rank: int, args) -> None:
    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin

    variants = {}
    for mode in ("always", "never"):
        model, opt = _model(args)
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2, check_inputs=mode))
        model, opt, *_ = booster.boost(model, opt)
        variants[mode] = (booster, model, opt)
    batch = _batch(args, args.batch)

    def step(mode):
        booster, model, opt = variants[mode]
        booster.backward(model(**batch).loss, opt)
        opt.step()
        opt.zero_grad()

    # alternating rounds: both variants share the machine's noise
    times = alternate_times({mode: mode for mode in variants}, lambda mode: timed(lambda: step(mode)), args.steps)
    always, never = (statistics.median(times[m]) * 1e3 for m in ("always", "never"))
    paired = statistics.median(a - b for a, b in zip(times["always"], times["never"])) * 1e3   # same round's noise
    check = variants["always"][1].input_check
    alone = _median_ms(lambda: check(batch), args.steps * 4)
    if rank == 0:
        print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens, tp=2, fp32, "
              f"{torch.device('cuda' if torch.cuda.is_available() else 'cpu')}; medians of {args.steps} steps")
        print(f"  training step, check_inputs='always': {always:8.2f} ms")
        print(f"  training step, check_inputs='never':  {never:8.2f} ms   (median paired difference "
              f"{paired:+.2f} ms, {paired / never:+.1%})")
        print(f"  the check alone (digest + all-gather over tp + verdict): {alone:.3f} ms a call "
              f"({alone / never:.2%} of a step)")


def _pipeline(rank: int, args) -> None:
    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.plugins.input_checks import next_pipeline_batch

    model, opt = _model(args)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt, lambda outputs, inputs: outputs.loss)
    batch = _batch(args, args.batch)          # this replica's batch

    def step():
        booster.execute_pipeline(iter([batch]), model, lambda outputs, inputs: outputs.loss, opt)
        opt.step()
        opt.zero_grad()

    whole = _median_ms(step, args.steps)
    alone = _median_ms(lambda: next_pipeline_batch(iter([batch]), plugin.mesh, model.pipeline.count_items, True),
                       args.steps * 4)
    if rank == 0:
        print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens per replica, "
              f"pp=2 x dp=2, 2 micro-batches, fp32; medians of {args.steps} steps")
        print(f"  pipeline training step: {whole:8.2f} ms")
        print(f"  the step's agreement alone (world all-reduce of 3 integers, read on the host): {alone:.3f} ms a "
              f"call ({alone / whole:.2%} of a step)")


def _body(rank: int, world: int, args) -> None:
    (_pipeline if args.pipeline else _tensor_parallel)(rank, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pipeline", action="store_true", help="pp=2 x dp=2 (4 processes) instead of tp=2")
    args = parser.parse_args()
    from meshboost.testing import spawn
    spawn(_body, 4 if args.pipeline else 2, args)


if __name__ == "__main__":
    main()
