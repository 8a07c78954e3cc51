"""Pipeline parallelism through the Booster against a single-process model on the same micro-batches.

Spec (issue 4, normalisation from issue 11): BERT, GPT-2 and Llama at pp=2 (2 processes) and
tp=2 x pp=2 (4 processes), 1F1B and interleaved (2 chunks x 2 stages over 4 layers), 4
micro-batches, fp32, on padded batches: the step's loss (the mean over the batch's labelled tokens,
on every rank) within 1e-5 of one process on the whole batch, the first step's reduced gradients
(gathered, by HF name) and global gradient norm (AdamW would hide a uniform gradient scale), and
every weight after one AdamW step within the fp32 tolerance, compared by its HF name; loss_normalization="microbatch" reproduces the
mean of micro-batch means instead; a 5-step run whose per-step losses match;
dp=2 x pp=2 (gradients averaged over dp after the schedule); pp=2 x dp=2 with ZeRO-1 and fp16
within 5e-3; pp=2 x dp=2 with ZeRO-2 (1F1B and interleaved) reduce-scattering once per step;
evaluation (optimizer=None) loss and outputs; the error cases; the schedule order
is deadlock-free for many shapes (simulated, no processes). Issue 12: OPT (embedding projections),
BLOOM (ALiBi, embedding norm), Falcon (multi-query; ALiBi) and ViT (pixel_values) at pp=2, and at
tp=2 x pp=2 for BLOOM, Falcon and ViT; models of several layer stacks: T5 and Whisper
(encoder-decoder) and BLIP-2 (vision tower, Q-Former, OPT) at pp=2, split inside and between
stacks, interleaved, at pp=4 (a weight tied over three ranks) and at tp=2 x pp=2; ALBERT (shared
layer groups held by every stage running them) at pp=2 and tp=2 x pp=2.
"""

from __future__ import annotations

import contextlib
import copy
import re
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from meshboost import Booster
from meshboost.distributed.profiling import comm_counter
from meshboost.pipeline import PipelineConfig, schedule_order, split_layers, split_microbatches
from meshboost.pipeline.layout import get_layout
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.shardformer import pipeline_layout
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import StepGradients, gathered, gradients_checked
from meshboost.testing.models import build_model, tiny_batch, tiny_config

M = 4          # micro-batches
FAMILIES = (("bert", "BertForSequenceClassification"), ("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"))
MORE_FAMILIES = (("opt", "OPTForCausalLM"), ("bloom", "BloomForCausalLM"), ("falcon_mqa", "FalconForCausalLM"),
                 ("falcon_alibi", "FalconForCausalLM"), ("vit", "ViTForImageClassification"))
STYLES = ({"pp_style": "1f1b"}, {"pp_style": "interleaved", "num_model_chunks": 2})
LR = 1e-3


def criterion(outputs, inputs):
    return outputs.loss


def _batches(cls, config, steps: int, batch: int = 8) -> list[dict]:
    return [tiny_batch(cls, config, batch=batch, seed=10 + s) for s in range(steps)]


