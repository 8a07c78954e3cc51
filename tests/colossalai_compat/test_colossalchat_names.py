"""What ColossalChat's `coati` package and training scripts need of ColossalAI, without a ColossalAI checkout
(tools/colossalchat/run.sh runs the scripts themselves from one):

- the names coati imports exist: `initialize.launch` (meshboost's own launch), `shardformer.policies.auto_policy.
  get_autopolicy` (the policy meshboost picks by itself), `shardformer.layer.loss.dist_log_prob`;
- on 4 processes (tp=2 x dp=2): `plugin.prepare_dataloader(..., distributed_sampler_cls=cls)` builds
  `cls(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=...)` as ColossalAI does, so a sampler of the
  script's own (ColossalChat's StatefulDistributedSampler, written here in its shape) keeps its methods: the dp
  replicas split the dataset in DistributedSampler's order (seed 0, as ColossalAI's), tp ranks of a replica get
  the same samples, and `set_start_index(k)` resumes after k samples; meshboost's own loader answers
  `loader.sampler.set_start_index(k)` the same way, for that epoch only;
- `dist_log_prob` at tp=2 on one rank's padded vocab shard equals log_softmax + gather of the whole logits (the
  padded columns hold large values, which must not count), and its gradient on the shard is the slice of the
  whole logits' gradient (zero on the padding); whole logits at tp=2 (a model in eval) give the same numbers;
  vocab_size=None on a shard, a width that is neither, and context parallelism are refused;
- at cp=2 x dp=2 (ColossalChat's sp_all_to_all) a boosted model called as coati's trainers call it,
  `model(input_ids, attention_mask=..., labels=...)`, gives the loss of the keyword call, and the replicas' mean is
  one process's;
- at tp=2 x dp=2 a module of the script's own around a transformers base model (train_rm.py's RewardModel: the
  base model under `model`, a value head beside it, `custom_policy=get_autopolicy(model.model)`) is sharded
  inside; its values before and after one AdamW step equal one process's.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from meshboost.testing import spawn

VOCAB, DATASET = 300, list(range(40))


class StartIndexSampler(DistributedSampler):
    """ColossalChat's `StatefulDistributedSampler` interface: DistributedSampler + `set_start_index`."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.start_index, self.built_with = 0, dict(num_replicas=num_replicas, rank=rank, shuffle=shuffle)

    def __iter__(self):
        return iter(list(super().__iter__())[self.start_index:])

    def __len__(self):
        return self.num_samples - self.start_index

    def set_start_index(self, start_index):
        self.start_index = start_index


def test_names_coati_imports():
    import meshboost
    from meshboost.initialize import launch, launch_from_torch
    from meshboost.shardformer.layer.loss import dist_log_prob
    from meshboost.shardformer.policies import get_policy
    from meshboost.shardformer.policies.auto_policy import get_autopolicy
    from meshboost.testing.models import build_model, tiny_config

    assert launch is meshboost.launch and launch_from_torch is meshboost.launch_from_torch
    model = build_model("LlamaForCausalLM", tiny_config("llama"))
    assert get_autopolicy(model) == get_policy(model) and get_autopolicy(model.model) == get_policy(model.model)
    assert callable(dist_log_prob)


