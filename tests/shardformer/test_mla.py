"""DeepSeek-V2/V3 multi-head latent attention sharded by heads (policies/deepseek.py) at tp=2 against
the unsharded model from the same weights and batch (fp32): eval logits, loss, every gathered
gradient (the replicated q_a/kv_a projections and a-layernorms included, whose gradients each rank
only has its heads' share of) and every weight after an AdamW step. Dense-only configs (every layer
below first_k_dense_replace); q_lora_rank 32 and None, with and without attention biases, and with
sequence parallelism. Plus the refusal of a head count tp does not divide, before anything changes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from meshboost.testing import spawn

DENSE = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=2, num_hidden_layers=2, n_group=1, topk_group=1,
             q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             rope_scaling=None, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=160,
             attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)
CASES = [  # (model type, config overrides, ShardConfig options)
    ("deepseek_v3", {}, {}),
    ("deepseek_v3", {"q_lora_rank": None}, {}),
    ("deepseek_v3", {"attention_bias": True}, {}),
    ("deepseek_v3", {}, {"enable_sequence_parallelism": True}),
    ("deepseek_v3", {"q_lora_rank": None}, {"enable_sequence_parallelism": True}),
    ("deepseek_v2", {}, {}),
    ("deepseek_v2", {"q_lora_rank": None, "attention_bias": True}, {}),
    ("deepseek_v2", {}, {"enable_sequence_parallelism": True}),
]
HEAD_SPLIT = ("q_proj", "q_b_proj", "kv_b_proj")
REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def _config(model_type: str, **overrides):
    import transformers as tfm
    cls = {"deepseek_v3": tfm.DeepseekV3Config, "deepseek_v2": tfm.DeepseekV2Config}[model_type]
    return cls(**{**DENSE, **overrides})


def _build(config, seed: int = 0):
    import transformers as tfm
    torch.manual_seed(seed)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _batch(config) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                                  # left padding on one row
    labels = ids.clone()
    labels[1, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _compare(model_type: str, overrides: dict, options: dict, group) -> None:
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear
    from meshboost.testing.compare import gathered
    from meshboost.testing.tolerance import LOSS_ATOL, assert_close

    where = f"{model_type} {overrides} {options}"
    config = _config(model_type, **overrides)
    ref, par = _build(config), _build(config)
    batch = _batch(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-3, eps=1e-4)
    ShardFormer(ShardConfig(tensor_parallel_process_group=group, **options)).optimize(par)

    # attention really is split by heads (not left replicated), per rank, config untouched
    heads, tp = config.num_attention_heads, dist.get_world_size(group)
    for layer in par.model.layers:
        attn = layer.self_attn
        for name in HEAD_SPLIT:
            proj = getattr(attn, name)
            if proj is not None:
                assert isinstance(proj, ColumnParallelLinear), f"{where}: {name} is {type(proj).__name__}"
                assert proj.weight.shape[0] * tp == getattr(ref.model.layers[0].self_attn, name).weight.shape[0]
        assert isinstance(attn.o_proj, RowParallelLinear), f"{where}: o_proj is {type(attn.o_proj).__name__}"
        for name in REPLICATED:
            mod = getattr(attn, name)
            assert mod is None or type(mod) is type(getattr(ref.model.layers[0].self_attn, name)), where
        assert attn.num_heads == heads // tp, f"{where}: num_heads {attn.num_heads}"
    assert par.config.num_attention_heads == heads

    ref.eval(), par.eval()
    with torch.no_grad():
        ref_logits, par_logits = ref(**batch).logits, par(**batch).logits
    assert par_logits.shape == ref_logits.shape, f"{where}: logits {par_logits.shape} vs {ref_logits.shape}"
    assert_close(par_logits, ref_logits, msg=f"{where} eval logits")
    ref.train(), par.train()
    ref_loss, par_loss = ref(**batch).loss, par(**batch).loss
    ref_loss.backward()
    par_loss.backward()
    assert abs(ref_loss.item() - par_loss.item()) <= LOSS_ATOL[torch.float32], \
        f"{where}: loss {par_loss.item()} vs {ref_loss.item()}"
    ref_params, par_params = dict(ref.named_parameters()), dict(par.named_parameters())
    assert ref_params.keys() == par_params.keys(), where
    checked = 0
    for name, p in par_params.items():
        r = ref_params[name]
        assert (r.grad is None) == (p.grad is None), f"{where}: grad presence {name}"
        if r.grad is not None:
            assert r.grad.abs().sum() > 0 or "bias" in name, f"{where}: {name} has a zero gradient"
            assert_close(gathered(p, p.grad), r.grad, msg=f"{where} grad {name}")
            checked += 1
    assert checked == len(ref_params), where
    replicated = [n for n in par_params if any(f".{m}." in n for m in REPLICATED)]
    assert replicated and (overrides.get("q_lora_rank", 1) is None or any("q_a_proj" in n for n in replicated))
    ref_opt.step()
    par_opt.step()
    for name, p in par_params.items():
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{where} weight after AdamW {name}")


def _refusals(group) -> None:
    from meshboost.shardformer import ShardConfig, ShardFormer, get_policy

    for model_type in ("deepseek_v3", "deepseek_v2"):
        model = _build(_config(model_type, num_attention_heads=3, num_key_value_heads=3, hidden_size=48))
        before = {n: (type(m), tuple(p.shape)) for n, m in model.named_modules() for p in m.parameters(False)}
        with pytest.raises(ValueError, match=r"num_attention_heads=3 is not divisible by tp_size=2.*tp_size that "
                                             r"divides 3"):
            ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)
        after = {n: (type(m), tuple(p.shape)) for n, m in model.named_modules() for p in m.parameters(False)}
        assert before == after, f"{model_type}: the refused model was modified"
        assert get_policy(_build(_config(model_type))).name == model_type
    # a plan leaving a linear in the attention uncovered: the sharder drops the block input, and the
    # shared modules' summed gradients would count tp times: refused instead (at the first shared module,
    # before anything else of the model was replaced)
    from meshboost.shardformer.policies.deepseek import deepseek_policy
    config = _config("deepseek_v3")
    policy = deepseek_policy(config)
    policy = dataclasses.replace(policy, plan={k: v for k, v in policy.plan.items() if not k.endswith("q_a_proj")})
    model = _build(config)
    before = {n: (type(m), tuple(p.shape)) for n, m in model.named_modules() for p in m.parameters(False)}
    with pytest.raises(ValueError, match=r"q_a_layernorm: a module shared by all heads .* needs .* to be a block "
                                         r"input"):
        ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model, policy)
    after = {n: (type(m), tuple(p.shape)) for n, m in model.named_modules() for p in m.parameters(False)}
    assert before == after, "the refused model was modified"


def _body(rank, world):
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    group = dist.group.WORLD
    for model_type, overrides, options in CASES:
        _compare(model_type, overrides, options, group)
    _refusals(group)


def test_mla_sharded_by_heads_matches_unsharded():
    spawn(_body, 2)


def test_mla_policy_table():
    """Without processes: the table a dense DeepSeek config gets (attention by heads, the dense MLP
    from transformers' plan), whatever transformers' plan says of the attention."""
    from meshboost.shardformer.policies.deepseek import deepseek_policy

    for model_type in ("deepseek_v3", "deepseek_v2"):
        config = _config(model_type)
        plan = deepseek_policy(config).plan
        assert plan["layers.*.self_attn"] == "block_input"
        assert plan["layers.*.self_attn.q_b_proj"] == plan["layers.*.self_attn.kv_b_proj"] == "colwise"
        assert plan["layers.*.self_attn.o_proj"] == "rowwise"
        assert all(plan[f"layers.*.self_attn.{m}"] == "replicated_in_block_input" for m in REPLICATED)
        assert plan["layers.*.mlp.gate_proj"] == "colwise" and plan["layers.*.mlp.down_proj"] == "rowwise"
        assert not any(k.startswith("layers.*.mlp.experts") for k in plan)     # no MoE layer in this config
        assert type(config).base_model_tp_plan is not None and "base_model_tp_plan" not in vars(config)
    # transformers' own attention entries (none up to 5.24; MLA styles such as mla_kv_a_proj from 5.25,
    # which the generic reader refuses) never reach the table: its attention entries are this policy's
    from meshboost.shardformer.policies.deepseek import ATTENTION, ATTENTION_PLAN
    own = deepseek_policy(_config("deepseek_v3")).plan
    assert {k: v for k, v in own.items() if k.startswith(ATTENTION)} == ATTENTION_PLAN
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        deepseek_policy(_config("deepseek_v3")).check(_config("deepseek_v3", num_attention_heads=6), 4)

