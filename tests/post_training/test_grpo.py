"""Issue 59 point 3 on 4 processes (fp32, tiny Llama of 2 layers, vocabulary 101: padded at tp=2): the GRPO step on
fixed rollouts and rewards (no sampling), each layout against one process from the same weights:

- two SGD steps on one rollout batch (the old log-probs computed once, at preparation, and reused: the second
  step's ratios move off 1 and the clip engages) at tp=2 x dp=2 (DDP), tp=2 x dp=2 ZeRO-1, dp=4 ZeRO-2, tp=2 x dp=2 ZeRO-3
  (FSDP2), cp=2 x dp=2 ZeRO-1, pp=2 x dp=2 and pp=2 x tp=2 (execute_pipeline, the last stage scoring each micro-
  batch), ep=2 x dp=4 ZeRO-1 on a tiny Qwen3-MoE, and TorchDDPPlugin and FSDPPlugin at dp=4; each normalisation
  ("token", "sequence", "constant", with the reward scalings "group", "batch", "none") at two layouts or more,
  the k3 KL to a reference at every HybridParallelPlugin layout but pp=2 x dp=2: the loss and every logged
  metric within 2e-5 relative on every rank, and the weights after the steps (exported whole by
  `booster.export_weights`) within 1e-6;
- LoRA at tp=2 x dp=2 with `reference=BASE` (the KL to the policy's own base through peft's disable_adapter())
  against one process whose reference is the base model itself: the metrics, and the adapters after the steps;
- the one process's loss against a per-token formula written out here with loops (advantages from Python's
  statistics module, the clip and each normalisation by hand), with old log-probs from another model so the
  ratios spread over both sides of the clip range (DAPO's clip-higher: eps_low 0.1, eps_high 0.3);
- gradient accumulation: a rollout batch prepared as two parts with the window's counts gives the whole batch's
  loss and gradient (one process, every normalisation);
- a wrong rule fails: the advantages taken over each replica's rows instead of each group move the loss past the
  tolerance;
- refused on every rank before any collective: a group split across replicas (rank 0's rows shifted by one
  completion), rewards of the wrong shape (rank 1), an empty completion (rank 2), and rows that do not split
  into the pipeline's micro-batches.
One process group, the layouts looped inside."""

import copy
import dataclasses
import math
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshboost import Booster
from meshboost.pipeline.config import PipelineConfig
from meshboost.plugins import FSDPPlugin, HybridParallelConfig, HybridParallelPlugin, TorchDDPPlugin, ZeroConfig
from meshboost.post_training import (BASE, GRPOBatchError, GRPOConfig, RolloutBatch, boost_reference, grpo_loss,
                                     grpo_step, group_advantages, prepare_grpo)
from meshboost.testing import spawn
from meshboost.testing.compare import assert_metric_steps_close
from meshboost.testing.models import VOCAB, build_model, sharper_copy, tiny_config
from meshboost.testing.moe import build_causal_lm, moe_config

PROMPTS, G, SEQ, LR, STEPS, RTOL = 4, 4, 10, 1.0, 2, 2e-5
CONFIGS = {"token": GRPOConfig(epsilon_low=0.1, epsilon_high=0.3, beta=0.1),
           "sequence": GRPOConfig(epsilon_low=0.1, normalization="sequence", scale_rewards="batch"),
           "constant": GRPOConfig(epsilon_low=0.1, epsilon_high=0.3, normalization="constant", max_length=6,
                                  scale_rewards="none", beta=0.05)}
MB2 = PipelineConfig(num_microbatches=2)
LAYOUTS = {"tp2 dp2": (HybridParallelConfig(tp_size=2), ("token", "sequence")),
           "tp2 dp2 zero1": (HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1)), ("constant",)),
           "dp4 zero2": (HybridParallelConfig(zero=ZeroConfig(stage=2)), ("sequence",)),
           "tp2 dp2 zero3": (HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=3)), ("token", "sequence")),
           "cp2 dp2 zero1": (HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=1)), ("token", "constant")),
           "pp2 dp2": (HybridParallelConfig(pp_size=2, pipeline=MB2), ("sequence",)),
           "pp2 tp2": (HybridParallelConfig(tp_size=2, pp_size=2, pipeline=MB2), ("token", "constant")),
           "moe ep2 dp4 zero1": (HybridParallelConfig.of(ep_size=2, zero_stage=1), ("token",)),
           "TorchDDPPlugin dp4": (TorchDDPPlugin, ("sequence",)),          # plugins without a mesh: every rank
           "FSDPPlugin dp4": (FSDPPlugin, ("sequence",))}                   # a replica (no reference: beta=0)