def _reference(cls, config, batches, dp_size: int = 1, normalization: str = "tokens"):
    """Single process, fp32, on the whole global batch of each step. "tokens" (the plugin's default):
    the model's own loss on the whole batch, the mean over all its labelled tokens: the
    single-process objective every layout must train. "microbatch" (ColossalAI's convention): each
    of the dp_size replica slices split into M micro-batches, gradients the mean of their mean
    losses. Returns the per-step losses each replica reports (its token mean, or the mean of its
    micro-batch losses), the model, and the first step's gradients (`StepGradients`)."""
    model = build_model(cls, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
    losses, first = [], None
    for batch in batches:
        replica_losses = []
        if normalization == "tokens":
            with torch.no_grad():
                replica_losses = [criterion(model(**r), r).item() for r in split_microbatches(batch, dp_size)]
            criterion(model(**batch), batch).backward()
        else:
            for replica in split_microbatches(batch, dp_size):
                total = 0.0
                for mb in split_microbatches(replica, M):
                    loss = criterion(model(**mb), mb)
                    (loss / (M * dp_size)).backward()
                    total += loss.item()
                replica_losses.append(total / M)
        if first is None:
            first = StepGradients.of(model)
        opt.step()
        opt.zero_grad()
        losses.append(replica_losses)
    return losses, model, first


def _pipeline(cls, config, batches, first, **plugin_kwargs):
    """Train through the pipeline; the first step's reduced gradients and global norm against `first`."""
    plugin = HybridParallelPlugin(num_microbatches=M, **plugin_kwargs)
    model = build_model(cls, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)     # built before boost: must stay valid
    booster = Booster(plugin=plugin)
    model, opt, crit, _, _ = booster.boost(model, opt, criterion)
    losses = []
    for step, batch in enumerate(batches):
        out = booster.execute_pipeline(iter([batch]), model, crit, opt)
        with _first_step_checked(step, model, opt, first, f"{cls} {plugin_kwargs}"):
            opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())
    return losses, model, plugin, booster


def _first_step_checked(step: int, model, opt, first, where: str, dtype=torch.float32):
    """gradients_checked around step 0 (AdamW hides a uniform gradient scale from the weights)."""
    return gradients_checked(model, opt, first, f"{where} step 0", dtype) if step == 0 else contextlib.nullcontext()


def _check_weights(model, ref, where: str, dtype=torch.float32, scale: float = 1.0) -> None:
    """Every weight this stage holds equals the reference weight of the same HF name; together the
    stages hold every name of the reference."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    names = []
    for name, p in model.unwrap().named_parameters(remove_duplicate=False):
        assert name in ref_params, f"{where}: stage parameter {name} is not an HF name"
        assert_close(gathered(p), ref_params[name].detach(), dtype=dtype, scale=scale, msg=f"{where} weight {name}")
        names.append(name)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    assert set().union(*every) == set(ref_params), f"{where}: stages miss {set(ref_params) - set().union(*every)}"


def _check_family_styles(rank: int, tp_size: int) -> None:
    for family, cls in FAMILIES:
        config = tiny_config(family, num_hidden_layers=4)
        batches = _batches(cls, config, 1)          # padded: sample 1 has 3 ignored labels
        ref_losses, ref, first = _reference(cls, config, batches)
        for style in STYLES:
            where = f"{cls} tp={tp_size} pp=2 {style['pp_style']}"
            losses, model, plugin, _ = _pipeline(cls, config, batches, first, tp_size=tp_size, pp_size=2, **style)
            assert abs(losses[0] - ref_losses[0][0]) <= LOSS_ATOL[torch.float32], \
                f"{where}: loss {losses[0]} vs reference {ref_losses[0][0]}"
            _check_weights(model, ref, where)
            if style["pp_style"] == "interleaved":       # rank r holds layers r and r + 2 (virtual stages)
                layers = {int(m.group(1)) for n, _ in model.unwrap().named_parameters()
                          if (m := re.search(r"\.(?:layer|layers|h)\.(\d+)\.", n))}
                assert layers == {plugin.mesh.pp_rank, plugin.mesh.pp_rank + 2}, f"{where}: {layers}"


def _check_more_families(rank: int, tp_size: int, families=MORE_FAMILIES) -> None:
    """Families with a hand-written layout: stand-ins for embedding norms and projections (BLOOM,
    OPT), ALiBi heads sliced under tp on a later stage, image inputs whose stand-in must answer
    the forward's `embeddings.patch_embeddings.projection.weight.dtype` (ViT)."""
    for family, cls in families:
        config = tiny_config(family, num_hidden_layers=4)
        batches = _batches(cls, config, 1)
        ref_losses, ref, first = _reference(cls, config, batches)
        losses, model, _, _ = _pipeline(cls, config, batches, first, tp_size=tp_size, pp_size=2, **STYLES[0])
        where = f"{family} {cls} tp={tp_size} pp=2"
        assert abs(losses[0] - ref_losses[0][0]) <= LOSS_ATOL[torch.float32], f"{where}: {losses[0]} vs {ref_losses}"
        _check_weights(model, ref, where)