def _samplers(plugin, rank):
    mesh = plugin.mesh
    loader = plugin.prepare_dataloader(DATASET, batch_size=4, shuffle=True, distributed_sampler_cls=StartIndexSampler)
    sampler = loader.sampler
    assert isinstance(sampler, StartIndexSampler)
    assert sampler.built_with == dict(num_replicas=mesh.dp_size, rank=mesh.dp_rank, shuffle=True)
    order = list(DistributedSampler(DATASET, num_replicas=1, rank=0, shuffle=True))     # ColossalAI's: seed 0
    share = order[mesh.dp_rank::mesh.dp_size]
    assert [int(i) for b in loader for i in b] == share
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    tp_peers = [r for r in range(dist.get_world_size()) if r // mesh.tp_size == rank // mesh.tp_size]
    assert all(shares[r] == share for r in tp_peers)
    assert sorted(i for s in shares[::mesh.tp_size] for i in s) == DATASET
    sampler.set_start_index(8)                       # ColossalChat's resume: this replica's first 8 samples done
    assert [int(i) for b in loader for i in b] == share[8:] and len(loader) == 3

    own = plugin.prepare_dataloader(DATASET, batch_size=4, shuffle=True, seed=7)     # meshboost's resumable loader
    first = [int(i) for b in own for i in b]
    own.sampler.set_start_index(8)
    assert [int(i) for b in own for i in b] == first[8:] and own.state_dict()["samples_done"] == 40
    assert [int(i) for b in own for i in b] == first                 # the skip holds for one iteration
    with pytest.raises(ValueError, match="set_start_index"):
        own.sampler.set_start_index(-1)


def _log_probs(plugin, rank):
    from meshboost.shardformer.layer.loss import dist_log_prob

    torch.manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, dtype=torch.float32)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[0, 3] = -100                              # not scored: 0, as meshboost's log-probs give it
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))
    expected[0, 2] = 0.0
    weights = torch.randn(2, 6, 1, dtype=torch.float32)
    full = logits.clone().requires_grad_()
    expected_with_grad = torch.log_softmax(full[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))
    (expected_with_grad * weights * (labels[:, 1:] != -100).unsqueeze(-1)).sum().backward()

    cfg = plugin.shard_config
    width = 192                                       # 300 padded to a multiple of 64 x 2 = 384, over 2 ranks
    tp_rank = dist.get_rank(cfg.tp_group)
    padded = torch.cat([logits, torch.full((2, 7, 2 * width - VOCAB), 50.0, dtype=logits.dtype)], -1)
    shard = padded[..., tp_rank * width:(tp_rank + 1) * width].clone().requires_grad_()
    got = dist_log_prob(labels, shard, cfg, VOCAB, torch.float32)
    assert got.shape == (2, 6, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    (got * weights).sum().backward()
    grad = torch.cat([full.grad, torch.zeros(2, 7, 2 * width - VOCAB, dtype=logits.dtype)], -1)
    torch.testing.assert_close(shard.grad, grad[..., tp_rank * width:(tp_rank + 1) * width], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dist_log_prob(labels, logits, cfg, VOCAB, torch.float32), expected,
                               rtol=1e-5, atol=1e-6)     # whole logits (eval): the same numbers
    assert dist_log_prob(labels, logits.bfloat16(), cfg, VOCAB).dtype == torch.bfloat16      # ColossalAI: the logits' dtype
    with pytest.raises(ValueError, match="vocab_size=None"):
        dist_log_prob(labels, shard, cfg, None)
    with pytest.raises(ValueError, match="neither the vocabulary"):
        dist_log_prob(labels, shard[..., :100], cfg, VOCAB)


def _context(rank):
    """cp=2 x dp=2 (ColossalChat's sp_all_to_all): its trainers call model(input_ids, attention_mask=...,
    labels=...); the sequence split must see input_ids given by position. dist_log_prob is refused there."""
    from meshboost.booster import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.shardformer.layer.loss import dist_log_prob
    from meshboost.testing.models import build_model, tiny_batch, tiny_config

    config = tiny_config("llama")
    reference = build_model("LlamaForCausalLM", copy.deepcopy(config))
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    batch = tiny_batch("LlamaForCausalLM", config, batch=4, seq=8)
    plugin = HybridParallelPlugin(tp_size=1, sp_size=2, enable_sequence_parallelism=True,
                                  sequence_parallelism_mode="all_to_all")
    model, *_ = Booster(plugin=plugin).boost(model)
    mine = slice(plugin.mesh.dp_rank * 2, plugin.mesh.dp_rank * 2 + 2)           # this replica's rows
    rows = {k: v[mine] for k, v in batch.items()}
    by_position = model(rows["input_ids"], attention_mask=rows["attention_mask"], labels=rows["labels"]).loss
    by_name = model(**rows).loss
    torch.testing.assert_close(by_position, by_name, rtol=0, atol=0)
    mean = by_position.detach().reshape(1).clone()          # the replicas' losses average to the batch's
    dist.all_reduce(mean, group=plugin.mesh.dp_group)
    torch.testing.assert_close(mean[0] / plugin.mesh.dp_size, reference(**batch).loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        dist_log_prob(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, VOCAB), plugin.shard_config, VOCAB)


class RewardModel(torch.nn.Module):
    """coati's RewardModel in its shape: a transformers base model under `model`, a value head on the last token."""

    def __init__(self, base):
        super().__init__()
        self.model, self.config = base, base.config
        self.value_head = torch.nn.Linear(base.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids, attention_mask=attention_mask)["last_hidden_state"]
        last = torch.max(attention_mask * torch.arange(input_ids.size(1)), dim=1)[0]
        return self.value_head(hidden[torch.arange(hidden.size(0)), last]).squeeze(-1)


def _reward_model(rank):
    """train_rm.py at tp=2 x dp=2: HybridParallelPlugin(tp_size=2, custom_policy=get_autopolicy(model.model)) on
    the wrapper shards the base model inside it (the head stays whole); values before and after one AdamW step on
    each replica's rows equal one process's on the whole batch."""
    from meshboost.booster import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.shardformer.policies.auto_policy import get_autopolicy
    from meshboost.testing.models import build_model, tiny_config

    def fresh():
        model = RewardModel(build_model("LlamaModel", tiny_config("llama")))
        torch.manual_seed(1)
        model.value_head.reset_parameters()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    ids = torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    reference, ref_opt = fresh()
    before = reference(ids, mask).detach()
    (reference(ids, mask) ** 2).mean().backward()
    ref_opt.step()
    after = reference(ids, mask).detach()

    model, optimizer = fresh()
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, custom_policy=get_autopolicy(model.model))
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    assert model.unwrap().model.layers[0].self_attn.q_proj.weight.shape[0] == tiny_config("llama").hidden_size // 2
    mine = slice(plugin.mesh.dp_rank * 2, plugin.mesh.dp_rank * 2 + 2)
    values = model(ids[mine], mask[mine])
    torch.testing.assert_close(values.detach(), before[mine], rtol=1e-5, atol=1e-6)
    booster.backward((values ** 2).mean(), optimizer)
    optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(model(ids[mine], mask[mine]), after[mine], rtol=1e-5, atol=1e-5)


def _body(rank, world):
    from meshboost.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2, pp_size=1)
    _samplers(plugin, rank)
    _log_probs(plugin, rank)
    _context(rank)
    _reward_model(rank)


def test_samplers_and_log_probs():
    spawn(_body, 4)
