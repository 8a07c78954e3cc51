"""Every policy at tp=2 and tp=4 against the unsharded model (eval outputs, loss, gathered grads and
weights after an AdamW step): BERT, GPT-2, the generic base_model_tp_plan policy on Llama (incl. GQA
with key/value heads fewer than tp: 2 kv heads at tp=4, multi-query), Qwen2, Mistral, Gemma's
scaled embedding, Cohere's per-head q/k norms ([heads, head_dim], 2 kv heads), ESM-C's whole-hidden ones, and the hand-written tables for OPT, BLOOM (ALiBi), Falcon (grouped, multi-query,
ALiBi), ViT, ALBERT, T5 (tied embedding, relative position bias, gated FFN), Whisper and BLIP-2 (vision tower, Q-Former, OPT); GPT-2,
Llama and BERT's masked LM again on a batch of every vocabulary shard's first and last id (id 0 included); plus the
error cases, raised before any collective and before any weight is sliced."""

import pytest
import torch.distributed as dist
import torch.nn as nn

from meshboost.shardformer import Policy, ShardConfig, ShardFormer
from meshboost.testing import spawn
from meshboost.testing.compare import check_tp_equivalence
from meshboost.testing.models import MODEL_CLASSES, build_model, tiny_config


def _policies_body(rank, world):
    group = dist.group.WORLD
    for family, classes in MODEL_CLASSES.items():
        for cls in classes:
            check_tp_equivalence(cls, family, group)
    # every vocabulary shard's first and last id as input and label (the tiny batches never hold id 0):
    # the embedding, the LM head (tied to it in GPT-2) and the vocab-parallel loss at the shard edges
    for cls, family in (("GPT2LMHeadModel", "gpt2"), ("LlamaForCausalLM", "llama"), ("BertForMaskedLM", "bert")):
        check_tp_equivalence(cls, family, group, vocab_edges=True)