SEVERAL_STACKS = {
    # 4 encoder + 4 decoder blocks over 4 virtual stages: a boundary inside the encoder carries the
    # position bias block 0 computed (and its gradient back); the encoder output passes through a
    # decoder stage to the next; the shared embedding is held by virtual stages 0, 2 and 3.
    "t5_interleaved": ("t5", "T5ForConditionalGeneration", {"pp_style": "interleaved", "num_model_chunks": 2}),
    # stage 1 starts inside the encoder (convolution and position-table stand-ins shaped on the meta
    # device) and runs on into the decoder
    "whisper_3_5": ("whisper", "WhisperForConditionalGeneration", {"num_layers_per_stage": [3, 5]}),
    # 2 vision + 2 Q-Former + 2 OPT layers: a boundary inside the Q-Former (query-token stand-in, its
    # loop over config.num_hidden_layers), and, interleaved, inside every tower
    "blip2_3_3": ("blip2", "Blip2ForConditionalGeneration", {"num_layers_per_stage": [3, 3]}),
    "blip2_interleaved": ("blip2", "Blip2ForConditionalGeneration",
                          {"pp_style": "interleaved", "num_model_chunks": 2, "num_layers_per_stage": [1, 2, 2, 1]}),
    "t5_pp4": ("t5", "T5ForConditionalGeneration", {"pp_size": 4}),     # a weight tied over 3 pipeline ranks
    "whisper_tp2": ("whisper", "WhisperForConditionalGeneration", {"tp_size": 2}),
    "blip2_tp2": ("blip2", "Blip2ForConditionalGeneration", {"tp_size": 2, "num_layers_per_stage": [3, 3]}),
    # ALBERT: iterations over shared layer groups; one group held (tied) by every stage, and 5
    # iterations over 2 groups ([0, 0, 0, 1, 1]) split inside a group's run
    "albert_one_group": ("albert", "AlbertForMaskedLM", {}),
    "albert_two_groups": ("albert", "AlbertForMaskedLM", {"pp_style": "interleaved", "num_model_chunks": 2}),
    "albert_tp2": ("albert", "AlbertForSequenceClassification", {"tp_size": 2}),
}
CONFIGS = {"t5": {"num_hidden_layers": 4}, "whisper": {"num_hidden_layers": 4}, "blip2": {},
           "albert": {"num_hidden_layers": 5, "num_hidden_groups": 2, "inner_group_num": 2}}


def _check_several_stacks(rank: int, cases: tuple[str, ...]) -> None:
    """Models of several layer stacks (issue 12: encoder-decoder and multimodal): the stages cut the
    stacks in order, and a boundary carries every earlier stack's output with the hidden states.
    And ALBERT, whose stack runs its shared layer groups once per layer."""
    for case in cases:
        family, cls, options = SEVERAL_STACKS[case]
        config = tiny_config(family, **({} if case == "albert_one_group" else CONFIGS[family]))
        batches = _batches(cls, config, 1)
        ref_losses, ref, first = _reference(cls, config, batches)
        kwargs = {"tp_size": 1, "pp_size": 2, **options}
        losses, model, _, _ = _pipeline(cls, config, batches, first, **kwargs)
        where = f"{cls} {kwargs}"
        assert abs(losses[0] - ref_losses[0][0]) <= LOSS_ATOL[torch.float32], f"{where}: {losses[0]} vs {ref_losses}"
        _check_weights(model, ref, where)


