"""Preference losses as pure functions of per-sequence log-prob sums (and token counts): no model, no
collective, no layout. Each returns the per-example losses and the implicit rewards (detached), one row per
pair (paired objectives) or per example (KTO); `objectives.py` averages them over the global batch.

Inputs: `policy_*` / `ref_*` are sums over the labelled response tokens (`SequenceLogprobs.sums`),
`*_counts` their token counts. Formulas, with r = policy - ref, sigma the logistic, ls the label smoothing:
- DPO (sigmoid, cDPO label smoothing): z = beta (r_chosen - r_rejected);
  loss = -(1 - ls) log sigma(z) - ls log sigma(-z); rewards beta r.
- IPO: the length-averaged log-ratio margin h = r_chosen / n_chosen - r_rejected / n_rejected (as TRL,
  confirmed by the IPO authors); loss = (h - 1 / (2 beta))^2; rewards beta r.
- SimPO (no reference): z = beta (mean log-prob chosen - mean log-prob rejected) - gamma;
  loss = -(1 - ls) log sigma(z) - ls log sigma(-z); rewards beta x mean log-prob.
- ORPO (no reference): the odds ratio of the mean log-probs m, log odds(m) = m - log(1 - e^m);
  loss = -beta log sigma(log odds(m_chosen) - log odds(m_rejected)); the SFT term (the chosen tokens'
  negative log-likelihood, a token mean over the global batch) is added by `objectives.py`.
- KTO: per example with KL the (detached, clamped at 0) estimate over the global batch:
  desirable: w_d (1 - sigma(beta (r - KL))), undesirable: w_u (1 - sigma(beta (KL - r))); rewards beta r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairTerms:
    """One row per pair: the loss to average, and the implicit rewards (detached) logged with it."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _smoothed_sigmoid(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing}: the probability that a pair's preference is flipped "
                         "lies in [0, 0.5)")
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta={beta}: the preference temperature must be positive")


def dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float = 0.1,
        label_smoothing: float = 0.0) -> PairTerms:
    """DPO's sigmoid loss (with cDPO label smoothing) per pair."""
    _check_beta(beta)
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    losses = _smoothed_sigmoid(beta * (chosen - rejected), label_smoothing)
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach())


def ipo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_counts, rejected_counts,
        beta: float = 0.1) -> PairTerms:
    """IPO's squared loss on the length-averaged log-ratio margin, per pair."""
    _check_beta(beta)
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    margin = chosen / chosen_counts.clamp(min=1.0) - rejected / rejected_counts.clamp(min=1.0)
    return PairTerms((margin - 1.0 / (2.0 * beta)) ** 2, beta * chosen.detach(), beta * rejected.detach())


def simpo(policy_chosen, policy_rejected, chosen_counts, rejected_counts, beta: float = 2.0, gamma: float = 0.5,
          label_smoothing: float = 0.0) -> PairTerms:
    """SimPO: the length-normalised log-probs' margin against a target margin `gamma`, no reference."""
    _check_beta(beta)
    chosen = beta * policy_chosen / chosen_counts.clamp(min=1.0)
    rejected = beta * policy_rejected / rejected_counts.clamp(min=1.0)
    return PairTerms(_smoothed_sigmoid(chosen - rejected - gamma, label_smoothing), chosen.detach(), rejected.detach())


def _log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean log-prob) < 1; -expm1 keeps 1 - p exact near p = 1."""
    return mean_logprob - torch.log(-torch.expm1(mean_logprob))


def orpo(policy_chosen, policy_rejected, chosen_counts, rejected_counts, beta: float = 0.1) -> PairTerms:
    """ORPO's odds-ratio term per pair (the SFT term is the caller's: a token mean over the global batch)."""
    _check_beta(beta)
    chosen = policy_chosen / chosen_counts.clamp(min=1.0)
    rejected = policy_rejected / rejected_counts.clamp(min=1.0)
    losses = -beta * F.logsigmoid(_log_odds(chosen) - _log_odds(rejected))
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach())


def kto(policy, ref, desirable: torch.Tensor, kl: torch.Tensor, beta: float = 0.1, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO per example: (losses, rewards); `desirable` bool per example, `kl` the global batch's estimate."""
    _check_beta(beta)
    ratio = policy - ref
    kl = kl.detach().clamp(min=0.0)
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable.bool(), good, bad), beta * ratio.detach()
