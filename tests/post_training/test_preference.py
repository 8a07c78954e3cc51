"""Issue 58, points 1-3, on 4 processes (fp32, tiny Llama, vocabulary 101: padded at tp=2), each layout against
one process from the same weights and pairs:

- token log-probs: at tp=2 (vocab-split logits, in training and in eval for a frozen reference), tp=2 with
  Megatron sequence parallelism, cp=2 (training: this rank's positions; eval: whole sequences), each equal to
  the unsharded log_softmax gathered at the shifted labels (prompt and padding -100), with the entropy;
- DPO (label smoothing 0.1), IPO, SimPO, ORPO over two SGD steps at tp=2 x dp=2 (DDP), tp=2 x dp=2 with ZeRO-1,
  cp=2 x dp=2 with ZeRO-1, tp=2 with sequence parallelism x dp=2, and KTO (its KL over the global batch) at
  tp=2 x dp=2 and cp=2 x dp=2: the global loss per step within 2e-5 relative and every logged reward, margin
  and accuracy equal; the second step's loss moves by more than that (SGD: a wrong gradient scale shows);
- token log-probs in bf16 and fp16 at tp=2: fp32 results, as close to the fp32 truth as one process in the
  same precision;
- the reference boosted for inference only: frozen, eval, no gradient, not inside DDP;
- refusals raised on every rank before any collective, with one rank's batch bad: a missing rejected field,
  an empty response, a split pair (3 chosen, 2 rejected).
One process group, the layouts looped inside."""

import copy

import pytest
import torch
import torch.nn.functional as F

from meshboost import Booster
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.post_training import (PreferenceBatchError, boost_reference, dp_group_of, kto_loss, pair_batch,
                                     preference_loss, sequence_logprobs, shifted_labels, token_logprobs)
from meshboost.shardformer.layers.vocab import split_logits
from meshboost.testing import spawn
from meshboost.testing.models import build_model, sharper_copy

from tests.post_training.pairs import (HYPER, LR, PAIRS, SEQ, STEPS, check_layouts, compare, preference_config,
                                       random_pairs, random_rows, replica)

SP = dict(sequence_parallel=True)
LAYOUTS = {"tp2 dp2": HybridParallelConfig(tp_size=2),
           "tp2 dp2 zero1": HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1)),
           "cp2 dp2 zero1": HybridParallelConfig(cp_size=2, zero=ZeroConfig(stage=1)),
           "tp2 sp dp2": HybridParallelConfig(tp_size=2, **SP)}


