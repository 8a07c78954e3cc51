#!/usr/bin/env bash
# Run ColossalAI's own example scripts, unchanged except `colossalai` -> `meshboost`, offline:
#
#   EXAMPLE=bert  (default) examples/language/bert/finetune.py --plugin <p>
#   EXAMPLE=gpt   examples/language/gpt/hybridparallelism/finetune.py --plugin <p>
#   EXAMPLE=llama examples/language/llama/benchmark.py -p <p> $LLAMA_ARGS (a tiny Llama config)
#
# Substituted, and only these: the data source (data.py -> tools/colossalai_examples/data.py, real
# tweets), `evaluate.load("glue", ...)` -> a local accuracy/F1 metric, hub names -> local folders
# (`bert-base-uncased` = the all-MiniLM-L6-v2 BERT; `gpt2` = a small seeded random GPT-2 with MiniLM's
# tokenizer; the Llama config = local_models.py's tiny one), and for the GPT script, which calls
# `.cuda()` unconditionally, `.cuda()` -> `.to(get_accelerator().get_current_device())` (the same on
# a CUDA machine). The scripts come from a ColossalAI git checkout (COLOSSALAI_REPO), so nothing of
# them is vendored here. The bert and gpt scripts import `evaluate` (pip install evaluate).
# EXAMPLE_SAMPLES sets the training and held-out sizes (default 256); NPROC the processes (2).
#
#   COLOSSALAI_REPO=/path/to/ColossalAI bash tools/colossalai_examples/run.sh torch_ddp low_level_zero ...
#   COLOSSALAI_REPO=... EXAMPLE=llama NPROC=4 LLAMA_ARGS="--tp 2 --pp 2 --zero 1" bash .../run.sh 3d
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PY=${PYTHON:-$repo/.venv/bin/python}
: "${COLOSSALAI_REPO:?set COLOSSALAI_REPO to a ColossalAI git checkout}"
EXAMPLE=${EXAMPLE:-bert}
work=$(mktemp -d)
# A file of the checkout, following a symlink inside the repository (llama's helpers link to ../).
show() {
  local path=$1 text
  text=$(git -C "$COLOSSALAI_REPO" show "HEAD:$path")
  if [[ $(git -C "$COLOSSALAI_REPO" ls-tree HEAD "$path" | cut -c1-6) == 120000 ]]; then
    show "$(realpath -m "/$(dirname "$path")/$text" | cut -c2-)"
  else
    printf '%s\n' "$text"
  fi
}
rename() { sed 's/colossalai/meshboost/g'; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
case "$EXAMPLE" in
  bert)
    show examples/language/bert/finetune.py | rename > "$work/script.py"
    model=$("$PY" -c "import sys; sys.path.insert(0, '$here'); import local_models; print(local_models.minilm_folder())")
    ln -s "$model" "$work/bert-base-uncased"
    defaults="torch_ddp torch_ddp_fp16 low_level_zero hybrid_parallel gemini torch_fsdp" flag=--plugin ;;
  gpt)
    show examples/language/gpt/hybridparallelism/finetune.py | rename \
      | sed 's/\.cuda()/.to(get_accelerator().get_current_device())/g' > "$work/script.py"
    "$PY" "$here/local_models.py" gpt2 "$work/gpt2"
    defaults="torch_ddp torch_ddp_fp16 low_level_zero hybrid_parallel gemini" flag=--plugin ;;
  llama)
    show examples/language/llama/benchmark.py | rename > "$work/script.py"
    for f in data_utils.py model_utils.py performance_evaluator.py; do
      show "examples/language/llama/$f" | rename > "$work/$f"
    done
    "$PY" "$here/local_models.py" llama "$work/tiny-llama"
    defaults="gemini fsdp fsdp_cpu 3d" flag=-p ;;
  *) echo "EXAMPLE=$EXAMPLE: expected bert, gpt or llama" >&2; exit 2 ;;
esac
if [[ $EXAMPLE != llama ]]; then
  cp "$here/data.py" "$work/data.py"
  mkdir -p "$work/glue" && cp "$here/glue_metric.py" "$work/glue/glue.py"
fi
cd "$work"
for p in ${*:-$defaults}; do
  echo "== $EXAMPLE $p"
  if [[ $EXAMPLE == llama ]]; then
    # shellcheck disable=SC2086
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" script.py -c tiny-llama $flag "$p" \
      -b 2 -s 3 -i 1 -l 64 ${LLAMA_ARGS:-}
  else
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" script.py $flag "$p"
  fi
done
