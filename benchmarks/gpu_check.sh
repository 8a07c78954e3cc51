#!/usr/bin/env bash
# One command for a CUDA machine (issue 15): installs what is missing, runs the suite's CUDA tests (a
# world of one over NCCL; tensor parallelism over NCCL with 2+ GPUs), then measures model FLOPs
# utilisation side by side (issue 41; benchmarks/gpu_mfu.py, each row its own process): plain PyTorch
# (autocast; bf16), meshboost eager, + compile, + compile + float8, for a 0.94B Llama at 8 x 2048 and a
# 3.1B one at 4 x 2048, printing ms/step, tokens/s, MFU (datasheet and measured matmul rate), peak memory
# and the loss after 10 steps, and last the planner's predicted peak, reserved bytes and step time
# (calibrated on the machine first) against torch.cuda.max_memory_allocated, max_memory_reserved and
# the median of five timed steps (benchmarks/plan_peak.py --cuda: world-1
# cases, each in a process of its own, a ~3B Llama at seq 4096 with checkpointing and a 2-layer
# 64-expert MoE among them). Budget: under 9 minutes on one H100/H200.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from any directory
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: the same steps on CPU with a tiny model
#
# PYTHON selects the interpreter (default python3); MESHBOOST_PEAK_TFLOPS overrides the peak used for MFU.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
step() { echo "== gpu_check [$((SECONDS - start)) s] $*"; }

step "1/5 packages"
if ! "$PY" -c "import torch, transformers, safetensors, pytest" 2>/dev/null; then
  timeout 120 "$PY" -m pip install -q "torch>=2.4" "transformers>=5.0" safetensors pytest
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "CUDA devices: $GPUS"
if [ "$GPUS" = 0 ] && [ "$DRY" = 0 ]; then
  echo "no CUDA device visible: run with --dry-run to check the script on CPU" >&2
  exit 1
fi

step "2/5 CUDA tests (tests/test_cuda.py: skipped without a GPU)"
timeout 240 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider

step "3/5 tensor parallelism over NCCL"
if [ "$GPUS" -ge 2 ]; then
  echo "covered by tests/test_cuda.py::test_tensor_parallel_over_nccl_matches_unsharded above ($GPUS GPUs)"
else
  echo "skipped: $GPUS GPU(s); needs 2"
fi

step "4/5 model FLOPs utilisation: plain PyTorch, meshboost eager, + compile, + compile + float8 (0.94B, 3B)"
if [ "$DRY" = 1 ]; then
  timeout 240 "$PY" benchmarks/gpu_mfu.py --dry-run
  timeout 120 "$PY" benchmarks/release_check.py --dry-run    # memory before the first boost, after the last drop
else
  timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/release_check.py
  timeout 420 "$PY" benchmarks/gpu_mfu.py --row-timeout 120
fi
step "5/5 planner: predicted peak/reserved/step time against max_memory_allocated/max_memory_reserved/timed steps"
COST=$(mktemp -d)/cost.json         # this machine's cost constants (issue 39 point 4), world 1
CONSTANTS=()
if timeout 120 "$PY" -m meshboost.plan --calibrate --world 1 --precision bf16 --calibration "$COST" >"$COST.log" 2>&1; then
  tail -n 2 "$COST.log"
  CONSTANTS=(--constants "$COST")
else
  tail -n 5 "$COST.log"; echo "calibration failed: the step times below use the planner's defaults"
fi
if [ "$DRY" = 1 ]; then
  timeout 240 "$PY" benchmarks/plan_peak.py --cuda --dry-run "${CONSTANTS[@]}"
else
  # with the device tool's $OUT: each case's allocator events come back (the reserved model's data)
  timeout 300 "$PY" benchmarks/plan_peak.py --cuda "${CONSTANTS[@]}" ${OUT:+--trace "$OUT/alloc"}
fi
step "done"