def _check_half_precision_inputs(rank: int) -> None:
    """fp32 features into an fp16 model (Whisper's input_features; its convolutions do not cast them)
    are cast to the working precision, through the pipeline and through the tensor-parallel forward."""
    for family, cls, kwargs in (("whisper", "WhisperForConditionalGeneration", {"tp_size": 1, "pp_size": 2}),
                                ("whisper", "WhisperForConditionalGeneration", {"tp_size": 2, "pp_size": 1})):
        config = tiny_config(family, num_hidden_layers=2)
        batch = tiny_batch(cls, config, batch=4, seed=3)
        assert any(v.dtype == torch.float32 for v in batch.values())
        with torch.no_grad():
            want = build_model(cls, copy.deepcopy(config))(**batch).loss.item()
        plugin = HybridParallelPlugin(precision="fp16", **kwargs, **({"num_microbatches": 2} if "pp_size" in kwargs
                                                                       and kwargs["pp_size"] > 1 else {}))
        booster = Booster(plugin=plugin)
        model, *_ = booster.boost(build_model(cls, copy.deepcopy(config)))
        if kwargs["pp_size"] > 1:
            got = booster.execute_pipeline(iter([batch]), model, criterion, None)["loss"].item()
        else:
            with torch.no_grad():
                got = model(**batch).loss.item()
        assert abs(got - want) <= LOSS_ATOL[torch.float16], f"{cls} fp16 {kwargs}: {got} vs {want}"


def _check_per_layer_types(rank: int, tp_size: int) -> None:
    """Models whose config gives each layer a type (sliding-window or full attention) read it by the
    layer's position in the forward's loop: a stage must run its first layer with that layer's type,
    not layer 0's (Qwen2 with sliding layers, even split; Gemma2 alternating, split [1, 3])."""
    for family, cls, split in (("qwen2_sliding", "Qwen2ForCausalLM", None), ("gemma2", "Gemma2ForCausalLM", [1, 3])):
        config = tiny_config(family, num_hidden_layers=4)
        assert len(set(config.layer_types)) == 2, config.layer_types
        batches = _batches(cls, config, 1)
        ref_losses, ref, first = _reference(cls, config, batches)
        losses, model, _, _ = _pipeline(cls, config, batches, first, tp_size=tp_size, pp_size=2,
                                        num_layers_per_stage=split)
        where = f"{cls} tp={tp_size} pp=2 layers {split or 'even'}"
        assert abs(losses[0] - ref_losses[0][0]) <= LOSS_ATOL[torch.float32], f"{where}: {losses[0]} vs {ref_losses}"
        _check_weights(model, ref, where)


def _check_microbatch_normalization(rank: int, tp_size: int) -> None:
    """loss_normalization="microbatch" keeps ColossalAI's mean of micro-batch means, which on this
    padded batch is another objective than the whole batch's (the default)."""
    family, cls = "llama", "LlamaForCausalLM"
    config = tiny_config(family, num_hidden_layers=4)
    batches = _batches(cls, config, 1)
    mean_of_means, ref, first = _reference(cls, config, batches, normalization="microbatch")
    whole_batch, _, _ = _reference(cls, config, batches)
    assert abs(mean_of_means[0][0] - whole_batch[0][0]) > 1e-4, "the padded batch must tell the objectives apart"
    losses, model, _, _ = _pipeline(cls, config, batches, first, tp_size=tp_size, pp_size=2,
                                    loss_normalization="microbatch")
    assert abs(losses[0] - mean_of_means[0][0]) <= LOSS_ATOL[torch.float32], f"{losses[0]} vs {mean_of_means}"
    _check_weights(model, ref, f"{cls} tp={tp_size} pp=2 microbatch normalization")


