"""What ColossalAI's own test suite (tests/test_shardformer/test_model/, tests/test_booster/) does with
its models, renamed to meshboost (issue 23, point 10), in one 4-rank process group, each against the
unsharded single-process model built from the same seed:

(a) a LazyInitContext model deep-copied (inside the context or out), the original materialised and the copy
    boosted (ColossalAI's `use_lazy_init=True`), at tp=2 (x dp=2) and tp=4: the copy is lazy too, the
    boosted weights equal the materialised original's bit for bit, and loss, gradients (gathered along
    the split dim) and weights after one Adam step match it;
(b) ColossalAI's BERT 3d config (tp=2 x pp=2, 4 micro-batches, fp32), BertModel under an MSE criterion
    and BertForMaskedLM: loss on every rank and every held gradient match, and `encoder.layer[i]`
    outside a step is layer i by its original index on every stage: the held layer itself, or for
    one another stage holds a stand-in whose weights are None (what ColossalAI's check_weight skips),
    never the layer at position i here (before: the first stage raised IndexError, the last answered
    layer 1 for `layer[0]`);
(c) boosting an optimizer that already stepped (ColossalAI's gradient-accumulation test boosts one):
    2 single-process AdamW steps, boost, 2 more steps equal one process continuing the same optimizer
    (losses and weights) with DDP, ZeRO-1, tp x pp, fp16 ZeRO-1 with fp32 masters, ZeRO-3 on FSDP2,
    TorchFSDPPlugin and LowLevelZeroPlugin's ZeRO-2; where ZeRO cannot carry the state exactly (parameters of one bucket stepped
    differently) it refuses on every rank naming the fix;
(d) a DPPluginBase subclass implementing only `configure` prepares a loader that gives each rank its own
    samples; every plugin is still a DPPluginBase; a subclass skipping `super().__init__()` is told so;
(e) ShardConfig's `sequence_parallel_size` / `sequence_parallel_process_group`: the tp size and group
    with sequence parallelism on, 1 and a group of this rank alone (rank 0 in it) when off, read-only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from meshboost import Booster
from meshboost.booster.plugin.dp_plugin_base import DPPluginBase
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.lazy import LazyInitContext, lazy_seed
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from meshboost.shardformer import ShardConfig
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import booster_step, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

LLAMA, LR = "LlamaForCausalLM", 1e-3


def _whole(p: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
    """The full unpadded value of parameter `p` (or of `t` laid out like it): FSDP2's dp pieces
    gathered, then the tp shards by the parameter's record."""
    t = p.detach() if t is None else t
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return gather_tensor(t, get_tp_info(p))


# -- (a) a deep copy of a lazy model, boosted --------------------------------------------------------------
def _check_lazy_copy(rank: int) -> None:
    config = tiny_config("llama")
    batch = tiny_batch(LLAMA, config)
    for tp in (2, 4):
        ctx = LazyInitContext()
        with ctx:
            org = transformers.LlamaForCausalLM(copy.deepcopy(config))
            model = copy.deepcopy(org)                    # ColossalAI's build_model_from_hybrid_plugin
        assert lazy_seed(model) == lazy_seed(copy.deepcopy(org)) == lazy_seed(org) is not None, \
            "a deep copy of a lazy model (inside the context or out) is lazy"
        ctx.materialize(org)
        org_opt = torch.optim.Adam(org.parameters(), lr=LR)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        booster = Booster(plugin=HybridParallelPlugin(tp_size=tp, precision="fp32"))
        model, opt, *_ = booster.boost(model, opt)
        held = dict(model.unwrap().named_parameters())
        for name, p in org.named_parameters():
            assert torch.equal(gathered(held[name]), p.detach()), f"tp={tp}: {name} differs from the original"
        ref_loss = org(**batch).loss
        ref_loss.backward()
        loss = model(**batch).loss
        booster.backward(loss, opt)
        assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"tp={tp}: {loss} vs {ref_loss}"
        for name, p in org.named_parameters():
            assert_close(gathered(held[name], held[name].grad), p.grad, msg=f"lazy copy tp={tp} grad {name}")
        org_opt.step(), opt.step()
        for name, p in org.named_parameters():
            assert_close(gathered(held[name]), p.detach(), msg=f"lazy copy tp={tp} weight after Adam {name}")