def _gather_logprobs(model, batch: dict) -> torch.Tensor:
    """The unsharded truth: log_softmax of the whole vocabulary, gathered at the shifted labels, 0 where -100."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    target = shifted_labels(batch["labels"])
    picked = F.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(target == -100, 0.0)


def _check_token_logprobs(rank):
    config = preference_config()
    batch = pair_batch(random_pairs(3))
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    want = _gather_logprobs(whole, batch).detach()
    logp = F.log_softmax(whole(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
    want_entropy = -(logp.exp() * logp).sum(-1).masked_fill(shifted_labels(batch["labels"]) == -100, 0).detach()
    for what, plugin_config in (("tp2", HybridParallelConfig(tp_size=2)), ("cp2", HybridParallelConfig(cp_size=2)),
                                ("tp2 sp", HybridParallelConfig(tp_size=2, **SP)),
                                ("cp2 ring", HybridParallelConfig(cp_size=2, cp_mode="ring_attn"))):
        booster = Booster(plugin=HybridParallelPlugin(plugin_config))
        model, *_ = booster.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
        for mode in ("train", "eval"):
            getattr(model, mode)()
            got = token_logprobs(model, batch, entropy=True)
            cols = got.positions if got.positions is not None else torch.arange(SEQ)
            assert (got.positions is not None) == (what.startswith("cp") and mode == "train"), (what, mode)
            torch.testing.assert_close(got.logprobs.detach(), want[:, cols], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{what} {mode}: {m}")
            torch.testing.assert_close(got.entropy, want_entropy[:, cols], rtol=1e-5, atol=1e-5)
            if what.startswith("tp"):      # eval too: the head keeps its vocab shard (no gather of the vocabulary)
                head = model.unwrap().get_output_embeddings()
                with split_logits():
                    assert head.output_is_parallel and head(torch.zeros(1, 32)).shape[-1] == 64, (what, mode)
            sums = sequence_logprobs(model, batch)
            torch.testing.assert_close(sums.sums.detach(), want.sum(1), rtol=1e-5, atol=1e-5)
            assert sums.counts.tolist() == (shifted_labels(batch["labels"]) != -100).sum(1).float().tolist()


def _check_half_precision_logprobs(rank):
    """bf16 and fp16 at tp=2 (train and eval): the log-probs come back in fp32 (the vocab-parallel reductions
    run in fp32), and their error against the fp32 truth is of the size one process has in the same precision
    (tp only reorders the half-precision sums); a wrong label shard or an unreduced log-sum-exp is off by units."""
    config = preference_config()
    batch = pair_batch(random_pairs(5))
    whole = build_model("LlamaForCausalLM", copy.deepcopy(config))
    truth = _gather_logprobs(whole, batch).detach()
    counted = shifted_labels(batch["labels"]) != -100
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        one = _gather_logprobs(copy.deepcopy(whole).to(dtype), batch).detach()
        one_error = (one - truth)[counted].abs().max().item()
        booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig.of(tp_size=2, precision=precision)))
        model, *_ = booster.boost(build_model("LlamaForCausalLM", copy.deepcopy(config)))
        assert next(model.unwrap().parameters()).dtype == dtype, precision
        for mode in ("train", "eval"):
            getattr(model, mode)()
            got = token_logprobs(model, batch, entropy=True)
            assert got.logprobs.dtype == torch.float32 and got.entropy.dtype == torch.float32, (precision, mode)
            error = (got.logprobs.detach() - truth)[counted].abs().max().item()
            assert 0 < one_error < 0.1, (precision, one_error)          # the half precision shows, and is small
            assert error <= 3 * one_error + 1e-3, f"{precision} {mode}: tp=2 off by {error}, one process {one_error}"
            assert (got.logprobs.detach()[~counted] == 0).all(), (precision, mode)


def _step_metrics(objective, model, ref, optimizer, booster, batch) -> dict:
    """One boosted step of this replica's pairs, through the loss functions (not `preference_step`)."""
    with torch.no_grad():
        reference = sequence_logprobs(ref, batch) if ref is not None else None
    out = preference_loss(objective, sequence_logprobs(model, batch), reference, group=dp_group_of(model),
                          **HYPER[objective])
    booster.backward(out.loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return out.metrics


def _boosted(objective, config, pairs, plugin_config) -> list[dict]:
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
    ref = None
    if objective in ("dpo", "ipo"):
        ref = boost_reference(booster, copy.deepcopy(policy))
        assert not ref.training and not any(p.requires_grad for p in ref.parameters())
        assert "DistributedDataParallel" not in type(ref.module).__name__
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    model.train()
    mesh = model.mesh
    return [_step_metrics(objective, model, ref, optimizer, booster,
                          pair_batch(replica(p, mesh.dp_rank, mesh.dp_size))) for p in pairs]


def _check_paired(rank):
    check_layouts(preference_config(), [random_pairs(10 + s) for s in range(STEPS)], LAYOUTS, _boosted)


def _kto_batches(seed: int) -> tuple[dict, dict, torch.Tensor]:
    ids, labels, mask = random_rows(2 * PAIRS, seed)
    kl_ids, kl_labels, kl_mask = random_rows(2 * PAIRS, seed + 7)       # mismatched prompt/completion rows
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return batch, {"input_ids": kl_ids, "labels": kl_labels, "attention_mask": kl_mask}, torch.arange(2 * PAIRS) % 3 != 0


def _kto_step(model, ref, optimizer, booster, batch, kl_batch, desirable) -> dict:
    with torch.no_grad():
        reference, kl_reference = sequence_logprobs(ref, batch), sequence_logprobs(ref, kl_batch)
        kl_policy = sequence_logprobs(model, kl_batch)
    out = kto_loss(sequence_logprobs(model, batch), reference, desirable, kl_policy, kl_reference,
                   group=dp_group_of(model) if booster is not None else None, beta=0.5, undesirable_weight=1.5)
    booster.backward(out.loss, optimizer) if booster is not None else out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.metrics


def _check_kto(rank):
    config = preference_config()
    steps = [_kto_batches(40 + s) for s in range(STEPS)]
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    ref = sharper_copy(model).eval().requires_grad_(False)       # the KL estimate positive, replica by replica
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    want = [_kto_step(model, ref, optimizer, None, *s) for s in steps]
    assert min(w["kl"] for w in want) > 1e-3, want
    for what in ("tp2 dp2", "cp2 dp2 zero1"):
        booster = Booster(plugin=HybridParallelPlugin(LAYOUTS[what]))
        policy = build_model("LlamaForCausalLM", copy.deepcopy(config))
        ref = boost_reference(booster, sharper_copy(policy))
        model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(policy.parameters(), lr=LR))
        mesh = model.mesh
        got = [_kto_step(model, ref, optimizer, booster, replica(b, mesh.dp_rank, mesh.dp_size),
                         replica(k, mesh.dp_rank, mesh.dp_size), replica({"d": d}, mesh.dp_rank, mesh.dp_size)["d"])
               for b, k, d in steps]
        compare(got, want, f"kto {what}")


def _check_refusals(rank):
    good = random_pairs(5)
    bad = {"a missing rejected field": {k: v for k, v in good.items() if not k.startswith("rejected_input")},
           "an empty response": {**good, "chosen_labels": good["chosen_labels"].masked_fill(torch.ones_like(
               good["chosen_labels"], dtype=torch.bool), -100)},
           "a split pair": {**good, "rejected_input_ids": good["rejected_input_ids"][:3],
                            "rejected_labels": good["rejected_labels"][:3],
                            "rejected_attention_mask": good["rejected_attention_mask"][:3]}}
    for culprit, (what, batch) in enumerate(bad.items()):
        with pytest.raises(PreferenceBatchError) as error:
            pair_batch(batch if rank == culprit else good)
        text = str(error.value)
        assert ("every rank before any collective" in text), (what, text)
        assert (f"rank(s) [{culprit}]" in text) == (rank != culprit), (what, text)
    pair_batch(good)             # every rank fine: nothing raised, and the ranks are still in step


def _body(rank, world_size):
    _check_refusals(rank)
    _check_token_logprobs(rank)
    _check_half_precision_logprobs(rank)
    _check_paired(rank)
    _check_kto(rank)


def test_post_training_layouts():
    spawn(_body, 4)
