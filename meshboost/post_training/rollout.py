"""Rollouts from the boosted policy itself (no separate inference engine): the small-scale and test path of RL.

Owns: `generate_rollouts` (transformers' own `generate`, KV cache on, on the boosted HF model: each prompt's
`num_generations` completions as consecutive rows, so a group never straddles a replica) and `RolloutBatch` (the
rows the log-prob path takes: prompt then completion, right-padded, with the mask of the completion tokens).
The large-scale path is `booster.export_weights` into an engine. Must not fork a forward or reach into a plugin.

What runs, layout by layout:
- tp: every tp rank runs `generate` on the same prompts (checked, like every boosted forward) with the same seed;
  the head gathers the vocabulary in eval (the last position's logits only), so every rank samples the same
  token from bitwise equal logits: the tp ranks' sequences are equal.
- ZeRO-3 (FSDP2): FSDP2's own forward hooks gather one unit (a transformer layer) at a time and free it after,
  at every decoding step; the root unit (embeddings, final norm, head) stays gathered during a forward. Peak
  extra memory: the root unit plus one layer (plus `forward_prefetch` more), in the compute dtype, not the whole
  model (with reshard_after_forward=False every unit stays gathered: the whole model); the cost is one
  all-gather of the weights per generated token. The weights are pointed back at their shards after. (From
  FSDP2's semantics; not measured here.)
- dp: one seed per data-parallel replica (`replica_seed(seed, dp_rank)`), so replicas draw different samples.
  With more than one process, `synced_gpus=True`: a replica whose sequences all ended keeps stepping until every
  rank has, so collectives inside the forward (FSDP2's gathers, ep's token exchange) stay in step; ep (experts
  over ep ranks carved from dp) runs that way.
- refused by name: pp (the stages hold different layers; generate on an exported copy: `booster.export_weights`
  into a plain model, `checkpoint.export.load_into`), cp and Megatron sequence parallelism (one decoded token
  cannot be split over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from meshboost.booster.wrappers import ModelWrapper
from meshboost.plugins.hybrid_parallel import HybridParallelModule
from meshboost.post_training.batch import agree
from meshboost.post_training.logprobs import IGNORE_INDEX, hf_model


@dataclass(frozen=True)
class RolloutBatch:
    """One replica's rollouts: row g + G*p is prompt p's completion g (G = group_size)."""

    input_ids: torch.Tensor          # [N, S] the prompt's tokens, then the completion's, then padding
    attention_mask: torch.Tensor     # [N, S] 1 on prompt and completion tokens, 0 on padding
    response_mask: torch.Tensor      # [N, S] bool: completion tokens (through the first end-of-sequence token)
    group_size: int                  # G completions per prompt, consecutive rows

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def labels(self) -> torch.Tensor:
        """The input ids on completion tokens, -100 on prompt and padding (what `token_logprobs` scores)."""
        return self.input_ids.masked_fill(~self.response_mask, IGNORE_INDEX)

    def model_batch(self) -> dict:
        """The batch `token_logprobs` takes: input_ids, attention_mask, labels."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels()}

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    def completions(self) -> list[list[int]]:
        """Each row's completion token ids (what a reward function reads)."""
        return [row[m].tolist() for row, m in zip(self.input_ids, self.response_mask)]

    def select(self, rows: slice) -> RolloutBatch:
        """A slice of whole groups (a replica's share of a global batch)."""
        return RolloutBatch(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows], self.group_size)


