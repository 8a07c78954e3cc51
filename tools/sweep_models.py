"""Run the model sweep (meshboost/testing/sweep.py) at tp=2 on 2 processes and write docs/models.md:
one row per transformers model type that ships `base_model_tp_plan`, with its verdict at tp=2 and,
for the types with packed MoE experts, at ep=2 (the experts split over the two ranks).

    python tools/sweep_models.py            # writes docs/models.md
    python tools/sweep_models.py --print    # only prints the table
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _body(rank: int, world: int, out: str) -> None:
    import warnings

    import torch.distributed as dist
    import transformers

    from meshboost.testing.sweep import check_variants, plan_model_types
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    verdicts = []
    for mt in plan_model_types():
        tp, ep = check_variants(mt, dist.group.WORLD, [{}, {"expert_parallel": True}])
        verdicts.append({**tp.__dict__, "ep_status": ep.status, "ep_detail": ep.detail})
    if rank == 0:
        Path(out).write_text(json.dumps({"transformers": transformers.__version__, "verdicts": verdicts}))


def run() -> dict:
    from meshboost.testing.spawn import spawn
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "verdicts.json")
        spawn(_body, 2, out)
        return json.loads(Path(out).read_text())


def table(result: dict) -> str:
    counts = collections.Counter(v["status"] for v in result["verdicts"])
    ep = collections.Counter(v["ep_status"] for v in result["verdicts"] if v["ep_status"] not in ("no experts",
                                                                                                   "not run"))
    lines = [f"{len(result['verdicts'])} model types of transformers {result['transformers']} ship "
             f"`base_model_tp_plan`; at tp=2: " + ", ".join(f"{counts[s]} {s}" for s in ("ok", "refused", "not run",
                                                                                         "FAIL")) + ". "
             f"Of the {sum(ep.values())} that run with packed MoE experts, at ep=2: "
             + ", ".join(f"{ep[s]} {s}" for s in ("ok", "refused", "FAIL")) + ". "
             f"{sum(v['status'] == 'ok' and bool(v['detail']) for v in result['verdicts'])} of the tp=2 ok types run "
             "their recurrent mixers (Gated DeltaNet, Mamba) whole on every rank: ok (replicated: ...). **held**: the "
             "fraction of the model's parameters one rank holds at tp=2.", "",
             "| model type | class | tp=2 | held | detail | ep=2 |", "|---|---|---|---|---|---|"]
    for v in result["verdicts"]:
        detail = v["detail"].replace("|", "/")
        ep_cell = "" if v["ep_status"] in ("no experts", "not run") else v["ep_status"]
        if v["ep_detail"]:
            ep_cell += ": " + v["ep_detail"].replace("|", "/")
        # an exact run whose mixers stay whole reads "ok (replicated: ...)", the mixers named in the status itself
        status = f"ok ({detail})" if v["status"] == "ok" and detail else v["status"]
        held = f"{v['held']:.2f}" if v.get("held") is not None else ""
        lines.append(f"| {v['model_type']} | {v['cls']} | {status} | {held} | {'' if status != v['status'] else detail} "
                     f"| {ep_cell} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of writing docs/models.md")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run()
    text = table(result)
    if args.print:
        print(text)
        return
    (ROOT / "docs" / "models.md").write_text(PREFACE + text + "\n")
    print(text.splitlines()[0])


PREFACE = """# Supported models