def _check_multi_step(rank: int, tp_size: int, family: str, cls: str, style: dict) -> None:
    config = tiny_config(family, num_hidden_layers=4)
    batches = _batches(cls, config, 5)
    ref_losses, ref, first = _reference(cls, config, batches)
    losses, model, _, _ = _pipeline(cls, config, batches, first, tp_size=tp_size, pp_size=2, **style)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want[0]) <= LOSS_ATOL[torch.float32], f"{cls} step {step}: loss {got} vs {want[0]}"
    _check_weights(model, ref, f"{cls} after 5 steps", scale=10.0)


def _check_evaluation(rank: int, tp_size: int) -> None:
    family, cls = "gpt2", "GPT2LMHeadModel"
    config = tiny_config(family, num_hidden_layers=4)
    batch = _batches(cls, config, 1)[0]
    ref = build_model(cls, copy.deepcopy(config)).eval()
    with torch.no_grad():
        ref_loss = criterion(ref(**batch), batch).item()        # the whole batch's token mean
        ref_logits = ref(**batch).logits
    plugin = HybridParallelPlugin(tp_size=tp_size, pp_size=2, num_microbatches=M)
    booster = Booster(plugin=plugin)
    model, _, _, _, _ = booster.boost(build_model(cls, copy.deepcopy(config)))
    model.eval()
    out = booster.execute_pipeline(iter([batch]), model, criterion, None, return_outputs=True)
    assert abs(out["loss"].item() - ref_loss) <= LOSS_ATOL[torch.float32], f"eval loss {out['loss']} vs {ref_loss}"
    if plugin.mesh.is_last_stage:
        assert_close(out["outputs"].logits, ref_logits, msg="eval logits")
    else:
        assert out["outputs"] is None
    assert booster.execute_pipeline(iter([batch]), model, criterion, return_loss=False)["loss"] is None
    assert all(p.grad is None for p in model.parameters()), "evaluation must not make gradients"
    with pytest.raises(RuntimeError, match="execute_pipeline"):
        model(**batch)


def _check_dp(rank: int, **plugin_kwargs) -> None:
    """dp=2 x pp=2: each replica its own half of the batch; gradients averaged over dp."""
    family, cls = "gpt2", "GPT2LMHeadModel"
    config = tiny_config(family, num_hidden_layers=2)
    batches = _batches(cls, config, 2, batch=16)
    ref_losses, ref, first = _reference(cls, config, batches, dp_size=2)
    fp16 = plugin_kwargs.get("precision") == "fp16"
    losses, model, plugin, _ = _pipeline_dp(cls, config, batches, first, **plugin_kwargs)
    dtype = torch.float16 if fp16 else torch.float32
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        want = want[plugin.mesh.dp_rank]
        assert abs(got - want) <= LOSS_ATOL[dtype], f"dp x pp {plugin_kwargs} step {step}: loss {got} vs {want}"
    _check_weights(model, ref, f"dp x pp {plugin_kwargs}", dtype=dtype)


