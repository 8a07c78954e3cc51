"""The planner's fake runs (issue 56 item 8): each is made once per shape and shared by every layout that
asks for it, a stack of two alike layers is derived from the one-layer run rather than run, a layout
whose state alone cannot fit makes none, the counter that times each run (`live.LiveBytes`) counts what
torch's MemTracker counts, op for op, and a ranking that takes a while says so on stderr. Counts, not
timings: the seconds are benchmarks/plan_speed.py's to print."""

from __future__ import annotations

import pytest
import torch

from meshboost.plan import activations, fakecache, live, ranking
from meshboost.plan.__main__ import main
from meshboost.plan.model import parse_overrides
from meshboost.plan.planner import Planner

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "vocab_size=1000")
MOE = ("hidden_size=64,intermediate_size=128,moe_intermediate_size=32,num_experts=4,num_experts_per_tok=2,"
       "num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=1000")


def _counted(monkeypatch) -> list:
    """(layers, what else the run reads) of every fake run made in this process from now on (caches
    emptied, no workers)."""
    fakecache.clear()
    monkeypatch.setenv(fakecache.WORKERS_ENV, "1")
    runs = []
    saved_bytes = activations._saved_bytes

    def counted(cls, config, batch, seq, dtype, checkpointing, split, vocab_tp, body, ep, loss_chunk=None):
        split_key = None if split is None else (split.mode, split.size)
        runs.append((activations.count_layers(config), activations._key(config), batch, seq, dtype, checkpointing,
                     split_key, vocab_tp, body, ep, loss_chunk))
        return saved_bytes(cls, config, batch, seq, dtype, checkpointing, split, vocab_tp, body, ep, loss_chunk)

    monkeypatch.setattr(activations, "_saved_bytes", counted)
    return runs


def test_a_ranking_runs_each_shape_once_and_derives_two_layers(monkeypatch):
    runs = _counted(monkeypatch)
    planner = Planner("llama", parse_overrides(TINY), gpus=2, seq=16, global_batch=4, device="cpu")
    fitting, _ = planner.rank()
    assert len(fitting) > 20
    assert len(runs) == len(set(runs)), "a fake run was made twice"
    # two layers are run only where they differ from one (LoRA, layers of several kinds): split_gather's
    # runs (tp=2 here) derive theirs from one layer too
    two = [run for run in runs if run[0] == 2]
    assert not two, two
    assert any(split is not None and split[0] == "split_gather" for *_, split, _, body, _, _ in runs)
    # a second ranking of the same planner asks nothing new
    before = len(runs)
    again, _ = planner.rank()
    assert len(runs) == before and [e.as_dict() for e in again] == [e.as_dict() for e in fitting]


