"""Post-training on a boosted model: label log-probs from vocab-parallel logits (never the vocabulary whole),
a frozen reference on the same mesh, and the preference objectives (DPO, IPO, SimPO, ORPO, KTO) over the
global batch, rollouts from the policy and the GRPO step. A floor above plugins/: it composes a boosted model
through public names only (docs/post_training.md)."""

from meshboost.post_training.batch import PreferenceBatchError, agree, pair_batch
from meshboost.post_training.grpo import grpo_loss, grpo_step, prepare_grpo
from meshboost.post_training.grpo_terms import GRPOBatch, GRPOBatchError, GRPOConfig, GRPOOutput, group_advantages
from meshboost.post_training.logprobs import (SequenceLogprobs, TokenLogprobs, sequence_logprobs, shifted_labels,
                                              token_logprobs)
from meshboost.post_training.objectives import GlobalBatch, PreferenceOutput, dp_group_of, kto_loss, preference_loss
from meshboost.post_training.pipeline import PairScorer, pipeline_sequence_logprobs
from meshboost.post_training.reference import adapters_disabled, boost_reference, check_reference
from meshboost.post_training.rollout import RolloutBatch, generate_rollouts, replica_seed
from meshboost.post_training.step import BASE, kto_step, preference_step

__all__ = ["token_logprobs", "sequence_logprobs", "shifted_labels", "TokenLogprobs", "SequenceLogprobs", "pair_batch",
           "agree", "PreferenceBatchError", "preference_loss", "kto_loss", "GlobalBatch", "PreferenceOutput",
           "dp_group_of", "boost_reference", "adapters_disabled", "check_reference", "PairScorer",
           "pipeline_sequence_logprobs", "preference_step", "kto_step", "BASE",
           "RolloutBatch", "generate_rollouts", "replica_seed", "GRPOConfig", "GRPOBatch", "GRPOBatchError",
           "GRPOOutput", "group_advantages", "prepare_grpo", "grpo_loss", "grpo_step"]
