"""What the preference tests share (test_preference, test_preference_pipeline, test_zero3_lora): the tiny Llama,
the pairs and their rows, a replica's share of them, one process's SGD steps over them (the reference every
layout's metrics must equal), a boosted run through `preference_step`, and the comparison of the two.
Not a test module: it lives beside them because `meshboost.testing` sits on post_training's floor and may not
import it."""

from __future__ import annotations

import copy

import torch

from meshboost.post_training import pair_batch, preference_loss, preference_step, sequence_logprobs
from meshboost.testing.compare import assert_metric_steps_close
from meshboost.testing.models import VOCAB, build_model, tiny_config

PAIRS, SEQ, LR, STEPS, RTOL = 4, 8, 2.0, 2, 2e-5
HYPER = {"dpo": dict(beta=0.5, label_smoothing=0.1), "ipo": dict(beta=0.5), "simpo": dict(beta=2.0, gamma=0.3),
         "orpo": dict(beta=0.5)}
REFERENCED = ("dpo", "ipo")         # the objectives scored against a frozen reference model


def preference_config():
    """The tiny Llama of the preference tests: 2 key/value heads, no cache."""
    config = tiny_config("llama", num_key_value_heads=2)
    config.use_cache = False
    return config


def random_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows of SEQ tokens: a prompt of 2-3 tokens (-100), a response, right padding (-100, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    labels, mask = ids.clone(), torch.ones_like(ids)
    for i in range(n):
        prompt, length = 2 + i % 2, SEQ - (i % 3)
        labels[i, :prompt] = -100
        labels[i, length:], mask[i, length:], ids[i, length:] = -100, 0, 0
    return ids, labels, mask


def random_pairs(seed: int) -> dict:
    """PAIRS pairs: chosen rows from `seed`, rejected rows from `seed + 100` (`random_rows`)."""
    out = {}
    for side, offset in (("chosen", 0), ("rejected", 100)):
        ids, labels, mask = random_rows(PAIRS, seed + offset)
        out |= {f"{side}_input_ids": ids, f"{side}_labels": labels, f"{side}_attention_mask": mask}
    return out


def replica(batch: dict, rank: int, size: int) -> dict:
    """Replica `rank`'s consecutive share of every row of `batch`, over `size` replicas."""
    n = next(iter(batch.values())).shape[0] // size
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def one_process(objective: str, model, ref, steps: list[dict]) -> list[dict]:
    """One process: an SGD step of `model`'s trainable weights per pair set in `steps`, `ref` (None: no reference)
    scoring without gradients; each step's metrics."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    out = []
    for p in steps:
        batch = pair_batch(p)
        reference = None
        if ref is not None:
            with torch.no_grad():
                reference = sequence_logprobs(ref, batch)
        step = preference_loss(objective, sequence_logprobs(model, batch), reference, **HYPER[objective])
        step.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(step.metrics)
    return out


def one_process_llama(objective: str, config, steps: list[dict]) -> list[dict]:
    """`one_process` of a fresh Llama, a frozen copy of it as the reference where `objective` has one."""
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    ref = copy.deepcopy(model).eval().requires_grad_(False) if objective in REFERENCED else None
    return one_process(objective, model, ref, steps)


def preference_steps(booster, model, optimizer, steps: list[dict], objective: str, ref) -> list[dict]:
    """The boosted run: per pair set this replica's share through `preference_step`, then the optimizer's step;
    each step's metrics."""
    model.train()
    mesh, out = model.mesh, []
    for p in steps:
        out.append(preference_step(booster, model, optimizer, replica(p, mesh.dp_rank, mesh.dp_size), objective,
                                   reference=ref, **HYPER[objective]).metrics)
        optimizer.step()
        optimizer.zero_grad()
    return out


def check_layouts(config, steps: list[dict], layouts: dict, boosted) -> None:
    """Every objective of HYPER at every layout of `layouts` (name -> plugin config): `boosted(objective, config,
    steps, plugin_config)`'s metrics against one process's."""
    for objective in HYPER:
        want = one_process_llama(objective, config, steps)
        for what, plugin_config in layouts.items():
            compare(boosted(objective, config, steps, plugin_config), want, f"{objective} {what}")


def compare(got: list[dict], want: list[dict], what: str) -> None:
    assert_metric_steps_close(got, want, what, RTOL)
