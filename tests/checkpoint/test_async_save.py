"""Asynchronous training-checkpoint saves and the file manifest (issue 63 points 1 and 3), in one 2-rank
process group looping dp=2 ZeRO-1, tp=2, pp=2 and dp=2 ZeRO-3 (GPT-2, tied head, AdamW + StepLR):

* `save_checkpoint(asynchronous=True)` returns before its files exist (a slowed writer), training goes on
  while they are written, and the committed step holds the same bytes, file by file, as a synchronous
  save of the same state (meta.json and its manifest included); resuming from it trains bitwise like
  the uninterrupted run;
* one save in flight: if_busy="skip" skips the next step on every rank with a warning, "wait" waits;
  the host buffers are reused by the next save and hold at most one step's tensors;
* a fault inside the writer thread (an OSError on the writing rank) commits nothing: no step folder,
  no staging folder, `latest` on the previous step, which loads; the error surfaces at the next call on
  every rank (the writer's own error there, a RuntimeError quoting it elsewhere);
* checksums: 64 bytes of garbage inside a committed step's .safetensors (header intact) and a truncated
  optimizer file each fail load_checkpoint on every rank naming the file (verify=False loads the
  garbage, as every load did before manifests); a step without a manifest (an older save) loads with a
  warning.
And, in one process: a process killed (os._exit) while its writer thread is halfway through a file leaves
`latest` on the previous step, which loads; the next save removes what the dead one staged.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from _train_helpers import boosted, train
from meshboost.checkpoint import file_log
from meshboost.testing import spawn

LAYOUTS = {"dp2_zero1": dict(tp_size=1, zero_stage=1), "tp2": dict(tp_size=2),
           "pp2": dict(tp_size=1, pp_size=2, num_microbatches=2),      # pp: every stage writes its own files
           "dp2_zero3": dict(tp_size=1, zero_stage=3)}                 # FSDP2: DTensor weights and states
STEP = "step-00000002"


def _files(step_folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(step_folder):
        for n in names:
            path = os.path.join(root, n)
            out[os.path.relpath(path, step_folder)] = open(path, "rb").read()
    return out


class _Slow:
    """Replaces file_log.durable: every write in the writer thread waits `delay` s first; `fail_at` (k)
    raises on its k-th there."""

    def __init__(self, delay=0.2, fail_at=None):
        self.real, self.delay, self.fail_at, self.calls = file_log.durable, delay, fail_at, 0

    def __call__(self, write, payload, path):
        if threading.current_thread() is threading.main_thread():   # the synchronous part: small files only
            return self.real(write, payload, path)
        self.calls += 1
        time.sleep(self.delay)
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OSError(f"disk full (simulated) writing {os.path.basename(path)}")
        return self.real(write, payload, path)

    def __enter__(self):
        file_log.durable = self
        return self

    def __exit__(self, *exc):
        file_log.durable = self.real


def _sync_equals_async(root, rank, layout):
    booster, mesh, model, opt, sched = boosted(**layout)
    train(booster, mesh, model, opt, sched, range(2))
    booster.save_checkpoint(os.path.join(root, "sync"), model, opt, sched, step=2)
    with _Slow():
        booster.save_checkpoint(os.path.join(root, "async"), model, opt, sched, step=2, asynchronous=True)
        if rank == 0:
            assert not os.path.exists(os.path.join(root, "async", "latest")), "committed before its files were written"
        uninterrupted = train(booster, mesh, model, opt, sched, range(2, 4))    # changes every weight meanwhile
        booster.wait_for_checkpoint()
    if rank == 0:
        sync, done = _files(os.path.join(root, "sync", STEP)), _files(os.path.join(root, "async", STEP))
        assert sorted(sync) == sorted(done), (sorted(sync), sorted(done))
        differ = [n for n in sync if sync[n] != done[n]]
        assert differ == [], f"async and sync saves of one state differ: {differ}"
        manifest = json.loads(sync["meta.json"])["files"]
        assert sorted(manifest) == sorted(n for n in sync if n != "meta.json")
        assert all(manifest[n]["size"] == len(sync[n]) for n in manifest)
    booster, mesh, model, opt, sched = boosted(seed=7, **layout)
    assert booster.load_checkpoint(os.path.join(root, "async"), model, opt, sched)["step"] == 2
    assert train(booster, mesh, model, opt, sched, range(2, 4)) == uninterrupted, "resume from the async step"
    return booster, mesh, model, opt, sched


def _one_in_flight(root, rank, booster, mesh, model, opt, sched):
    folder = os.path.join(root, "async")
    with _Slow(delay=0.3):
        booster.save_checkpoint(folder, model, opt, sched, step=3, asynchronous=True)
        held = booster._saver.buffers.nbytes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert booster.save_checkpoint(folder, model, opt, sched, step=4, asynchronous=True,
                                           if_busy="skip") is None
        assert any("skipped" in str(w.message) for w in caught), [str(w.message) for w in caught]
        booster.save_checkpoint(folder, model, opt, sched, step=5, asynchronous=True)      # waits for step 3
        assert booster._saver.buffers.nbytes == held, "the next save reuses the host buffers"
        booster.wait_for_checkpoint()
    if rank == 0:
        assert open(os.path.join(folder, "latest")).read().strip() == "step-00000005"
        assert not os.path.exists(os.path.join(folder, "step-00000004"))
        step_bytes = sum(len(b) for n, b in _files(os.path.join(folder, "step-00000005")).items()
                         if n.endswith((".safetensors", ".bin")))
        assert 0 < held <= step_bytes, (held, step_bytes)


def _fault_in_the_writer(root, rank, layout, booster, mesh, model, opt, sched):
    folder = os.path.join(root, "async")
    with _Slow(delay=0.0, fail_at=2 if rank == 0 else None):    # rank 0 writes two files or more at each layout
        booster.save_checkpoint(folder, model, opt, sched, step=6, asynchronous=True)
        with pytest.raises(OSError if rank == 0 else RuntimeError, match="disk full"):
            booster.save_checkpoint(folder, model, opt, sched, step=7, asynchronous=True)
    dist.barrier()
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".lock")) == \
        ["latest", STEP, "step-00000003", "step-00000005"], os.listdir(folder)
    booster.wait_for_checkpoint()                               # raised once: nothing left to raise
    b2, mesh2, m2, o2, s2 = boosted(seed=7, **layout)
    assert b2.load_checkpoint(folder, m2, o2, s2)["step"] == 5
    booster.save_checkpoint(folder, model, opt, sched, step=8, asynchronous=True)   # a later save works
    booster.wait_for_checkpoint()
    assert open(os.path.join(folder, "latest")).read().strip() == "step-00000008"


def _damaged(root, rank, layout):
    folder = os.path.join(root, "sync")
    step = os.path.join(folder, STEP)
    weights = os.path.join(step, "model", sorted(n for n in os.listdir(os.path.join(step, "model"))
                                                 if n.endswith(".safetensors"))[-1])
    optimizer = os.path.join(step, "optimizer", sorted(n for n in os.listdir(os.path.join(step, "optimizer"))
                                                       if n.startswith("optimizer-"))[-1])
    original = {p: open(p, "rb").read() for p in (weights, optimizer, os.path.join(step, "meta.json"))}
    dist.barrier()

    def load(verify=True):
        booster, mesh, model, opt, sched = boosted(seed=7, **layout)
        return booster.load_checkpoint(folder, model, opt, sched, verify=verify)

    (header,) = struct.unpack("<Q", original[weights][:8])
    damage = {weights: lambda b: b[:8 + header + 32] + os.urandom(64) + b[8 + header + 96:],
              optimizer: lambda b: b[:-100]}
    expected = {weights: "fails its checksum", optimizer: "has .* bytes; its step recorded"}
    for path, damaged in damage.items():
        if rank == 0:
            open(path, "wb").write(damaged(original[path]))
        dist.barrier()
        with pytest.raises((RuntimeError, FileNotFoundError), match=expected[path]) as caught:
            load()
        assert os.path.basename(path) in str(caught.value), str(caught.value)
        if path == weights:
            assert load(verify=False)["step"] == 2, "verify=False loads without the check"
        dist.barrier()
        if rank == 0:
            open(path, "wb").write(original[path])
        dist.barrier()
    if rank == 0:                                               # a step saved before manifests existed
        meta = json.loads(original[os.path.join(step, "meta.json")])
        del meta["files"]
        json.dump(meta, open(os.path.join(step, "meta.json"), "w"))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load()["step"] == 2
    if rank == 0:
        assert any("no file checksums" in str(w.message) for w in caught), [str(w.message) for w in caught]


def _all(rank, world, root):
    for name, layout in LAYOUTS.items():
        here = os.path.join(root, name)
        objects = _sync_equals_async(here, rank, layout)
        _one_in_flight(here, rank, *objects)
        _fault_in_the_writer(here, rank, layout, *objects)
        _damaged(here, rank, layout)
        objects[0].wait_for_checkpoint()


def test_async_save_and_checksums(tmp_path):
    spawn(_all, 2, str(tmp_path))


_KILLED = """
import os, sys, time, torch
from meshboost import Booster
from meshboost.checkpoint import file_log
from meshboost.testing.models import build_model, tiny_config
booster = Booster()
model = build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=0)
model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
booster.save_checkpoint(sys.argv[1], model, opt, step=1)