def _config():
    config = tiny_config("llama", num_key_value_heads=2)
    config.use_cache = False
    return config


def _make(what: str):
    """The policy of a layout: a tiny Qwen3-MoE (4 experts, top-2) for the ep layouts, else the tiny Llama."""
    if what.startswith("moe"):
        return build_causal_lm(moe_config("qwen3_moe"))
    torch.manual_seed(0)
    return build_model("LlamaForCausalLM", _config())


def _rollouts(seed: int = 3) -> tuple[RolloutBatch, torch.Tensor]:
    """PROMPTS groups of G completions, right-padded to SEQ: prompt of 2-4 tokens, response of 2-6, and rewards
    with spread inside every group."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPTS * G
    ids = torch.zeros(n, SEQ, dtype=torch.long)
    mask, response = torch.zeros_like(ids), torch.zeros(n, SEQ, dtype=torch.bool)
    for p in range(PROMPTS):
        prompt = torch.randint(1, VOCAB, (2 + p % 3,), generator=g)
        for k in range(G):
            i, length = p * G + k, 2 + (p + 2 * k) % 5
            ids[i, :len(prompt)] = prompt
            ids[i, len(prompt):len(prompt) + length] = torch.randint(1, VOCAB, (length,), generator=g)
            mask[i, :len(prompt) + length] = 1
            response[i, len(prompt):len(prompt) + length] = True
    rewards = torch.randint(0, 4, (n,), generator=g).float() + torch.rand(n, generator=g)
    return RolloutBatch(ids, mask, response, G), rewards


def _share(rollout: RolloutBatch, rewards, rank: int, size: int):
    rows = rollout.rows // size
    return rollout.select(slice(rank * rows, (rank + 1) * rows)), rewards[rank * rows:(rank + 1) * rows]


def _one_process(what, normalization):
    """One process: prepare once, STEPS SGD steps on the same rollouts; the metrics and the final weights."""
    model = _make(what)
    ref = sharper_copy(model, 1.5).eval().requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rollout, rewards = _rollouts()
    grpo = CONFIGS[normalization]
    prepared = prepare_grpo(model, rollout, rewards, grpo, reference=ref if grpo.beta else None)
    out = []
    for _ in range(STEPS):
        step = grpo_loss(model, prepared, grpo)
        step.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(step.metrics)
    assert out[1]["clip_fraction"] > 0, out        # the clip is exercised
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _boosted(what, plugin_config, normalization):
    plugin = plugin_config() if callable(plugin_config) else HybridParallelPlugin(plugin_config)
    booster = Booster(plugin=plugin)
    policy = _make(what)
    grpo = CONFIGS[normalization]
    ref = boost_reference(booster, sharper_copy(policy, 1.5)) if grpo.beta else None
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    model.train()
    mesh = getattr(model, "mesh", None)
    replica, replicas = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (dist.get_rank(), dist.get_world_size())
    rollout, rewards = _share(*_rollouts(), replica, replicas)
    prepared = prepare_grpo(model, rollout, rewards, grpo, reference=ref, booster=booster)
    out = []
    for _ in range(STEPS):
        out.append(grpo_step(booster, model, optimizer, prepared, grpo).metrics)
        optimizer.step()
        optimizer.zero_grad()
    weights = dict(booster.export_weights(model))
    return out, weights


def _check_layouts(rank):
    wants = {}
    for what, (plugin_config, normalizations) in LAYOUTS.items():
        family = "moe" if what.startswith("moe") else "llama"
        for normalization in normalizations:
            if (family, normalization) not in wants:
                wants[(family, normalization)] = _one_process(family, normalization)
            got, weights = _boosted(what, plugin_config, normalization)
            want, want_weights = wants[(family, normalization)]
            assert_metric_steps_close(got, want, f"{what} {normalization}", RTOL)
            if rank == 0:
                assert weights, what
                for name, tensor in weights.items():
                    torch.testing.assert_close(tensor, want_weights[name], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{what} {normalization} {name}: {m}")


def _lora_policy(booster=None):
    """The tiny Llama with LoRA adapters on every linear, lora_B random (the policy differs from its base)."""
    import peft

    base = _make("llama")
    torch.manual_seed(7)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    return booster.enable_lora(base, lora_config=lora) if booster is not None else peft.get_peft_model(base, lora)


def _check_lora(rank):
    """LoRA at tp=2 x dp=2 with the reference the policy's own base (`reference=BASE`: peft's disable_adapter(), no
    second copy) against one process whose reference is the base model itself; the adapters after the steps."""
    import peft

    grpo = CONFIGS["token"]
    model = _lora_policy()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    prepared = prepare_grpo(model, *_rollouts(), grpo, reference=_make("llama").eval())
    want = []
    for _ in range(STEPS):
        step = grpo_loss(model, prepared, grpo)
        step.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(step.metrics)
    assert want[0]["kl"] > 1e-4, want                 # the adapters moved the policy off its base
    want_adapters = {k: v.detach() for k, v in peft.get_peft_model_state_dict(model).items()}
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2)))
    policy = _lora_policy(booster)
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad],
                                                                 lr=LR))
    model.train()
    prepared = prepare_grpo(model, *_share(*_rollouts(), model.mesh.dp_rank, 2), grpo, reference=BASE)
    got = []
    for _ in range(STEPS):
        got.append(grpo_step(booster, model, optimizer, prepared, grpo).metrics)
        optimizer.step()
        optimizer.zero_grad()
    assert_metric_steps_close(got, want, "lora tp2 dp2", RTOL)
    adapters = dict(booster.export_weights(model, lora="adapters"))
    if rank == 0:
        assert adapters.keys() == want_adapters.keys(), (sorted(adapters)[:3], sorted(want_adapters)[:3])
        for name, tensor in adapters.items():
            torch.testing.assert_close(tensor, want_adapters[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _check_wrong_rule(rank):
    """Advantages over each replica's rows (not each group) give another loss: the comparison above catches it."""
    config = _config()
    want, _ = _one_process("llama", "sequence")
    grpo = CONFIGS["sequence"]
    torch.manual_seed(0)
    fresh = build_model("LlamaForCausalLM", copy.deepcopy(config))
    rollout, rewards = _rollouts()
    right = grpo_loss(fresh, prepare_grpo(fresh, rollout, rewards, grpo), grpo).metrics["loss"]
    assert abs(right - want[0]["loss"]) <= RTOL * abs(want[0]["loss"])
    per_replica = torch.cat([group_advantages(r, len(r), "batch") for r in rewards.chunk(2)])
    wrong_batch = dataclasses.replace(prepare_grpo(fresh, rollout, rewards, grpo), advantages=per_replica)
    wrong = grpo_loss(fresh, wrong_batch, grpo).metrics["loss"]
    assert abs(wrong - right) > 100 * RTOL * abs(right), (wrong, right)


