"""Loading HF folders into sharded models: each rank reads only its slices (vocab padding and
fused GPT-2 qkv included), a model built on the meta device is materialised by the load, and an
incomplete folder is refused."""

import copy
import json
import os
import tempfile

import torch
import torch.distributed as dist

from meshboost.checkpoint.load import load_model
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import model_loss
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CASES = (("GPT2LMHeadModel", "gpt2"), ("LlamaForCausalLM", "llama_gqa"), ("BertForMaskedLM", "bert"))


def _shared_tmpdir(rank):
    path = [tempfile.mkdtemp(prefix="mb_load_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _body(rank, world):
    group = dist.group.WORLD
    root = _shared_tmpdir(rank)
    for cls, family in CASES:
        config = tiny_config(family)
        src = build_model(cls, copy.deepcopy(config), seed=5)          # the "pretrained" weights
        batch = tiny_batch(cls, config)
        src.eval()
        with torch.no_grad():
            _, expected = model_loss(src, batch)
        for fmt, kwargs in (("safetensors-sharded", dict(safe_serialization=True, max_shard_size="20KB")),
                            ("bin", dict(safe_serialization=False))):
            folder = os.path.join(root, f"{cls}-{fmt}")
            if rank == 0:
                src.save_pretrained(folder, **kwargs)
            dist.barrier()
            # 1) an ordinary model with other random weights, sharded, then loaded
            model = build_model(cls, copy.deepcopy(config), seed=99)
            ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)
            load_model(model, folder)
            model.eval()
            with torch.no_grad():
                _, got = model_loss(model, batch)
            assert_close(got, expected, msg=f"{cls} {fmt} loaded at tp={world}")
        # 2) built on the meta device (no memory for weights), sharded, loaded: identical outputs
        with torch.device("meta"):
            meta_model = getattr(__import__("transformers"), cls)(copy.deepcopy(config))
        ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(meta_model)
        assert all(p.is_meta for p in meta_model.parameters())
        ids_before = [id(p) for p in meta_model.parameters()]
        load_model(meta_model, os.path.join(root, f"{cls}-safetensors-sharded"), device=torch.device("cpu"))
        assert [id(p) for p in meta_model.parameters()] == ids_before, "parameters must stay the same objects"
        meta_model.eval()
        with torch.no_grad():
            _, got = model_loss(meta_model, batch)
        assert_close(got, expected, msg=f"{cls} meta-device model loaded at tp={world}")

    # An index naming a file that is not there: a clear error, never a half-loaded model.
    folder = os.path.join(root, "GPT2LMHeadModel-safetensors-sharded")
    dist.barrier()
    if rank == 0:
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            victim = sorted(set(json.load(f)["weight_map"].values()))[-1]
        os.rename(os.path.join(folder, victim), os.path.join(folder, victim + ".partial"))
    dist.barrier()
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"))
    try:
        load_model(model, folder)
    except RuntimeError as e:
        assert "incomplete" in str(e), str(e)
    else:
        raise AssertionError("an incomplete checkpoint folder was loaded")


def test_load_hf_folders_at_tp2():
    spawn(_body, 2)