def test_layouts_whose_state_cannot_fit_make_no_fake_run(monkeypatch):
    runs = _counted(monkeypatch)
    probe = Planner("qwen3_moe", parse_overrides(MOE), gpus=4, seq=16, global_batch=4, device="cpu")
    checked, _ = ranking._checked(probe)
    bounds = sorted({bound for _, bound in checked})
    memory_gb = (bounds[len(bounds) // 8] + 1) / 2 ** 30          # only the layouts of the smallest states fit
    planner = Planner("qwen3_moe", parse_overrides(MOE), gpus=4, seq=16, global_batch=4, device="cpu",
                      memory_gb=memory_gb)
    kept = [layout for layout, bound in checked if bound <= planner.memory_bytes]
    assert 0 < len(kept) < len(checked)
    wanted = fakecache.needed_runs(planner, kept)
    every = fakecache.needed_runs(planner, [layout for layout, _ in checked])
    assert len(wanted) < len(every)
    planner.rank()
    assert len(runs) == len(set(runs)) == len(wanted)      # the kept layouts' runs, once each, and no other


def test_nothing_fits_checks_each_layout_once(monkeypatch):
    """The advice's search for the smallest layout reads the ranking's checks (the 30B MoE on 8 GPUs:
    1740 layouts checked twice before), and finds what a fresh search finds."""
    fakecache.clear()
    monkeypatch.setenv(fakecache.WORKERS_ENV, "1")
    kwargs = dict(gpus=2, seq=16, global_batch=4, device="cpu", memory_gb=1e-6)
    fresh = ranking.smallest(Planner("llama", parse_overrides(TINY), **kwargs))
    planner = Planner("llama", parse_overrides(TINY), **kwargs)
    checks = []
    check = planner.check
    monkeypatch.setattr(planner, "check", lambda layout: (checks.append(layout), check(layout))[1])
    fitting, refused = planner.rank()
    assert fitting == [] and len(checks) == len(set(checks)) > 20
    before, explained = len(checks), []
    explain = planner.explain
    monkeypatch.setattr(planner, "explain", lambda layout: (explained.append(layout), explain(layout))[1])
    least = ranking.smallest(planner)
    assert least.as_dict() == fresh.as_dict()
    # only the explained layouts are checked again (by explain itself), not every candidate
    assert explained and checks[before:] == explained
    assert planner.rank()[1] == refused                     # the cached lists are not extended in place


GPT2 = "n_embd=64,n_layer=2,n_head=4,vocab_size=1000,n_positions=64"


@pytest.mark.parametrize("model,overrides,split,checkpointing,body,ep", [
    ("llama", TINY, None, False, False, 1),
    ("llama", TINY, None, True, False, 1),
    ("llama", TINY, activations.SequenceSplit("ring_attn", 2), False, False, 1),
    ("llama", TINY, activations.SequenceSplit("all_to_all", 2), False, True, 1),
    ("gpt2", GPT2, None, False, False, 1),
    ("gpt2", GPT2, None, True, True, 1),
    ("qwen3_moe", MOE, None, False, False, 2),
    ("llama", TINY, "split_gather", False, False, 1),
    ("llama", TINY, "split_gather", True, False, 1),
    ("qwen3_moe", MOE, "split_gather", True, False, 2),
    ("llama", TINY, "split_gather", False, True, 1),
    ("qwen3_moe", MOE, "split_gather", True, True, 1),
], ids=["llama", "llama-ckpt", "llama-ring_attn", "llama-all_to_all-stage-body", "gpt2", "gpt2-ckpt-stage-body",
        "moe-ep2", "llama-split_gather", "llama-split_gather-ckpt", "moe-split_gather-ckpt-ep2",
        "llama-split_gather-stage-body", "moe-split_gather-ckpt-stage-body"])
def test_two_layers_derived_equal_a_two_layer_run(model, overrides, split, checkpointing, body, ep):
    planner = Planner(model, parse_overrides(overrides), gpus=2, seq=32, global_batch=4, device="cpu")
    config_json, model_type = activations._key(planner.config)
    if split == "split_gather":     # the cut before the first layer and the gather after the last outside the marks
        split = activations.SequenceSplit(split, 2, planner.sequence_roles(2))
    assert activations._alike_layers(config_json, split)
    args = (2, 32, "bf16", checkpointing, split, 1, body, ep)
    one = activations._run.uncached(planner.cls, config_json, model_type, 1, *args)
    whole = activations._run.uncached(planner.cls, config_json, model_type, 1, *args[:6], False, ep)[5]
    gathered = split is not None and split.mode == "split_gather"
    saved, after, totals, grads = live.two_layers(one[0], one[2], one[3], one[4], one[5], whole if body else None,
                                                  gathered)
    real = activations._run.uncached(planner.cls, config_json, model_type, 2, *args)
    assert (saved, after) == (real[0], real[2])
    assert 2 * one[1] == real[1]                # split_gather's replicated elements fed the chunk: each layer's
    assert len(totals) == len(real[3]) and list(grads) == list(real[4])
    # every instant as the run counts it, but for a few bytes a layer keeps for the next (the experts'
    # routing counts, replaced by the second layer's): never under, the peaks the same
    assert all(0 <= d - r <= 64 for d, r in zip(totals, real[3]))
    assert max(totals) == max(real[3])
    assert max(map(sum, zip(totals, grads))) == max(map(sum, zip(real[3], real[4])))


def _memtracker_timeline(model, inputs):
    """live_peak's timelines with torch's MemTracker counting (the counter before LiveBytes)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from meshboost.plan.tracker import device_bytes, live_bytes_tracker

    kinds = (_MemRefType.ACT, _MemRefType.TEMP)
    totals = []

    class Timeline(live_bytes_tracker()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            totals.append(device_bytes(self._curr_mem_snap, kinds))
            return out

    drops = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    def pack(t):            # what live_peak's saved-bytes count reads of each saved tensor (ops on fake ones)
        (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.dtype)
        return t

    tracker = Timeline()
    tracker.track_external(model)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss
        after = device_bytes(tracker.get_tracker_snapshot("current"), kinds)
        loss.backward()
    for handle in drops:
        handle.remove()
    return after, totals


def test_live_bytes_counts_what_memtracker_counts():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.for_model("llama", **parse_overrides(TINY))
    for checkpointing in (False, True):
        figures = []
        for count in (live.live_peak, None):
            with FakeTensorMode():
                torch.manual_seed(0)
                model = LlamaForCausalLM(config).train()
                if checkpointing:
                    model.gradient_checkpointing_enable({"use_reentrant": False})
                ids = torch.randint(0, 1000, (2, 16))
                if count is None:
                    figures.append(_memtracker_timeline(model, {"input_ids": ids, "labels": ids}))
                else:
                    weights = {p.untyped_storage()._cdata for p in model.parameters()}
                    _, after, totals, _, _ = count(model, {"input_ids": ids, "labels": ids}, weights)
                    figures.append((after, list(totals)))
        assert figures[0] == figures[1] and len(figures[0][1]) > 500, checkpointing


def test_a_slow_ranking_says_how_far_it_is(capsys, monkeypatch):
    fakecache.clear()
    monkeypatch.setattr(ranking, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setenv(fakecache.WORKERS_ENV, "1")
    assert main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "16", "--global-batch", "2"]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.startswith("meshboost.plan: ")]
    assert lines and "layouts estimated" in lines[-1] and lines[-1].startswith("meshboost.plan: done: ")
    assert "layouts checked" in lines[0], lines     # the checks before any fake run say how far they are
    assert "layouts checked" not in lines[-1]
    assert "meshboost.plan:" not in out.out          # stdout keeps the table (or --json) alone
