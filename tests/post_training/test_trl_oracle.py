"""DPO's loss (sigmoid) and IPO's on one process against TRL's own `DPOTrainer._compute_loss` (issue 58, an
outside oracle): TRL runs its loss code on a stand-in trainer whose model returns the per-token log-probs that
`meshboost.post_training.token_logprobs` computed, with the reference log-probs precomputed, so what is
compared is the objective (the formula, the [chosen; rejected] layout, the length normalisation of IPO)."""

import types
from collections import defaultdict

import pytest
import torch

from meshboost.post_training import pair_batch, preference_loss, sequence_logprobs, token_logprobs
from meshboost.testing.models import build_model, tiny_config

trl = pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402

from tests.post_training.pairs import random_pairs  # noqa: E402


def _trl_loss(loss_type: str, beta: float, tokens, ref_sums) -> torch.Tensor:
    """TRL's loss for a [chosen; rejected] batch whose per-token log-probs (aligned with the shifted labels,
    0 where they do not count) are `tokens`."""
    logprobs = tokens.logprobs[:, :-1]               # TRL's shifted positions: the last one scores nothing
    mask = tokens.mask[:, :-1]
    completion = torch.cat([torch.zeros_like(mask[:, :1]), mask], dim=1).long()
    outputs = types.SimpleNamespace(log_probs=logprobs, entropy=torch.zeros_like(logprobs),
                                    mean_logits=torch.zeros_like(logprobs), aux_loss=None,
                                    is_top1=torch.zeros_like(logprobs, dtype=torch.bool))
    n = ref_sums.shape[0] // 2
    inputs = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": ref_sums[:n], "ref_rejected_logps": ref_sums[n:]}
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t, gather=lambda t: t,
                                        unwrap_model=lambda m: m)
    model = types.SimpleNamespace(training=True)
    stub = types.SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
        use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1, args=types.SimpleNamespace(rpo_alpha=None))
    return DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, False)


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_dpo_and_ipo_match_trl(objective):
    config = tiny_config("llama")
    policy, reference = build_model("LlamaForCausalLM", config, seed=0), build_model("LlamaForCausalLM", config, seed=1)
    batch = pair_batch(random_pairs(21))
    tokens = token_logprobs(policy, batch)
    with torch.no_grad():
        ref = sequence_logprobs(reference, batch)
    ours = preference_loss(objective, sequence_logprobs(policy, batch), ref, beta=0.3)
    theirs = _trl_loss("sigmoid" if objective == "dpo" else "ipo", 0.3, tokens, ref.sums)
    assert abs(ours.metrics["loss"]) > 1e-3
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-6, atol=1e-7)