# -- (b) ColossalAI's BERT test config at tp=2 x pp=2 fp32 --------------------------------------------------
def _mse(outputs, inputs):
    return F.mse_loss(outputs["last_hidden_state"], torch.ones_like(outputs["last_hidden_state"]))


def _model_loss(outputs, inputs):
    return outputs["loss"]


def _check_bert_3d(rank: int) -> None:
    for cls, criterion in (("BertModel", _mse), ("BertForMaskedLM", _model_loss)):
        config = tiny_config("bert")                       # 2 layers: one per stage, as ColossalAI's zoo config
        extra = {"add_pooling_layer": False} if cls == "BertModel" else {}
        torch.manual_seed(0)
        ref = getattr(transformers, cls)(copy.deepcopy(config), **extra)
        model = copy.deepcopy(ref)
        batch = tiny_batch("BertForMaskedLM", config, batch=4)
        if cls == "BertModel":
            batch.pop("labels")
        ref_loss = criterion(ref(**batch), batch)
        ref_loss.backward()
        plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=4, precision="fp32")
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=LR))
        out = booster.execute_pipeline(iter([batch]), model, criterion, opt, return_loss=True, return_outputs=True)
        where = f"{cls} tp=2 x pp=2 rank {rank}"
        assert abs(out["loss"].item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"{where}: loss"
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        for name, p in model.unwrap().named_parameters(remove_duplicate=False):
            assert_close(gathered(p, p.grad), ref_params[name].grad, msg=f"{where} grad {name}")
        bert = model.unwrap() if cls == "BertModel" else model.unwrap().bert
        prefix = "" if cls == "BertModel" else "bert."
        stage = plugin.stage_manager.stage
        mine, other = bert.encoder.layer[stage], bert.encoder.layer[1 - stage]      # by original index
        assert mine is dict(bert.encoder.layer.named_children())[str(stage)], where
        assert_close(gathered(mine.output.dense.weight), ref_params[f"{prefix}encoder.layer.{stage}.output.dense."
                                                                    "weight"].detach(), msg=where)
        assert other.output.dense.weight is None and other.attention.output.LayerNorm.weight is None, where
        assert bert.encoder.layer[-1] is bert.encoder.layer[1], where
        with pytest.raises(RuntimeError, match="held by pipeline rank"):
            other(torch.zeros(1, 8, config.hidden_size))
        with pytest.raises(IndexError, match="the model has 2 layers"):
            bert.encoder.layer[2]


# -- (c) boosting an optimizer that already stepped ---------------------------------------------------------
def _stepped(config, batches):
    """A model and AdamW after single-process steps on `batches` (the same numbers on every rank)."""
    model = build_model(LLAMA, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
    for b in batches:
        model(**b).loss.backward()
        opt.step(), opt.zero_grad()
    return model, opt


def _check_stepped_optimizer(rank: int) -> None:
    config = tiny_config("llama")
    batches = [tiny_batch(LLAMA, config, batch=4, seed=30 + s) for s in range(4)]
    ref, ref_opt = _stepped(config, batches[:2])
    ref_losses = []
    for b in batches[2:]:                                  # the same optimizer, continued
        loss = ref(**b).loss
        loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    cases = (("tp=2 x dp=2 DDP", lambda: HybridParallelPlugin(tp_size=2), torch.float32),
             ("tp=2 x dp=2 ZeRO-1", lambda: HybridParallelPlugin(tp_size=2, zero_stage=1), torch.float32),
             ("tp=2 x pp=2", lambda: HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2), torch.float32),
             ("tp=2 x dp=2 ZeRO-1 fp16", lambda: HybridParallelPlugin(tp_size=2, zero_stage=1, precision="fp16",
                                                                      initial_scale=2**8), torch.float16),
             ("tp=2 x dp=2 ZeRO-3", lambda: HybridParallelPlugin(tp_size=2, zero_stage=3), torch.float32),
             ("TorchFSDPPlugin", lambda: TorchFSDPPlugin(), torch.float32),
             ("LowLevelZeroPlugin ZeRO-2", lambda: LowLevelZeroPlugin(stage=2, precision="fp32"), torch.float32))
    for what, make, dtype in cases:
        model, opt = _stepped(config, batches[:2])
        booster = Booster(plugin=make())
        model, opt, *_ = booster.boost(model, opt)
        for step, b in enumerate(batches[2:]):
            loss = booster_step(booster, model, opt, b)
            opt.zero_grad()
            assert abs(loss.item() - ref_losses[step]) <= LOSS_ATOL[dtype], \
                f"{what} step {step}: {loss.item()} vs the continued optimizer's {ref_losses[step]}"
        for name, p in model.unwrap().named_parameters():
            assert_close(_whole(p), ref_params[name].detach(), dtype=dtype, msg=f"{what}: weight {name}")
    # A parameter left out of the first steps has no state while the rest of its ZeRO bucket has: the
    # first pipeline stage (which holds it) refuses, and the last, which could carry its own, too.
    model = build_model(LLAMA, copy.deepcopy(config))
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
    model(**batches[0]).loss.backward()
    opt.step()
    frozen.requires_grad_(True)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, zero_stage=1)
    why = r"different optimizer scalars.*no state.*zero_stage=0" if plugin.mesh.pp_rank == 0 else \
        r"rank\(s\) \[0, 2\] cannot carry the state"
    with pytest.raises(ValueError, match=why):
        Booster(plugin=plugin).boost(model, opt)