def _pipeline_dp(cls, config, batches, first, **plugin_kwargs):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=M, **plugin_kwargs)
    model = build_model(cls, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
    booster = Booster(plugin=plugin)
    model, opt, crit, _, _ = booster.boost(model, opt, criterion)
    losses = []
    dtype = torch.float16 if plugin_kwargs.get("precision") == "fp16" else torch.float32
    for step, batch in enumerate(batches):
        mine = split_microbatches(batch, plugin.dp_size)[plugin.mesh.dp_rank]
        losses.append(booster.execute_pipeline(iter([mine]), model, crit, opt)["loss"].item())
        with _first_step_checked(step, model, opt, first, f"dp x pp {plugin_kwargs}", dtype):
            opt.step()
        opt.zero_grad()
    return losses, model, plugin, booster


def _check_zero2(rank: int) -> None:
    """pp=2 x dp=2 with ZeRO-2, 1F1B and interleaved: the weights after 2 steps are the single-process
    ones; each step reduce-scatters every bucket once (not once per micro-batch) when the schedule is
    done, after which no full gradient is left, only this rank's fp32 partition (1/dp of the stage's)."""
    family, cls = "gpt2", "GPT2LMHeadModel"
    config = tiny_config(family, num_hidden_layers=4)
    batches = _batches(cls, config, 2, batch=16)
    ref_losses, ref, first = _reference(cls, config, batches, dp_size=2)
    for style in STYLES:
        where = f"ZeRO-2 dp x pp {style}"
        plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=M, zero_stage=2, **style)
        model = build_model(cls, copy.deepcopy(config))
        booster = Booster(plugin=plugin)
        model, opt, crit, _, _ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4),
                                               criterion)
        params = list(model.unwrap().parameters())
        for step, batch in enumerate(batches):
            mine = split_microbatches(batch, plugin.dp_size)[plugin.mesh.dp_rank]
            with comm_counter(plugin.mesh) as counter:
                loss = booster.execute_pipeline(iter([mine]), model, crit, opt)["loss"].item()
            assert abs(loss - ref_losses[step][plugin.mesh.dp_rank]) <= LOSS_ATOL[torch.float32], where
            calls = counter.summary()["dp"]["by_op"].get("reduce_scatter", 0)
            assert calls == len(opt.buckets), f"{where}: {calls} reduce-scatters for {len(opt.buckets)} buckets"
            assert all(p.grad is None for p in params), f"{where}: full gradients kept after the schedule"
            shard_bytes = sum(b.shard_size for b in opt.buckets) * 4
            assert opt.grad_bytes() == shard_bytes, f"{where}: {opt.grad_bytes()} vs {shard_bytes}"
            assert 2 * shard_bytes <= sum(p.numel() for p in params) * 4 + 2 * 4 * len(opt.buckets), where
            with _first_step_checked(step, model, opt, first, where):
                opt.step()
            opt.zero_grad()
        _check_weights(model, ref, where)


def _check_errors(rank: int) -> None:
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=M)
    booster = Booster(plugin=plugin)
    # more stages than layers: a stage without layers runs where the layout allows it (test_colossalai_configs),
    # not where the layers may return more than the hidden states (Bloom's blocks declare no return type)
    one_layer = build_model("BloomForCausalLM", tiny_config("bloom", num_hidden_layers=1))
    with pytest.raises(ValueError, match="only 1 layers; a stage would hold no layer.*BloomBlock"):
        booster.boost(one_layer)
    mlp = nn.Sequential(nn.Linear(4, 4))
    mlp.config = types.SimpleNamespace(model_type="mlp")
    with pytest.raises(ValueError, match="no pipeline stage layout"):
        booster.boost(mlp)
    blip2_t5 = tiny_config("blip2")                # a T5 language model: a variant the BLIP-2 layout does not describe
    blip2_t5.text_config = transformers.T5Config(vocab_size=blip2_t5.text_config.vocab_size, d_model=32, d_ff=64,
                                                 num_layers=2, num_heads=4, d_kv=8)
    blip2_t5.use_decoder_only_language_model = False
    with pytest.raises(ValueError, match=r"lacks the layout's \['language_model.model.decoder.layers'\]"):
        booster.boost(transformers.Blip2ForConditionalGeneration(blip2_t5))
    with pytest.raises(ValueError, match="use_weighted_layer_sum=True"):
        booster.boost(build_model("WhisperForAudioClassification", tiny_config("whisper", use_weighted_layer_sum=True)))
    config = tiny_config("llama", num_hidden_layers=2)
    llama = build_model("LlamaForCausalLM", config)
    model, opt, _, _, _ = booster.boost(llama, torch.optim.AdamW(llama.parameters()))
    odd = tiny_batch("LlamaForCausalLM", config, batch=6)
    with pytest.raises(ValueError, match="does not split into equal micro-batches"):
        booster.execute_pipeline(iter([odd]), model, criterion, opt)