Tensor parallelism needs a plan for each model family; pipeline and data parallelism need none
(tp_size=1 shards nothing, and pipeline stages read transformers' `base_model_pp_plan` or the
family's table).

- **Hand-written tables** (`meshboost/shardformer/policies/`), each compared with the unsharded
  model at tp=2 and tp=4 in `tests/shardformer/test_policies.py` (loss, eval outputs, gathered
  gradients, weights after AdamW steps):

  | family | classes tested | what the table handles | pp |
  |---|---|---|---|
  | bert | `BertModel`, every `BertFor*` head | vocab-parallel embedding and MLM head, tied | yes |
  | gpt2 | `GPT2LMHeadModel`, `GPT2ForSequenceClassification` | fused `c_attn` (Conv1D) split per q/k/v | yes |
  | opt | `OPTForCausalLM`, `OPTForSequenceClassification` | `project_in`/`project_out` (word_embed_proj_dim) | yes |
  | bloom | `BloomForCausalLM` | fused per-head query_key_value, ALiBi bias sliced to each rank's heads | yes |
  | falcon | `FalconForCausalLM` (grouped new arch, multi-query, ALiBi) | fused qkv split per head group; kv heads fewer than tp held by the ranks that use them | yes |
  | vit | `ViTForImageClassification` | patch embedding and head replicated | yes |
  | albert | `AlbertForMaskedLM`, `AlbertForSequenceClassification` | one shared layer group, factorised embedding | yes (stages split the iterations; a group's weights tied over the stages running it) |
  | t5 | `T5ForConditionalGeneration`, `T5EncoderModel` (ReLU and gated-GELU) | embedding tied over three paths, relative position bias sharded by heads, cross-attention | yes (encoder then decoder stack; the position bias carried inside a stack) |
  | whisper | `WhisperForConditionalGeneration` | audio encoder (convolutions replicated), decoder cross-attention | yes (encoder then decoder stack) |
  | blip-2 | `Blip2ForConditionalGeneration` (OPT language model) | Q-Former like BERT, OPT table under `language_model`, vision MLP split; vision attention replicated (its forward reshapes by the full width) | yes (vision, Q-Former, OPT stacks) |
  | esmc | `EsmcForMaskedLM`, `EsmcForSequenceClassification` | whole-hidden q/k norms: q/k/v gathered, attention on every rank (OLMo2's treatment), MLP split | yes (pp plan) |
  | cohere (`use_qk_norm`) | `CohereForCausalLM` via its plan | per-head q/k norm weights split by heads (`head_norm`) | yes (pp plan) |
  | gpt_oss | `GptOssForCausalLM` (`tests/shardformer/test_moe_tp.py`) | transformers' plan splits only the embedding: attention by heads with its per-head `sinks`, experts with interleaved gate/up rows and biases split inside every expert, router replicated | yes (pp plan) |
  | deepseek_v2, deepseek_v3 | `DeepseekV3ForCausalLM`, `DeepseekV2ForCausalLM` (`tests/shardformer/test_mla.py`, `test_moe_tp.py`) | multi-head latent attention split by heads (q_b/q, kv_b colwise, o rowwise; the a-projections and norms whole, gradients summed once), transformers' MLP and expert entries | yes (pp plan) |

- **transformers' own `base_model_tp_plan`**, read by `policies/tp_plan.py`, which translates
  `colwise`, `rowwise`, `colwise_gather_output`, `rowwise_split_input`,
  `replicated_with_grad_allreduce` (gradients summed over tp) and `embedding_rowwise`, splits an
  unnamed per-head `q_norm`/`k_norm` ([heads, head_dim]: Cohere's `use_qk_norm`) by heads, splits
  MoE experts (`moe_tp_experts` with its packed `gate_up_proj`/`up_proj` and `down_proj`, either
  layout) inside every expert on the intermediate dimension, the router replicated with its whole
  gradient (`shardformer/layers/experts.py`; under sequence parallelism each rank routes its chunk and the experts gather the tokens; with
  `output_router_logits=True` over data-parallel replicas the load-balancing loss is each replica's
  own, averaged with the rest of the loss: DDP's semantics, the default, `tests/shardformer/test_moe_layouts.py`;
  `router_statistics="global"` gathers the routing statistics for the whole batch's loss; expert
  parallelism, `ep_size`, splits the experts over data-parallel ranks: docs/moe.md), and
  refuses every other style (MLA's `mla_kv_a_proj`, identity experts, `all_reduce`, `local_params`,
  ...) naming it. A plan that leaves more than half of a model's parameters whole on every rank
  (Flint's, which names no attention) is said on rank 0 at boost. A plan's
  module that has parameters, is not covered by the plan and is fed split activations (a
  learnable activation between the MLP projections, a per-head norm) is refused at its first
  call rather than trained with a partial gradient. An embedding subclass with a forward of its
  own is refused unless it only scales the lookup (Gemma's `embed_scale`, kept exactly).
- **Vision-language models** whose top-level config ships no plan while its text sub-config does
  (`policies/multimodal.py`): the text plan placed under the language model's path (Qwen3-VL's, which
  splits only the embedding, completed with Qwen3's), the vision tower and projector whole on every tp
  rank (said once; exact), and at pp the tower on the first stage. Tested with real image inputs at
  tp=2 x dp=2 and pp=2 x dp=2 against one process, LoRA included (`tests/shardformer/test_vlm.py`):
  Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma-3, Idefics3, SmolVLM, PaliGemma. Mllama ships no plan at all and is
  refused at tp > 1.
- **Hybrid linear-attention and state-space models** (`shardformer/mixers.py`): their recurrent mixers are
  split by heads over tp, as Megatron and torchtitan do, and transformers' own torch path runs on each
  rank's heads (no forward copied; the per-rank head counts set on the mixer module, the config untouched).
  Qwen3-Next's Gated DeltaNet: `in_proj_qkvz`/`in_proj_ba` column-parallel by key-head group (their rows
  are grouped per key head), the short convolution's channels of each of q, k, v, `A_log` and `dt_bias` by
  value head, the gated norm's [head_dim] weight whole with its gradient summed over tp, `out_proj`
  row-parallel (transformers' plan gathered all three back, so the recurrence ran whole on every rank).
  The Mamba2 mixer (Bamba, Nemotron-H, GraniteMoeHybrid): `in_proj` split in each of its `[z | x | B | C |
  dt]` segments, the convolution's `[x | B | C]` channels, `A_log`, `dt_bias`, `D` and the gated norm's
  groups by head, `out_proj` row-parallel. Exact against one process (loss, gathered gradients, weights
  after AdamW) at tp=2 and at tp=2 x dp=2 with ZeRO-1 (`tests/shardformer/test_mixers.py`). Refused, on
  every rank before any collective, naming the value: key heads (`linear_num_key_heads`) or Mamba groups
  (`mamba_n_groups`, 1 in Bamba-9B and Falcon-H1 checkpoints) that tp does not divide, with ep too; a
  fused kernel that reads `out_proj`'s weight itself (kernelized Mamba2) at its first call; context
  parallelism on any recurrent mixer. Left whole on every rank (exact, "ok (replicated: ...)" below): mixers
  of other shapes (Qwen3.5's split projections, Falcon-H1's muP-scaled mixer, Jamba's Mamba1, OLMo-Hybrid's
  and Lara-Mini's Gated DeltaNets, Kimi-Linear's and Bailing-Hybrid's forget gates).
- Anything else: `custom_policy=meshboost.shardformer.Policy(...)` (docs/adding_a_model.md).

The table below is written by `python tools/sweep_models.py` (tests/shardformer/test_model_sweep.py
runs the same sweep and fails on any FAIL or not run it does not list, with the reason): every model
type of the installed transformers whose config ships `base_model_tp_plan`, built tiny (hidden 64, 4
heads, 2 kv heads, 2 layers, vocab 160, small MoE; every sub-config shrunk; MLA ranks, mrope sections and
per-layer lists kept consistent) with the inputs it needs (images, patch grids, image tokens), sharded
at tp=2 on 2 processes and compared with the unsharded model on a padded batch. **ok**: loss and eval outputs within 1e-5 and every gathered gradient within the fp32
tolerance. **refused**: a clear error, before anything changed (or at the first call, see above).
**not run**: the model itself cannot be built or run unsharded (its reason is given): nothing was
compared, nothing is claimed. Recurrent mixers (Gated DeltaNet, Mamba: modules holding `A_log`,
`shardformer/recurrent.py`) of the two shapes `shardformer/mixers.py` knows (Qwen3-Next's fused
`in_proj_qkvz`/`in_proj_ba` Gated DeltaNet; the Mamba2 mixer of Bamba, Nemotron-H, GraniteMoeHybrid) are
split by heads, their recurrence run on each rank's heads: a plain **ok**. **ok (replicated: ...)**: exact as
ok, but the named mixers keep their per-head decay whole, so their recurrence, convolution and activations
run whole on every rank. Context parallelism refuses every model with recurrent mixers. **FAIL**: a number differs; such a type is listed with what differs in
the test (`KNOWN_FAIL`), a defect to fix. A gradient that differs only by rounding is not a FAIL: when only
gradients differ, each is compared with a float64 run of the model, and passes when the sharded one is no
further from it than twice the unsharded fp32 one (Gemma-4 and DiffusionGemma, large gradients and no
1/sqrt(d) attention scaling, round more than the fixed tolerance; a wrong layout is off by far more).
The **ep=2** column (types with packed MoE experts; empty for the others and the ones not run):
the same tiny model with its experts split over the 2 ranks by expert parallelism instead of tensor
parallelism (`shardformer/layers/expert_parallel.py`), both ranks fed the same batch, compared the
same way (every expert's gradient gathered over the ep ranks); training layouts with ep (dp, tp
inside the experts, pp, ZeRO) are tested in `tests/shardformer/test_moe_ep.py`.

"""  # noqa: E501 (a markdown table)


if __name__ == "__main__":
    main()
