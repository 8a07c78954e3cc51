"""Issue 58 point 1-3 under pipeline parallelism, on 4 processes (fp32, tiny Llama of 2 layers, vocabulary 101:
padded at tp=2), through `preference_step` (execute_pipeline: the last stage scores each micro-batch from its
logits), each against one process from the same weights and pairs over two SGD steps:

- DPO (label smoothing 0.1), IPO, SimPO, ORPO at pp=2 x dp=2 (2 micro-batches of 1 pair each per replica),
  pp=2 x tp=2 (2 micro-batches of 2 pairs: vocab-split logits on the last stage) and pp=2 x tp=2 with
  microbatch_size=2 (4 micro-batches of 1 pair): the global loss per step within 2e-5 relative and every logged
  reward, margin, accuracy and log-prob equal, on every rank (the metrics travel from the last stage); the second
  step's loss moves by more than that (SGD: a wrong gradient scale, e.g. a micro-batch counted twice, shows);
- KTO (its KL estimate over the global batch from forward-only passes) at pp=2 x dp=2 and pp=2 x tp=2 with
  microbatch_size=2, the same way; rows that do not split into the schedule's micro-batches refused on every rank;
- the forward-only log-probs of a micro-batch-laid batch equal the unsharded log_softmax gather, per sequence;
- pair_batch(microbatches=M) keeps every pair in one micro-batch ([chosen; rejected] per block);
- refused on every rank before any collective (the ranks still in step after): a prompt longer than the sequence
  limit on one rank (`max_length`), a row past it, pairs that do not split into whole-pair micro-batches, a
  reference boosted with another layout than the policy (tp2 x pp2 against pp2 x dp2) or not boosted at all under
  pp, and pp x cp (the last stage would hold a piece of every sequence).
One process group, the layouts looped inside."""

import copy

import pytest
import torch

from meshboost import Booster
from meshboost.pipeline.config import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.post_training import (PreferenceBatchError, boost_reference, kto_loss, kto_step, pair_batch,
                                     pipeline_sequence_logprobs, preference_step, sequence_logprobs)
from meshboost.testing import spawn
from meshboost.testing.models import build_model, sharper_copy

from tests.post_training.pairs import (LR, PAIRS, STEPS, check_layouts, compare, preference_config, preference_steps,
                                       random_pairs, replica)

LAYOUTS = {"pp2 dp2": HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2)),
           "pp2 tp2": HybridParallelConfig(tp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2)),
           "pp2 tp2 mbs2": HybridParallelConfig(tp_size=2, pp_size=2, pipeline=PipelineConfig(microbatch_size=2))}


def _pipelined(objective, config, pairs, plugin_config) -> list[dict]:
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
    ref = boost_reference(booster, copy.deepcopy(policy)) if objective in ("dpo", "ipo") else None
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    return preference_steps(booster, model, optimizer, pairs, objective, ref)


def _check_layout_of_pairs(rank):
    rows = random_pairs(3)
    batch = pair_batch(rows, microbatches=2)
    half = PAIRS // 2
    for m in range(2):                       # block m: chosen then rejected of pairs m*half .. (m+1)*half - 1
        block = batch["input_ids"][2 * half * m:2 * half * (m + 1)]
        assert torch.equal(block[:half], rows["chosen_input_ids"][m * half:(m + 1) * half])
        assert torch.equal(block[half:], rows["rejected_input_ids"][m * half:(m + 1) * half])


def _check_forward_logprobs(rank):
    config = preference_config()
    rows = random_pairs(7)
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    want = sequence_logprobs(whole.eval(), pair_batch(rows, microbatches=2)).sums.detach()
    booster = Booster(plugin=HybridParallelPlugin(LAYOUTS["pp2 tp2"]))
    ref = boost_reference(booster, copy.deepcopy(whole))
    scored = pipeline_sequence_logprobs(booster, ref, pair_batch(rows, microbatches=2), 2)
    if ref.mesh.pp_rank == 1:
        torch.testing.assert_close(torch.cat([s.sums for s in scored]), want, rtol=1e-5, atol=1e-5)
    else:
        assert scored is None


def _check_paired(rank):
    check_layouts(preference_config(), [random_pairs(10 + s) for s in range(STEPS)], LAYOUTS, _pipelined)


def _kto_rows(seed: int) -> tuple[dict, dict, torch.Tensor]:
    """2 x PAIRS unpaired rows (a pair set's chosen and rejected rows), as many mismatched KL rows, the flags."""
    def rows(pairs):
        return {k: torch.cat([pairs[f"chosen_{k}"], pairs[f"rejected_{k}"]]) for k in ("input_ids", "labels",
                                                                                     "attention_mask")}
    return rows(random_pairs(seed)), rows(random_pairs(seed + 50)), torch.arange(2 * PAIRS) % 3 != 0


