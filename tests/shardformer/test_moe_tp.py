"""Mixture-of-experts under tensor parallelism (issue 25, item 1): transformers' packed experts split
on every expert's intermediate dimension, the router replicated, at tp=2 through the Booster against
single-process training from the same weights and batches: per-step losses (router load-balancing
loss included) within 2e-5 relative, every gathered gradient after the first step, every weight after
the AdamW steps, the saved HF folder reloaded by `from_pretrained`; each rank holds half of every
expert tensor (the experts are split, not replicated); sequence parallelism with them and a token
routed outside the experts are refused on every rank. One process group, the families looped inside."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ShardConfig
from meshboost.testing import assert_close, spawn

# eps=1e-4: Adam turns a near-zero gradient (an embedding row no token used) into a +-lr step whose sign
# round-off decides; the comparison is about the sharding, not that sign (as the other plugin tests)
STEPS, LR, EPS = 3, 1e-3, 1e-4
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=160,
              max_position_embeddings=64, intermediate_size=128, use_cache=False, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                                     output_router_logits=True),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                  output_router_logits=True),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
    # shared experts and a dense first layer (first_k_dense_replace), sharded as MLPs
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                   n_group=1, topk_group=1),
    # multi-head latent attention split by heads (policies/deepseek.py), shared experts, a dense first layer
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4},
                                                         moe_intermediate_size=32, n_routed_experts=4,
                                                         num_experts_per_tok=2, n_shared_experts=1,
                                                         first_k_dense_replace=1, n_group=1, topk_group=1,
                                                         q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                         qk_nope_head_dim=8, v_head_dim=16, rope_scaling=None),
    # the transposed packed layout ([E, H, 2I] / [E, I, H]) and a shared expert
    "llama4_text": lambda: transformers.Llama4TextConfig(**COMMON, head_dim=16, intermediate_size_mlp=128,
                                                         num_local_experts=4, num_experts_per_tok=1,
                                                         interleave_moe_layer_step=1, attention_chunk_size=8),
}


def _build(config, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _batches(config, n=STEPS, batch=4, seq=8):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
        labels = ids.clone()
        labels[1, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _check_family(name, make_config, rank):
    config = make_config()
    batches = _batches(config)
    ref = _build(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    model = _build(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model, opt, *_ = booster.boost(model, opt)
    inner = model.unwrap()
    experts = [(n, p) for n, p in inner.named_parameters() if ".experts." in n]
    assert experts, name
    for n, p in experts:              # split, not replicated: half of every expert tensor on each rank
        info = get_tp_info(p)
        assert info is not None and p.numel() * 2 == torch.Size(info.full_shape).numel(), f"{name}: {n} is whole"
    ref_params = dict(ref.named_parameters())
    for step, batch in enumerate(batches):
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        loss = model(**batch).loss
        booster.backward(loss, opt)
        assert abs(loss.item() - ref_loss.item()) <= 2e-5 * abs(ref_loss.item()), \
            f"{name} step {step}: loss {loss.item()} vs {ref_loss.item()}"
        if step == 0:
            for n, p in inner.named_parameters():
                assert_close(gather_tensor(p.grad, get_tp_info(p)), ref_params[n].grad, msg=f"{name} grad {n}")
        ref_opt.step(), ref_opt.zero_grad()
        opt.step(), opt.zero_grad()
    for n, p in inner.named_parameters():
        assert_close(gather_tensor(p.detach(), get_tp_info(p)), ref_params[n].detach(), msg=f"{name} weight {n}")
    folder = os.path.join(tempfile.gettempdir(), f"meshboost_moe_tp_{name}_{os.environ.get('MASTER_PORT', '0')}")
    booster.save_model(model, folder, shard=True)
    dist.barrier()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for n, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), ref_params[n].detach().to(p.dtype)) or \
            torch.allclose(p.detach(), ref_params[n].detach(), atol=1e-6), f"{name}: saved {n} differs"


def _route_out_of_range(module, args, output):
    logits, weights, ids = output
    ids = ids.clone()
    ids[0, 0] = module.num_experts                 # one token to expert E (there are E: 0 .. E-1)
    return logits, weights, ids


def _body(rank, world):
    for name, make_config in FAMILIES.items():
        _check_family(name, make_config, rank)
    # a token routed outside the experts is an error on every rank, not a silently dropped route
    model = _build(FAMILIES["qwen3_moe"]())
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(model)
    model.unwrap().model.layers[0].mlp.gate.register_forward_hook(_route_out_of_range)
    with pytest.raises(ValueError, match="routed to expert id 4, outside the 4 experts"):
        model(input_ids=torch.ones(2, 4, dtype=torch.long))
    # sequence parallelism cannot split experts exactly: refused on every rank before any change
    model = _build(FAMILIES["mixtral"]())
    plugin = HybridParallelPlugin(HybridParallelConfig(tp_size=2,
                                                       sharding=ShardConfig(enable_sequence_parallelism=True)))
    with pytest.raises(ValueError, match="sequence parallelism with tensor-parallel MoE experts"):
        Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))
    assert all(get_tp_info(p) is None for p in model.parameters()), "refused after changing the model"


def test_moe_experts_under_tensor_parallelism():
    spawn(_body, 2)
