"""meshboost.check: the shrink keeps head counts and tp divisibility (no processes); at world 2, a layout
the plugin runs exactly reads exact per layer type, one it refuses reads refused with the plugin's message,
and a gradient deliberately scaled on one rank reads wrong naming that parameter; an unknown model type
is one line; the comparison on tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshboost.check import layout_for, shrink
from meshboost.check.__main__ import main
from meshboost.check.run import compare, run_cases, worst_copies
from meshboost.plan.model import load_config
from meshboost.testing.spawn import spawn

SCALED = "model.layers.0.mlp.down_proj.weight"


def test_shrink_keeps_heads_and_divisibility():
    for model, overrides, layout in (("llama", {}, "tp=4,pp=2"), ("qwen3_moe", {}, "tp=2,dp=2,ep=2"),
                                     ("llama", {"intermediate_size": 11006}, "tp=2")):
        real = load_config(model, overrides)
        parsed = layout_for(layout)
        small, lines = shrink(real, parsed)
        assert lines and all(line.startswith(("shrunk: ", "kept: ")) for line in lines), lines
        for key in ("num_attention_heads", "num_key_value_heads"):
            assert getattr(small, key) == getattr(real, key), key
        real_head = getattr(real, "head_dim", None) or real.hidden_size // real.num_attention_heads
        assert (getattr(small, "head_dim", None) or small.hidden_size // small.num_attention_heads) == real_head
        assert small.hidden_size < real.hidden_size and small.vocab_size <= 256
        assert parsed.pp <= small.num_hidden_layers < real.num_hidden_layers
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            if isinstance(getattr(real, key, None), int):     # splits the same way: divisible by tp where it was
                assert (getattr(small, key) % parsed.tp == 0) == (getattr(real, key) % parsed.tp == 0), key
        if parsed.ep > 1:
            assert small.num_experts % parsed.ep == 0 and small.num_experts_per_tok <= small.num_experts
            assert small.num_experts_per_tok == real.num_experts_per_tok
    assert layout_for("pp=2").microbatches == 2          # a pipeline gets a micro-batch per stage


def test_shrink_keeps_one_layer_of_each_kind():
    hybrid = load_config("qwen3_next")                  # linear-attention and full-attention layers
    small, _ = shrink(hybrid, layout_for("tp=2"))
    assert set(small.layer_types) == set(hybrid.layer_types) and len(small.layer_types) == small.num_hidden_layers
    assert small.linear_num_key_heads == hybrid.linear_num_key_heads
    dense_first = load_config("deepseek_v3")            # dense layers before the MoE ones
    small, _ = shrink(dense_first, layout_for("pp=2,dp=2,ep=2"))
    assert 0 < small.first_k_dense_replace < small.num_hidden_layers and small.num_hidden_layers >= 2
    assert small.n_routed_experts % 2 == 0 and small.num_experts_per_tok == dense_first.num_experts_per_tok
    assert small.n_routed_experts >= 2 * small.num_experts_per_tok         # the router picks a subset
    assert small.kv_lora_rank < dense_first.kv_lora_rank and small.num_attention_heads == 128   # MLA: heads kept
    gpt2 = load_config("gpt2")                          # head_dim derived from the width: the width stays
    small, lines = shrink(gpt2, layout_for("tp=2"))
    assert small.n_embd == gpt2.n_embd and small.n_head == gpt2.n_head and any("kept: n_embd" in x for x in lines)


def test_compare_on_tensors():
    want = {"a": torch.ones(4), "b": torch.full((2,), 0.5)}
    groups = {"a": "Attention (self_attn)", "b": "MLP (mlp)"}
    exact = compare({"a": torch.ones(4) + 1e-7, "b": want["b"].clone()}, want, groups)
    assert all(v == "exact" for v, _ in exact.values()), exact
    wrong = compare({"a": torch.ones(4), "b": want["b"] * 2}, want, groups)
    assert wrong["Attention (self_attn)"][0] == "exact"
    assert wrong["MLP (mlp)"][0] == "wrong" and "0.5" in wrong["MLP (mlp)"][1] and " b" in wrong["MLP (mlp)"][1]
    missing = compare({"a": torch.ones(4)}, want, groups)
    assert missing["MLP (mlp)"][0] == "wrong" and "no gradient" in missing["MLP (mlp)"][1]
    extra = compare({**want, "c": torch.ones(2)}, want, {**groups, "c": "MLP (mlp)"})
    assert extra["MLP (mlp)"][0] == "wrong" and "only in this layout" in extra["MLP (mlp)"][1], extra
    zero = compare({**want, "c": torch.zeros(2)}, want, {**groups, "c": "MLP (mlp)"})
    assert zero["MLP (mlp)"][0] == "exact", zero
    # two replicas: the one that diverged is the one compared, whichever rank holds it; tied names merged
    replicas = worst_copies([{"b": want["b"] * 2}, {"b": want["b"].clone(), "b_tied": want["b"].clone()}], want,
                            {"b_tied": "b"})
    assert set(replicas) == {"b"} and compare(replicas, want, groups)["MLP (mlp)"][0] == "wrong"
    replicas = worst_copies([{"b": want["b"].clone()}, {"b_tied": want["b"] * 2}], want, {"b_tied": "b"})
    assert compare(replicas, want, groups)["MLP (mlp)"][0] == "wrong"


def test_unknown_model_type_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "lamma", "--layout", "tp=2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "'lamma'" in err and "llama" in err, err
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama", "--layout", "tp=4,dp=8"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "32 processes" in err, err
    with pytest.raises(SystemExit) as exc:
        main(["--model", "llama", "--layout", "tq=2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "'tq=2'" in err, err


def test_report_lines_and_exit_status():
    from meshboost.check import Report
    ok = Report(["shrunk: x"], ("exact", "1 vs 1"), {"A (a)": ("exact", "d")}, "planner: p")
    assert ok.lines() == ["shrunk: x", "loss: exact (1 vs 1)", "A (a): exact (d)", "planner: p"]
    refused = Report([], ("refused", "ValueError: m"), {"A (a)": ("refused", "ValueError: m")}, "planner: p")
    assert refused.lines() == ["refused: ValueError: m", "planner: p"]
    crashed = Report([], ("wrong", "the step crashed: E"), {}, "planner: p")
    assert crashed.lines() == ["wrong: the step crashed: E", "planner: p"]


def _scaled_step(step):
    """SGD's step with one parameter's gradient doubled on rank 0 (a deliberately wrong layout)."""
    def patched(self, *args, **kwargs):
        if torch.distributed.get_rank() == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    if getattr(p, "_check_scaled", False):
                        p.grad.mul_(2)
        return step(self, *args, **kwargs)
    return patched


def _body(rank, world, cases, wrong_case, out):
    run_cases(rank, world, cases, out + ".right")
    step = torch.optim.SGD.step
    torch.optim.SGD.step = _scaled_step(step)
    import meshboost.booster as booster_module
    real_boost = booster_module.Booster.boost

    def boost_and_mark(self, model, *args, **kwargs):
        boosted = real_boost(self, model, *args, **kwargs)
        dict(boosted[0].unwrap().named_parameters())[SCALED]._check_scaled = True
        return boosted
    booster_module.Booster.boost = boost_and_mark
    try:
        run_cases(rank, world, [wrong_case], out + ".wrong")
    finally:
        torch.optim.SGD.step = step
        booster_module.Booster.boost = real_boost


def test_verdicts_at_world_2(tmp_path):
    llama = load_config("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    odd = load_config("llama", {"hidden_size": 4000, "num_attention_heads": 5, "num_key_value_heads": 5,
                                "head_dim": 16})
    tp2, pp2, ep2 = layout_for("tp=2"), layout_for("pp=2"), layout_for("dp=2,ep=2,zero=1")
    cases = [(shrink(llama, tp2)[0], tp2), (shrink(odd, tp2)[0], tp2), (shrink(llama, pp2)[0], pp2),
             (shrink(load_config("qwen3_moe"), ep2)[0], ep2)]
    out = str(tmp_path / "verdicts")
    spawn(_body, 2, cases, cases[0], out)
    exact, refused, stages, experts = json.loads(open(out + ".right").read())
    for what, result in (("pp=2", stages), ("ep=2", experts)):
        assert result["loss"][0] == "exact" and {v for v, _ in result["groups"].values()} == {"exact"}, (what, result)
    assert "Qwen3MoeSparseMoeBlock (mlp)" in experts["groups"], experts
    wrong, = json.loads(open(out + ".wrong").read())
    assert exact["loss"][0] == "exact" and exact["groups"], exact
    assert {v for v, _ in exact["groups"].values()} == {"exact"}, exact
    assert "LlamaAttention (self_attn)" in exact["groups"] and "LlamaMLP (mlp)" in exact["groups"]
    assert refused["loss"][0] == "refused" and "5" in refused["loss"][1], refused
    assert wrong["groups"]["LlamaMLP (mlp)"][0] == "wrong" and SCALED in wrong["groups"]["LlamaMLP (mlp)"][1], wrong
    assert wrong["groups"]["LlamaAttention (self_attn)"][0] == "exact", wrong
    assert os.path.exists(out + ".wrong")