# -- (d) a DPPluginBase subclass ------------------------------------------------------------------------------
class _OwnPlugin(DPPluginBase):
    """ColossalAI's test_dp_plugin_base wrapper: a plugin that only implements configure."""

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        return model, optimizer, criterion, dataloader, lr_scheduler


class _NoInit(DPPluginBase):
    def __init__(self):                    # skips super().__init__()
        pass

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        return model, optimizer, criterion, dataloader, lr_scheduler


def _check_dp_plugin_base(rank: int) -> None:
    plugin = _OwnPlugin()
    loader = plugin.prepare_dataloader(TensorDataset(torch.arange(8)), batch_size=2)
    assert (plugin.rank, plugin.world_size, plugin.dp_size) == (rank, 4, 4)
    mine = [int(x) for batch in loader for x in batch[0]]
    every = [None] * 4
    dist.all_gather_object(every, mine)
    assert all(set(every[r]).isdisjoint(every[q]) for r in range(4) for q in range(r)), every   # own samples
    assert set().union(*map(set, every)) == set(range(8)), every
    assert isinstance(TorchDDPPlugin(), DPPluginBase) and issubclass(HybridParallelPlugin, DPPluginBase)
    with pytest.raises(AttributeError, match=r"super\(\).__init__\(\)"):
        _NoInit().prepare_dataloader(TensorDataset(torch.arange(10)), batch_size=2)


# -- (e) ShardConfig's sequence-parallel views ----------------------------------------------------------------
def _check_shard_config(rank: int) -> None:
    for sp in (True, False):
        plugin = HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=sp)
        sc = plugin.shard_config
        group, size = sc.sequence_parallel_process_group, sc.sequence_parallel_size
        assert size == (2 if sp else 1) and dist.get_world_size(group) == size, (sp, size)
        assert dist.get_rank(group) == (plugin.mesh.tp_rank if sp else 0), sp
        if sp:
            assert group is plugin.tp_group
        hidden = torch.arange(8.0).reshape(1, 8, 1)         # ColossalAI's check_output_hidden_state indexing
        assert hidden.chunk(size, dim=1)[dist.get_rank(group)].shape[1] == 8 // size
        with pytest.raises(AttributeError):
            sc.sequence_parallel_size = 4
    assert ShardConfig(enable_sequence_parallelism=True).sequence_parallel_size == 4    # None: the world
    with pytest.raises(TypeError):
        ShardConfig(sequence_parallel_process_group=None)


def _body(rank: int, world: int) -> None:
    for check in (_check_shard_config, _check_dp_plugin_base, _check_lazy_copy, _check_bert_3d,
                  _check_stepped_optimizer):
        check(rank)


def test_colossalai_suite_configurations():
    spawn(_body, 4)