def _by_hand(model, rollout, rewards, old, ref, grpo: GRPOConfig) -> float:
    """The GRPO loss written out token by token, independent of meshboost's code."""
    logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
    logp = F.log_softmax(logits.double(), -1)
    low, high = grpo.clip_range
    adv = []
    for p in range(rollout.rows // G):
        group = rewards[p * G:(p + 1) * G].tolist()
        mean = statistics.mean(group)
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(rewards.tolist()), "none": None}[
            grpo.scale_rewards]
        adv += [(r - mean) / (std + 1e-4) if std is not None else r - mean for r in group]
    total, tokens, per_sequence = 0.0, 0, []
    for i in range(rollout.rows):
        seq_total, seq_tokens = 0.0, 0
        for j in range(1, rollout.input_ids.shape[1]):
            if not rollout.response_mask[i, j]:
                continue
            new = logp[i, j - 1, rollout.input_ids[i, j]].item()
            ratio = math.exp(new - old[i, j - 1].item())
            term = -min(ratio * adv[i], min(max(ratio, low), high) * adv[i])
            if grpo.beta:
                d = ref[i, j - 1].item() - new
                term += grpo.beta * (math.exp(d) - d - 1)
            seq_total, seq_tokens = seq_total + term, seq_tokens + 1
        total, tokens = total + seq_total, tokens + seq_tokens
        per_sequence.append(seq_total / seq_tokens)
    if grpo.normalization == "token":
        return total / tokens
    if grpo.normalization == "sequence":
        return sum(per_sequence) / len(per_sequence)
    return total / (rollout.rows * grpo.max_length)


