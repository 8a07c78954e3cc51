"""`python -m meshboost.check --model <HF folder | config.json | type> --layout tp=2,pp=2,...`: the command
line of the pre-flight check. Owns parsing the arguments, printing the report, and a bad input (an unknown
model type, a layout the parser refuses) as one line with exit status 2; exit status 1 when any layer type
is wrong.
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"meshboost.check: error: {' '.join(str(message).split())}\n")


def main(argv=None) -> int:
    p = _Parser(prog="python -m meshboost.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder, config.json path, or model type (llama, qwen3_moe)")
    p.add_argument("--layout", required=True, help="tp=2,pp=2,dp=2,ep=2,cp=2,zero=1,... (the planner's syntax)")
    p.add_argument("--set", default="", help="config overrides key=value,key=value")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence, for the planner's memory line")
    p.add_argument("--memory-gb", type=float, default=80.0, help="device memory, for the planner's fits")
    p.add_argument("--max-world", type=int, default=16, help="the most processes the check starts on this machine")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from meshboost.check import check
    from meshboost.plan.model import parse_overrides
    hf_logging.set_verbosity_error()
    try:
        report = check(args.model, args.layout, parse_overrides(args.set), args.seq, args.memory_gb, args.max_world)
    except (ValueError, OSError) as exc:
        p.error(" ".join(str(exc).split()))
    print("\n".join(report.lines()))
    return 1 if any(v == "wrong" for v, _ in [report.loss, *report.groups.values()]) else 0


if __name__ == "__main__":
    sys.exit(main())