def _check_manual_split_pp_plan(rank: int) -> None:
    """Qwen2 (layout read from transformers' base_model_pp_plan) with num_layers_per_stage=[1, 3]."""
    cls = "Qwen2ForCausalLM"
    config = tiny_config("qwen2", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    batches = _batches(cls, config, 1)
    ref_losses, ref, first = _reference(cls, config, batches)
    losses, model, plugin, _ = _pipeline(cls, config, batches, first, tp_size=1, pp_size=2, num_layers_per_stage=[1, 3])
    assert abs(losses[0] - ref_losses[0][0]) <= LOSS_ATOL[torch.float32], f"{cls}: {losses[0]} vs {ref_losses[0][0]}"
    _check_weights(model, ref, f"{cls} layers [1, 3]")
    held = {n.split(".")[2] for n, _ in model.unwrap().named_parameters() if ".layers." in n}
    assert held == ({"0"} if plugin.mesh.pp_rank == 0 else {"1", "2", "3"}), held


def _body_2(rank: int, world_size: int) -> None:
    _check_family_styles(rank, tp_size=1)
    _check_per_layer_types(rank, tp_size=1)
    _check_more_families(rank, tp_size=1)
    _check_several_stacks(rank, ("t5_interleaved", "whisper_3_5", "blip2_3_3", "blip2_interleaved",
                                 "albert_one_group", "albert_two_groups"))
    _check_microbatch_normalization(rank, tp_size=1)
    _check_half_precision_inputs(rank)
    _check_multi_step(rank, 1, "gpt2", "GPT2LMHeadModel", STYLES[1])
    _check_manual_split_pp_plan(rank)
    _check_evaluation(rank, tp_size=1)
    _check_errors(rank)


def _body_4(rank: int, world_size: int) -> None:
    _check_family_styles(rank, tp_size=2)
    _check_per_layer_types(rank, tp_size=2)
    _check_more_families(rank, tp_size=2, families=MORE_FAMILIES[1:])
    _check_several_stacks(rank, ("t5_pp4", "whisper_tp2", "blip2_tp2", "albert_tp2"))
    _check_multi_step(rank, 2, "llama", "LlamaForCausalLM", STYLES[0])
    _check_evaluation(rank, tp_size=2)
    _check_dp(rank)
    _check_dp(rank, zero_stage=1, precision="fp16")
    _check_zero2(rank)


def test_pipeline_pp2():
    spawn(_body_2, 2)


def test_pipeline_tp2_pp2_and_dp2_pp2():
    spawn(_body_4, 4)


# -- pure pieces: no processes ---------------------------------------------------------------------
def _simulate(P: int, V: int, M: int, forward_only: bool) -> None:
    """Run every rank's order with blocking receives and asynchronous sends; fail on deadlock."""
    orders = [schedule_order(P, r, M, V, forward_only) for r in range(P)]
    pos, sent, last = [0] * P, set(), P * V - 1
    while any(pos[r] < len(orders[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                kind, chunk, mb = orders[r][pos[r]]
                v = chunk * P + r
                need = ("act", v, mb) if kind == "F" and v > 0 else ("grad", v, mb) if kind == "B" and v < last else None
                if need is not None and need not in sent:
                    break
                if kind == "F" and v < last:
                    sent.add(("act", v + 1, mb))
                if kind == "B" and v > 0:
                    assert ("F", chunk, mb) in orders[r][:pos[r]], "backward before its forward"
                    sent.add(("grad", v - 1, mb))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock P={P} V={V} M={M}: {[orders[r][pos[r]:pos[r] + 1] for r in range(P)]}"
    for r in range(P):
        units = [(c, m) for k, c, m in orders[r] if k == "F"]
        assert sorted(units) == [(c, m) for c in range(V) for m in range(M)], "each unit runs exactly once"


@pytest.mark.parametrize("P,V", [(2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (4, 2), (3, 2)])
def test_schedule_order_is_deadlock_free(P, V):
    for M in ([1, 2, 3, 5, 8] if V == 1 else [P, 2 * P, 3 * P]):
        _simulate(P, V, M, forward_only=False)
        _simulate(P, V, M, forward_only=True)


def test_split_layers_even_remainder_to_middle():
    assert [len(r) for r in split_layers(4, 2)] == [2, 2]
    assert [len(r) for r in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(7, 4)] == [1, 2, 2, 2]
    assert [list(r) for r in split_layers(5, 2, [1, 4])] == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="only 3 layers"):
        split_layers(3, 4)
    assert [len(r) for r in split_layers(2, 4, allow_empty=True)] == [0, 1, 1, 0]      # ColossalAI's split
    assert [len(r) for r in split_layers(2, 6, allow_empty=True)] == [0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="summing to the model's 5 layers"):
        split_layers(5, 2, [2, 2])


def test_layouts_cover_families():
    for family, cls in FAMILIES:
        model = build_model(cls, tiny_config(family))
        layout = get_layout(model, pipeline_layout(model))         # as the plugin looks it up
        assert [s.layers for s in layout.segments] in (["encoder.layer"], ["h"], ["layers"])
    for family, cls in MORE_FAMILIES:
        model = build_model(cls, tiny_config(family))
        assert get_layout(model, pipeline_layout(model)).name == f"policy:{model.config.model_type}"
    assert get_layout(build_model("Qwen2ForCausalLM", tiny_config("qwen2"))).name == "pp_plan:qwen2"


def test_config_errors_before_any_collective():
    with pytest.raises(ValueError, match="needs num_microbatches or microbatch_size \\(got neither\\)"):
        PipelineConfig().check(2)
    with pytest.raises(ValueError, match="microbatch_size=0 must be a positive integer"):
        PipelineConfig(num_microbatches=4, microbatch_size=0).check(2)
    PipelineConfig(num_microbatches=4, microbatch_size=2).check(2)       # both, as ColossalAI's scripts pass
    batch = {"input_ids": torch.arange(16).view(8, 2)}
    assert [mb["input_ids"].shape[0] for mb in split_microbatches(batch, 4, 2)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="a batch of 6 samples is not num_microbatches=4 x microbatch_size=2 = 8"):
        split_microbatches({"input_ids": torch.zeros(6, 2)}, 4, 2)
    with pytest.raises(ValueError, match="needs num_model_chunks >= 2"):
        PipelineConfig(num_microbatches=4, pp_style="interleaved").check(2)
    with pytest.raises(ValueError, match="needs pp_style='interleaved'"):
        PipelineConfig(num_microbatches=4, num_model_chunks=2).check(2)
    with pytest.raises(ValueError, match="pp_style="):
        PipelineConfig(num_microbatches=4, pp_style="gpipe").check(2)
    with pytest.raises(ValueError, match="needs 4 entries"):
        PipelineConfig(num_microbatches=4, pp_style="interleaved", num_model_chunks=2,
                       num_layers_per_stage=[2, 2]).check(2)
    PipelineConfig(microbatch_size=1).check(1)        # ignored without a pipeline (ColossalAI's guide passes it)
    with pytest.raises(ValueError, match="only apply with pp_size > 1"):
        PipelineConfig(num_model_chunks=2).check(1)
    # the plugin raises them before building its mesh (no process group here)
    with pytest.raises(ValueError, match="needs num_microbatches or microbatch_size"):
        HybridParallelPlugin(tp_size=1, pp_size=2)


def test_split_microbatches():
    batch = {"input_ids": torch.arange(12).view(6, 2), "flag": True}
    parts = split_microbatches(batch, microbatch_size=2)
    assert len(parts) == 3 and parts[1]["input_ids"].tolist() == [[4, 5], [6, 7]] and parts[2]["flag"] is True
    with pytest.raises(ValueError, match="microbatch_size=4"):
        split_microbatches(batch, microbatch_size=4)