KTO_HYPER = dict(beta=0.5, undesirable_weight=1.5)


def _check_kto(rank):
    """KTO at pp=2 x dp=2 and pp=2 x tp=2 with microbatch_size=2: its KL estimate from forward-only passes over
    the global batch, then the policy's training pass; two SGD steps against one process."""
    config = preference_config()
    steps = [_kto_rows(60 + s) for s in range(STEPS)]
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    ref = sharper_copy(model).eval().requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    want = []
    for batch, kl_batch, desirable in steps:
        with torch.no_grad():
            reference, kl_reference = sequence_logprobs(ref, batch), sequence_logprobs(ref, kl_batch)
            kl_policy = sequence_logprobs(model, kl_batch)
        out = kto_loss(sequence_logprobs(model, batch), reference, desirable, kl_policy, kl_reference, **KTO_HYPER)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(out.metrics)
    assert min(w["kl"] for w in want) > 1e-3, want        # the estimate is not the clamp's 0
    for what in ("pp2 dp2", "pp2 tp2 mbs2"):
        booster = Booster(plugin=HybridParallelPlugin(LAYOUTS[what]))
        policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
        reference = boost_reference(booster, sharper_copy(policy))
        model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
        model.train()
        mesh, got = model.mesh, []
        for batch, kl_batch, desirable in steps:
            here = [replica(b, mesh.dp_rank, mesh.dp_size) for b in (batch, kl_batch, {"d": desirable})]
            got.append(kto_step(booster, model, optimizer, here[0], here[1], here[2]["d"], reference,
                                **KTO_HYPER).metrics)
            optimizer.step()
            optimizer.zero_grad()
        compare(got, want, f"kto {what}")
    # rows that do not split into the schedule's micro-batches: refused on every rank, the ranks in step after
    booster = Booster(plugin=HybridParallelPlugin(LAYOUTS["pp2 tp2 mbs2"]))
    policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
    reference = boost_reference(booster, copy.deepcopy(policy))
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    batch, kl_batch, desirable = steps[0]
    odd = {k: v[:7] for k, v in kl_batch.items()} if rank == 0 else kl_batch
    with pytest.raises(PreferenceBatchError, match="every rank before any collective"):
        kto_step(booster, model, optimizer, batch, odd, desirable, reference, **KTO_HYPER)


def _check_refusals(rank):
    good = random_pairs(5)
    long_prompt = {**good, "chosen_labels": good["chosen_labels"].clone()}
    long_prompt["chosen_labels"][1, :7] = -100                # a 7-token prompt, limit 6
    bad = {"a prompt past the limit": (long_prompt, dict(max_length=6), "the prompt of chosen row 1 holds 7"),
           "a row past the limit": (good, dict(max_length=6), "past the sequence limit max_length=6"),
           "pairs that split a micro-batch": (good, dict(microbatches=3), "do not split into 3 pipeline")}
    for culprit, (what, (batch, kwargs, text)) in enumerate(bad.items()):
        with pytest.raises(PreferenceBatchError) as error:
            pair_batch(batch if rank == culprit else random_pairs(5), **(kwargs if rank == culprit else {}))
        message = str(error.value)
        assert (text in message) == (rank == culprit) and "every rank before any collective" in message, (what, message)
    config = preference_config()
    policy_booster = Booster(plugin=HybridParallelPlugin(LAYOUTS["pp2 dp2"]))
    other = boost_reference(Booster(plugin=HybridParallelPlugin(LAYOUTS["pp2 tp2"])),
                            build_model("LlamaForCausalLM", copy.deepcopy(config)))
    policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
    model, optimizer, *_ = policy_booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    rows = replica(good, model.mesh.dp_rank, 2)
    with pytest.raises(ValueError, match="boost_reference"):
        preference_step(policy_booster, model, optimizer, rows, "dpo", reference=other)
    with pytest.raises(ValueError, match="with pp_size=2 the reference must be boosted"):
        preference_step(policy_booster, model, optimizer, rows, "dpo",
                        reference=build_model("LlamaForCausalLM", copy.deepcopy(config)))
    cp_booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(
        cp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2))))
    policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
    cp_model, cp_optimizer, *_ = cp_booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    with pytest.raises(NotImplementedError, match="cp_size=2"):
        preference_step(cp_booster, cp_model, cp_optimizer, good, "simpo")
    pair_batch(good)             # every rank fine: nothing raised, and the ranks are still in step


def _body(rank, world_size):
    _check_refusals(rank)
    _check_layout_of_pairs(rank)
    _check_forward_logprobs(rank)
    _check_paired(rank)
    _check_kto(rank)


def test_post_training_pipeline():
    spawn(_body, 4)