def _custom_policy_body(rank, world):
    """A family with no built-in policy (OPT) shards through custom_policy, with the per-rank
    attribute fix-up its forward needs."""
    import copy

    import transformers as tfm

    from meshboost.testing.compare import model_loss
    from meshboost.testing.tolerance import assert_close

    cfg = tfm.OPTConfig(vocab_size=101, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                        word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    policy = Policy(name="opt", plan={
        "decoder.layers.*.self_attn": "block_input",
        **{f"decoder.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"},
        attributes={"decoder.layers.*.self_attn": {"num_heads": "divide"}})
    ref = build_model("OPTForCausalLM", copy.deepcopy(cfg))
    par = build_model("OPTForCausalLM", copy.deepcopy(cfg))
    ShardFormer(ShardConfig(tensor_parallel_process_group=dist.group.WORLD)).optimize(par, policy)
    batch = {"input_ids": __import__("torch").randint(1, 101, (2, 6))}
    batch["labels"] = batch["input_ids"]
    l_ref, _ = model_loss(ref, batch)
    l_par, _ = model_loss(par, batch)
    assert abs(l_ref.item() - l_par.item()) < 1e-5
    l_ref.backward(), l_par.backward()
    from meshboost.testing.compare import gathered
    for (n, p), (_, r) in zip(par.named_parameters(), ref.named_parameters()):
        assert_close(gathered(p, p.grad), r.grad, msg=f"OPT custom policy grad {n}")


def _errors_body(rank, world):
    group = dist.group.WORLD
    sharder = ShardFormer(ShardConfig(tensor_parallel_process_group=group))
    cases = [
        ("bert", "BertModel", dict(num_attention_heads=6, hidden_size=48), "num_attention_heads=6"),
        ("bert", "BertModel", dict(intermediate_size=66), "intermediate_size=66"),
        ("llama", "LlamaModel", dict(num_attention_heads=12, hidden_size=48, num_key_value_heads=3),
         "3 key/value heads"),                # neither 3 | 4 nor 4 | 3: no rank holds whole heads
        ("gpt2", "GPT2Model", dict(n_head=6, n_embd=48), "num_attention_heads=6"),
        ("bloom", "BloomModel", dict(pretraining_tp=2, slow_but_exact=True), "pretraining_tp=2"),
        ("falcon", "FalconModel", dict(num_attention_heads=12, hidden_size=96, num_kv_heads=3), "num_kv_heads=3"),
    ]
    for family, cls, overrides, expected in cases:
        model = build_model(cls, tiny_config(family, **overrides))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            sharder.optimize(model)
        except ValueError as e:
            assert expected in str(e) and f"tp_size={world}" in str(e), str(e)
        else:
            raise AssertionError(f"{cls} {overrides}: no error at tp={world}")
        # Nothing was modified: the check runs before any parameter is sliced.
        for n, p in model.named_parameters():
            assert p.shape == before[n].shape, f"{n} was sliced before the error"

    class Unknown(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"model_type": "mystery"})()
            self.fc = nn.Linear(4, 4)
    try:
        sharder.optimize(Unknown())
    except ValueError as e:
        msg = str(e)
        assert "mystery" in msg and "bert" in msg and "custom_policy" in msg, msg
    else:
        raise AssertionError("unknown model did not raise")


@pytest.mark.parametrize("world", [2, 4])
def test_policies_match_unsharded(world):
    spawn(_policies_body, world)


def _registry_and_shared_paths_body(rank, world):
    """A style registered from outside the sharder and a family's own attribute rule (a callable)
    shard GPT-2 exactly; a module the model reaches by several paths (a linear shared by two layers,
    an aliased linear and embedding) is replaced at every path, including paths the plan does not
    name."""
    import copy

    from meshboost.shardformer.layers import ColumnParallelLinear, VocabParallelEmbedding
    from meshboost.shardformer.policies.gpt2 import GPT2_POLICY
    from meshboost.shardformer.styles import STYLES, register_style
    from meshboost.testing.compare import gathered, model_loss
    from meshboost.testing.models import tiny_batch
    from meshboost.testing.tolerance import assert_close

    colwise = STYLES["colwise"]
    register_style("colwise_registered", colwise.validate, colwise.apply)
    per_rank_width = lambda path, attr, value, tp: value // tp          # noqa: E731 - a family's own rule
    policy = Policy(name="gpt2-registered", plan={**GPT2_POLICY.plan, "h.*.mlp.c_fc": "colwise_registered"},
                    attributes={"h.*.attn": {"split_size": per_rank_width, "num_heads": "divide"}})
    config = tiny_config("gpt2", n_layer=2)

    def shared_leaf(seed):
        model = build_model("GPT2LMHeadModel", copy.deepcopy(config), seed=seed)
        model.transformer.h[1].mlp.c_fc = model.transformer.h[0].mlp.c_fc     # one linear, two layers
        return model

    ref, par = shared_leaf(0), shared_leaf(0)
    par.transformer.aux_fc = par.transformer.h[0].mlp.c_fc               # paths the plan does not name
    par.transformer.aux_wte = par.transformer.wte
    ShardFormer(ShardConfig(tensor_parallel_process_group=dist.group.WORLD)).optimize(par, policy)
    c_fc = par.transformer.h[0].mlp.c_fc
    assert isinstance(c_fc, ColumnParallelLinear)
    assert par.transformer.h[1].mlp.c_fc is c_fc and par.transformer.aux_fc is c_fc, "a path kept the native module"
    wte = par.transformer.wte
    assert isinstance(wte, VocabParallelEmbedding) and par.transformer.aux_wte is wte, "an embedding path was missed"
    assert par.transformer.h[0].attn.split_size == config.n_embd // world
    batch = tiny_batch("GPT2LMHeadModel", config)
    ref_loss, _ = model_loss(ref, batch)
    par_loss, _ = model_loss(par, batch)
    assert abs(ref_loss.item() - par_loss.item()) <= 1e-5, f"shared layers: {par_loss.item()} vs {ref_loss.item()}"
    ref_loss.backward(), par_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        assert_close(gathered(p, p.grad), ref_params[name].grad, msg=f"shared layers grad {name}")

    with pytest.raises(ValueError, match="unknown sharding style 'diagonal'.*colwise_registered"):
        Policy(name="bad", plan={"h.*.mlp.c_fc": "diagonal"})
    with pytest.raises(ValueError, match="colwise_fused takes 1 positive integer"):
        Policy(name="bad", plan={"h.*.attn.c_attn": "colwise_fused"})
    with pytest.raises(ValueError, match="unknown attribute rule 'halve'"):
        Policy(name="bad", plan={"h.*.mlp.c_fc": "colwise"}, attributes={"h.*.attn": {"num_heads": "halve"}})


def _custom_policy_and_errors_body(rank, world):
    _custom_policy_body(rank, world)
    _registry_and_shared_paths_body(rank, world)
    _errors_body(rank, world)


def test_custom_policy_and_clear_errors():
    # tp=4: heads 6, kv-heads 3 and intermediate 66 are indivisible; OPT's 4 heads divide.
    spawn(_custom_policy_and_errors_body, 4)