def _check_by_hand(rank):
    config = _config()
    torch.manual_seed(0)
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    old_model = build_model("LlamaForCausalLM", copy.deepcopy(config), seed=1).eval()     # ratios far from 1
    ref = sharper_copy(model, 2.0).eval()
    rollout, rewards = _rollouts(5)
    from meshboost.post_training import token_logprobs

    with torch.no_grad():
        old = token_logprobs(old_model, rollout.model_batch()).logprobs
        ref_lp = token_logprobs(ref, rollout.model_batch()).logprobs
    for normalization, grpo in CONFIGS.items():
        for scale in ("group", "batch", "none"):
            grpo = dataclasses.replace(grpo, scale_rewards=scale)
            prepared = dataclasses.replace(prepare_grpo(model, rollout, rewards, grpo, reference=ref),
                                           old_logprobs=old, ref_logprobs=ref_lp if grpo.beta else None)
            out = grpo_loss(model, prepared, grpo)
            want = _by_hand(model, rollout, rewards, old, ref_lp, grpo)
            assert abs(out.loss.item() - want) <= 1e-5 * abs(want), (normalization, scale, out.loss.item(), want)
            assert abs(out.metrics["loss"] - want) <= 1e-5 * abs(want)
            assert 0.05 < out.metrics["clip_fraction"] < 0.95, out.metrics       # both sides of the clip range
    quiet = dataclasses.replace(grpo, log_entropy=False)               # no entropy: the same loss, NaN logged
    unlogged = grpo_loss(model, prepared, quiet)
    assert unlogged.loss.item() == pytest.approx(out.loss.item(), rel=1e-6) and math.isnan(unlogged.metrics["entropy"])


def _check_accumulation(rank):
    """One rollout batch prepared as two accumulation parts (whole groups each) with the window's counts gives the
    whole batch's gradient and loss, for every normalisation (one process)."""
    rollout, rewards = _rollouts()
    half = rollout.rows // 2
    for normalization, grpo in CONFIGS.items():
        grpo = dataclasses.replace(grpo, beta=0.0, scale_rewards="group")
        grads = []
        for parts in (1, 2):
            model = _make("llama")
            rows = [(rollout, rewards)] if parts == 1 else [
                (rollout.select(slice(k * half, (k + 1) * half)), rewards[k * half:(k + 1) * half]) for k in range(2)]
            loss = 0.0
            for part, part_rewards in rows:
                counts = dict(sequences_in_batch=rollout.rows, tokens_in_batch=int(rollout.response_mask.sum()))
                out = grpo_loss(model, prepare_grpo(model, part, part_rewards, grpo, **counts), grpo)
                out.loss.backward()
                loss += out.metrics["loss"]
            grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
        (whole, whole_grad), (parts, parts_grad) = grads
        assert abs(whole - parts) <= 1e-5 * abs(whole) + 1e-7, (normalization, whole, parts)
        torch.testing.assert_close(parts_grad, whole_grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{normalization}: {m}")


def _check_refusals(rank):
    config = _config()
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2)))
    torch.manual_seed(0)
    model, *_ = booster.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
    rollout, rewards = _rollouts()
    grpo = CONFIGS["sequence"]
    dp = model.mesh.dp_rank
    good = _share(rollout, rewards, dp, 2)
    shifted = (rollout.select(slice(1, 9)), rewards[1:9])                    # a group cut across the replicas
    bad = {"a split group": (0, shifted, "hold different prompts"),
           "rewards of the wrong shape": (1, (good[0], good[1][:-1]), "one float per completion"),
           "an empty completion": (2, (dataclasses.replace(good[0], response_mask=good[0].response_mask.clone()
                                                            .index_fill_(0, torch.tensor([3]), False)), good[1]),
                                   "row 3 holds no completion token")}
    for what, (culprit, batch, text) in bad.items():
        with pytest.raises(GRPOBatchError) as error:
            prepare_grpo(model, *(batch if rank == culprit else good), grpo)
        message = str(error.value)
        assert "every rank before any collective" in message, (what, message)
        assert (text in message) == (rank == culprit), (what, message)
        assert (f"rank(s) [{culprit}]" in message) == (rank != culprit), (what, message)
    pipelined = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(
        num_microbatches=3))))
    model, *_ = pipelined.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
    with pytest.raises(GRPOBatchError, match="every rank before any collective"):
        prepare_grpo(model, *_share(rollout, rewards, model.mesh.dp_rank, 2), grpo, booster=pipelined)
    prepare_grpo(build_model("LlamaForCausalLM", copy.deepcopy(config)), *good, grpo)     # the ranks still in step


def _body(rank, world_size):
    _check_accumulation(rank)
    _check_lora(rank)
    _check_by_hand(rank)
    _check_refusals(rank)
    _check_wrong_rule(rank)
    _check_layouts(rank)


def test_grpo_layouts():
    spawn(_body, 4)
