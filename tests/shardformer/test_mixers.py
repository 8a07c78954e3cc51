"""Recurrent mixers split by heads (shardformer/mixers.py): Qwen3-Next's Gated DeltaNet and Bamba's Mamba2
mixer against the unsharded model from the same weights and data, fp32, at world 4 in one process group:
  * tp=2 (ShardFormer, each pair of ranks its own tp group): the mixer really split (A_log, conv channels,
    per-rank head counts), eval logits, loss, every gathered gradient, every weight after AdamW;
  * tp=2 x dp=2 with ZeRO-1 (HybridParallelPlugin): each dp replica its own batch, the reference on both;
    the losses and every gathered weight after two AdamW steps;
  * refusals before anything changes or communicates (the bad-input rows of these models): key heads / groups
    tp does not divide (also through HybridParallelPlugin with ep=2 x tp=2), and context parallelism.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from meshboost.testing import spawn

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=160,
              intermediate_size=64, use_cache=False, tie_word_embeddings=False)
QWEN3_NEXT = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                  mlp_only_layers=[], layer_types=["linear_attention", "full_attention"])
BAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_proj_bias=True, attn_layer_indices=[1])
CASES = [("qwen3_next", QWEN3_NEXT, "linear_attn"), ("bamba", BAMBA, "mamba")]


def _model(model_type: str, seed: int = 0, **overrides):
    import transformers as tfm
    cls = {"qwen3_next": tfm.Qwen3NextConfig, "bamba": tfm.BambaConfig}[model_type]
    base = dict(CASES[[c[0] for c in CASES].index(model_type)][1])
    config = cls(**{**COMMON, **base, **overrides})
    torch.manual_seed(seed)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _batch(seed: int, pad: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 160, (2, 8), generator=g)
    mask, labels = torch.ones_like(ids), ids.clone()
    if pad:
        mask[1, :2] = 0                                # left padding on one row
        labels[1, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _tp_pair(model_type: str, mixer: str, tp_group) -> None:
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.testing.compare import gathered
    from meshboost.testing.tolerance import LOSS_ATOL, assert_close

    ref, par = _model(model_type), _model(model_type)
    batch = _batch(1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-3, eps=1e-4)
    ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group)).optimize(par)
    mixers = [(layer, getattr(ref.model.layers[i], mixer)) for i, layer in enumerate(par.model.layers)
              if hasattr(layer, mixer)]
    assert mixers, model_type
    for layer, whole in mixers:       # split by heads, not gathered back: the recurrence runs on half the heads
        m = getattr(layer, mixer)
        assert m.A_log.shape[0] * 2 == whole.A_log.shape[0], model_type
        assert m.conv1d.groups * 2 == whole.conv1d.groups == whole.conv1d.weight.shape[0], model_type
        heads = ("num_k_heads", "num_v_heads") if model_type == "qwen3_next" else ("num_heads", "n_groups")
        assert all(getattr(m, h) * 2 == getattr(whole, h) for h in heads), model_type
    ref.eval(), par.eval()
    with torch.no_grad():
        assert_close(par(**batch).logits, ref(**batch).logits, msg=f"{model_type} eval logits")
    ref.train(), par.train()
    ref_loss, par_loss = ref(**batch).loss, par(**batch).loss
    ref_loss.backward(), par_loss.backward()
    assert abs(ref_loss.item() - par_loss.item()) <= LOSS_ATOL[torch.float32], (model_type, par_loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        r = ref_params[name]
        assert (r.grad is None) == (p.grad is None), f"{model_type}: grad presence {name}"
        if r.grad is not None:
            assert_close(gathered(p, p.grad), r.grad, msg=f"{model_type} grad {name}")
    ref_opt.step(), par_opt.step()
    for name, p in par.named_parameters():
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{model_type} weight after AdamW {name}")


def _zero1(model_type: str, dp_rank: int) -> None:
    from meshboost import Booster
    from meshboost.plugins import HybridParallelPlugin
    from meshboost.testing.compare import booster_step, gathered
    from meshboost.testing.tolerance import LOSS_ATOL, assert_close

    steps = [[_batch(10 + 2 * s, pad=False), _batch(11 + 2 * s, pad=False)] for s in range(2)]
    ref = _model(model_type)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    ref_losses = []
    for pair in steps:            # the global batch: both replicas' rows, one mean over its tokens
        loss = ref(**{k: torch.cat([b[k] for b in pair]) for k in pair[0]}).loss
        loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        ref_losses.append(loss.item())
    model = _model(model_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, zero_stage=1, precision="fp32"))
    model, optimizer, *_ = booster.boost(model, optimizer)
    losses = []
    for pair in steps:
        loss = booster_step(booster, model, optimizer, pair[dp_rank]).detach()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())     # each tp pair holds its replica's loss
    assert all(abs(a - b) <= LOSS_ATOL[torch.float32] for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    for name, p in model.unwrap().named_parameters():
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{model_type} ZeRO-1 weight after 2 steps {name}")


def _refusals(tp_group) -> None:
    from meshboost import Booster
    from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
    from meshboost.shardformer import ShardConfig, ShardFormer

    bad = [("qwen3_next", {"linear_num_key_heads": 3, "linear_num_value_heads": 3}, r"linear_num_key_heads=3 is not "
            r"divisible by tp_size=2.*tp_size that divides 3"),
           ("bamba", {"mamba_n_groups": 1}, r"mamba_n_groups=1 is not divisible by tp_size=2.*tp_size that divides 1")]
    for model_type, overrides, message in bad:
        model = _model(model_type, **overrides)
        before = {n: tuple(p.shape) for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=message):
            ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group)).optimize(model)
        assert before == {n: tuple(p.shape) for n, p in model.named_parameters()}, f"{model_type} modified"
    # ep=2 x tp=2: the experts split over ep, the linear attention over tp, refused alike on every rank
    model = _model("qwen3_next", **bad[0][1])
    with pytest.raises(ValueError, match=bad[0][2]):
        Booster(plugin=HybridParallelPlugin(tp_size=2, ep_size=2, precision="fp32")).boost(model)
    # context parallelism: each rank would start its chunk of the sequence from a zero state
    with pytest.raises(NotImplementedError, match=r"recurrent mixers .* does not pass that state"):
        Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2, cp_size=2))).boost(_model("qwen3_next"))


def _body(rank, world):
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group = pairs[rank // 2]
    for model_type, _, mixer in CASES:
        _tp_pair(model_type, mixer, tp_group)
    for model_type, _, _ in CASES:
        _zero1(model_type, dist.get_rank(dist.group.WORLD) // 2)
    _refusals(tp_group)


def test_mixers_split_by_heads_match_unsharded():
    spawn(_body, 4)


def test_mixer_kinds_and_context_refusal():
    """Without processes: which mixers the policy splits (Falcon-H1's muP-scaled mixer stays whole) and that
    context parallelism still refuses every recurrent mixer, split or not."""
    from meshboost.shardformer import get_policy
    from meshboost.shardformer.mixers import GATED_DELTANET, MAMBA2
    from meshboost.shardformer.recurrent import refuse_context

    qwen, bamba = _model("qwen3_next"), _model("bamba")
    plan = get_policy(qwen).plan
    assert plan["layers.*.linear_attn"] == GATED_DELTANET
    assert not any(k.startswith("layers.*.linear_attn.") for k in plan)      # no gathered projections left
    assert get_policy(bamba).plan["layers.*.mamba"] == MAMBA2
    # Nemotron-H's `layers.*.mixer` is a Mamba2 mixer in some layers, an attention or an MoE in others: the
    # Mamba2 mixers by their own paths, the other layers' entries kept
    from meshboost.testing.sweep import build
    _, nemotron = build("nemotron_h")
    plan = get_policy(nemotron).plan
    mamba = [n for n, m in nemotron.model.named_modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    assert mamba and all(plan[n.removeprefix("model.")] == MAMBA2 for n in mamba), plan
    assert plan.get("layers.*.mixer") != MAMBA2 and plan["layers.*.mixer.q_proj"] == "colwise", plan
    for model in (qwen, bamba):
        with pytest.raises(NotImplementedError, match="cp_size=2 \\(ColossalAI's sp_size\\)"):
            refuse_context(model, 2)