def killed(write, payload, path):             # the process dies inside the writer thread, mid-file
    write(payload, path)
    os.truncate(path, os.path.getsize(path) // 2)
    os._exit(9)

file_log.durable = killed
booster.save_checkpoint(sys.argv[1], model, opt, step=2, asynchronous=True)
time.sleep(60)
"""


def test_a_process_killed_during_the_background_write(tmp_path):
    """The whole process dies (os._exit) while its writer thread is halfway through a file: `latest` stays on
    the previous step, which loads and verifies; nothing of step 2 is committed; the next save cleans up."""
    import subprocess
    import sys

    from meshboost import Booster
    from meshboost.testing.models import build_model, tiny_config

    folder = str(tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-c", _KILLED, folder], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-2000:]
    assert open(os.path.join(folder, "latest")).read().strip() == "step-00000001"
    left = [n for n in os.listdir(folder) if n.startswith(".step-00000002.tmp-")]
    assert left and not os.path.exists(os.path.join(folder, "step-00000002")), os.listdir(folder)
    booster = Booster()
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=5)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert booster.load_checkpoint(folder, model, opt)["step"] == 1
    reference = build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.unwrap().parameters(), reference.parameters()))
    booster.save_checkpoint(folder, model, opt, step=3)
    assert not [n for n in os.listdir(folder) if n.startswith(".")], os.listdir(folder)
