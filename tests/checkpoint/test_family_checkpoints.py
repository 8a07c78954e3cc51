"""Issue 12: every hand-written family's checkpoint round trip at tp=4 (kv heads fewer than tp included):
`booster.save_model` writes an HF folder whose `from_pretrained` weights equal the unsharded model's
bit for bit, and `booster.load_model` puts exactly those weights back into a differently seeded
sharded model. Then the models of several layer stacks (T5, Whisper, BLIP-2) and ALBERT (its shared
layer group on both stages) at tp=2 x pp=2: each pipeline stage writes its part of the same HF folder."""

import copy

import torch
import torch.distributed as dist
import transformers as tfm

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import spawn
from meshboost.testing.compare import gathered
from meshboost.testing.models import MODEL_CLASSES, build_model, tiny_config

FAMILIES = ("opt", "bloom", "falcon", "falcon_mqa", "falcon_alibi", "vit", "albert", "t5_gated", "whisper", "blip2",
            "esmc", "cohere_qk")


def _body(rank: int, world: int, root: str) -> None:
    for family in FAMILIES:
        cls = MODEL_CLASSES[family][0]
        config = tiny_config(family)
        ref = dict(build_model(cls, copy.deepcopy(config)).named_parameters())
        booster = Booster(plugin=HybridParallelPlugin(tp_size=world))
        model, *_ = booster.boost(build_model(cls, copy.deepcopy(config)))
        path = f"{root}/{family}"
        booster.save_model(model, path)
        fresh, *_ = booster.boost(build_model(cls, copy.deepcopy(config), seed=5))
        booster.load_model(fresh, path)
        for name, p in fresh.unwrap().named_parameters():
            assert torch.equal(gathered(p), ref[name]), f"{family}: {name} after load_model"
        dist.barrier()
        if rank == 0:
            loaded = dict(getattr(tfm, cls).from_pretrained(path).named_parameters())
            for name, p in ref.items():
                assert torch.equal(loaded[name], p), f"{family}: {name} in the saved HF folder"


def _round_trip_pipeline(rank: int, root: str) -> None:
    for family in ("t5", "whisper", "blip2", "albert"):
        cls = MODEL_CLASSES[family][0]
        config = tiny_config(family) if family in ("blip2", "albert") else tiny_config(family, num_hidden_layers=4)
        reference = build_model(cls, copy.deepcopy(config))
        ref = dict(reference.named_parameters(remove_duplicate=False))
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2))
        model, *_ = booster.boost(build_model(cls, copy.deepcopy(config)))
        path = f"{root}/pp_{family}"
        booster.save_model(model, path, shard=True)
        fresh, *_ = booster.boost(build_model(cls, copy.deepcopy(config), seed=5))
        booster.load_model(fresh, path)
        for name, p in fresh.unwrap().named_parameters(remove_duplicate=False):
            assert torch.equal(gathered(p), ref[name]), f"{family} pp: {name} after load_model"
        dist.barrier()
        if rank == 0:
            loaded = getattr(tfm, cls).from_pretrained(path).state_dict()
            for name, t in reference.state_dict().items():
                assert torch.equal(loaded[name], t), f"{family} pp: {name} in the saved HF folder"


def _body_all(rank: int, world: int, root: str) -> None:
    _body(rank, world, root)
    _round_trip_pipeline(rank, root)


def test_family_checkpoints_round_trip_at_tp4(tmp_path):
    spawn(_body_all, 4, str(tmp_path))