def replica_seed(seed: int, replica: int) -> int:
    """The sampling seed of data-parallel replica `replica`: equal on its tp ranks, distinct across replicas
    and across seeds (numpy's SeedSequence mixes the pair; seed + replica would repeat between calls)."""
    return int(np.random.SeedSequence([int(seed), int(replica)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def replica_index(model) -> int:
    """This rank's data-parallel replica: the mesh's dp rank, every rank for DDP-style wrappers."""
    if isinstance(model, HybridParallelModule):
        return model.mesh.dp_rank
    if isinstance(model, ModelWrapper) and dist.is_initialized():
        return dist.get_rank()
    return 0


def _refuse_layout(model) -> None:
    """Layouts `generate` cannot run on (read from the layout only: alike on every rank, before any collective)."""
    if not isinstance(model, HybridParallelModule):
        return
    mesh = model.mesh
    if mesh.pp_size > 1:
        raise NotImplementedError(
            f"generate_rollouts with pp_size={mesh.pp_size}: each stage holds only its layers, and transformers' "
            "generate runs the whole model per token. Generate on an exported copy: booster.export_weights(model) "
            "into a plain transformers model (meshboost.checkpoint.export.load_into) or an inference engine")
    if mesh.cp_size > 1:
        raise NotImplementedError(
            f"generate_rollouts with cp_size={mesh.cp_size}: a decoded token cannot be split over the context-"
            "parallel ranks. Boost the rollout policy without cp, or generate on an exported copy "
            "(booster.export_weights)")
    if getattr(model.shard_config, "enable_sequence_parallelism", False):
        raise NotImplementedError(
            "generate_rollouts with Megatron sequence parallelism: one decoded token cannot be split over the tp "
            "ranks. Boost the rollout policy with sequence_parallel=False, or generate on an exported copy")


def _prompt_problem(prompts) -> str | None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return ("prompts: a non-empty list of token-id lists (one per prompt); every replica needs at least one "
                "prompt, since its ranks step with the others (FSDP2's gathers, ep's token exchange)")
    if any(not isinstance(p, (list, tuple, torch.Tensor)) or len(p) == 0 for p in prompts):
        return "prompts: every prompt is a non-empty list of token ids"
    return None


def _left_padded(prompts, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _response_mask(completion: torch.Tensor, eos_token_id) -> torch.Tensor:
    """True on each completion's tokens through its first end-of-sequence token (all of them without one)."""
    if eos_token_id is None:
        return torch.ones_like(completion, dtype=torch.bool)
    eos = torch.isin(completion, torch.as_tensor(eos_token_id, device=completion.device).flatten())
    before = eos.int().cumsum(dim=1) - eos.int()             # end tokens strictly before this position
    return before == 0


def _right_padded(prompt_ids, prompt_mask, completion, response, pad_token_id: int, group_size: int) -> RolloutBatch:
    """Each row as prompt tokens then its completion from position 0 (the positions generate used), padded right."""
    rows = []
    for ids, mask, out, keep in zip(prompt_ids, prompt_mask, completion, response):
        rows.append((ids[mask.bool()], out[keep]))
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=completion.device)
    attention = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        input_ids[i, :len(p) + len(c)] = torch.cat([p, c])
        attention[i, :len(p) + len(c)] = 1
        response_mask[i, len(p):len(p) + len(c)] = True
    return RolloutBatch(input_ids, attention, response_mask, group_size)


def generate_rollouts(model, prompts, num_generations: int, max_new_tokens: int, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, seed: int = 0, do_sample: bool = True,
                      pad_token_id: int | None = None, eos_token_id=None) -> RolloutBatch:
    """`num_generations` completions of each of this replica's `prompts` (lists of token ids) from boosted `model`
    (or a plain HF model), by transformers' `generate` with the KV cache, in eval mode (the mode is restored).
    Sampling (temperature, top_p, top_k=0: off) draws from a generator seeded with `replica_seed(seed, replica)`;
    the global RNG is left as it was. do_sample=False: greedy. Call on every rank of the model."""
    if not isinstance(num_generations, int) or num_generations < 1 or max_new_tokens < 1:
        raise ValueError(f"num_generations={num_generations}, max_new_tokens={max_new_tokens}: both at least 1")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature={temperature}: positive when sampling (do_sample=False for greedy)")
    _refuse_layout(model)
    from transformers import GenerationConfig

    inner = model.unwrap() if isinstance(model, ModelWrapper) else model
    hf = hf_model(inner)
    config = hf.config
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id if config.pad_token_id is not None else 0)
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    device = next(hf.parameters()).device
    agree(_prompt_problem(prompts), None, device, ValueError, "prompts")      # every rank raises, none waits
    ids, mask = _left_padded(prompts, pad, device)
    ids, mask = ids.repeat_interleave(num_generations, 0), mask.repeat_interleave(num_generations, 0)
    if isinstance(model, HybridParallelModule):
        model.check_same_inputs((ids,), {}, immediate=True)     # tp (and pp) ranks must hold the same prompts
    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, use_cache=True,
                                  pad_token_id=pad, eos_token_id=eos,
                                  **(dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else {}))
    synced = dist.is_initialized() and dist.get_world_size() > 1
    was_training = hf.training
    devices = [device] if device.type == "cuda" else []
    try:
        hf.eval()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(replica_seed(seed, replica_index(model)))
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=generation, synced_gpus=synced)
    finally:
        hf.train(was_training)
        if isinstance(model, ModelWrapper):
            model.unwrap()                       # FSDP2: the weights back at their shards
    completion = out[:, ids.shape[1]:]
    return _right_padded(ids, mask, completion, _response_mask(completion, eos), pad, num_generations)
