"""Checkpoints are safe against other saves, dead saves and damaged files (issue 23, points 3, 8, 9).

- A save while another live save writes the same target (another job, another process) is refused on
  every rank naming the other save's pid, and nothing of that save is touched: its staging folder
  survives and it commits afterwards (HF model folder at pp=2, where rank 0 takes the lock before the
  stage writers agree on a folder; a training-checkpoint folder).
- A save that was killed (SIGKILL) while holding the lock and having staged does not block the next
  one, which removes its staging folder and its stale lock.
- On a file system without RENAME_EXCHANGE, a save killed between its two renames leaves the old
  checkpoint aside; the loaders put it back before anything else (load_model after a real crash,
  load_optimizer and load_checkpoint on two ranks at once), but not while a live save holds the lock.
- A truncated .safetensors (or .bin) names the file and says what to do.
- save_checkpoint / load_checkpoint onto a regular file: a clear error on every rank.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.checkpoint import atomic, load_model, save_model
from meshboost.checkpoint.atomic import AtomicTarget, SaveInProgress, SaveLock, lock_file_of
from meshboost.checkpoint.step_io import _prepare
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_config

_FORK = multiprocessing.get_context("fork")     # children share the imports: no second torch start-up


def _model(seed=0):
    return build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=seed)


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


# -- other processes: a live save (holds the lock, has staged, commits when told), a dead one --------
def _live_save(conn, target, kind):
    """A save in another process: 'model' stages a folder through AtomicTarget, 'lock' only holds the
    lock (a save between its two renames), 'run' holds a training-checkpoint folder's lock and stages a
    step. Reports (pid, staging), then waits: 'commit' finishes the save, 'exit' lets it die."""
    if kind == "model":
        save = AtomicTarget(target, is_file=False)
        with open(os.path.join(save.path, "weights"), "w") as fh:
            fh.write("written by the live save")
        staging, finish = save.staging, save.commit
    elif kind == "lock":
        lock = SaveLock(lock_file_of(target), target).acquire()
        staging, finish = None, lock.release
    else:
        lock = _prepare(target, "step-00000007")
        staging = os.path.join(target, ".step-00000007.tmp-live")
        os.makedirs(staging)

        def finish():                                   # this save gives up: its staging, then its lock
            shutil.rmtree(staging)
            lock.release()
    conn.send((os.getpid(), staging))
    if conn.recv() == "commit":
        finish()
        conn.send("committed")
    conn.close()


def _start(target, kind):
    parent, child = _FORK.Pipe()
    process = _FORK.Process(target=_live_save, args=(child, str(target), kind), daemon=True)
    process.start()
    assert parent.poll(60), f"the {kind} save did not start"
    pid, staging = parent.recv()
    return process, parent, pid, staging


def _finish(process, conn):
    conn.send("commit")
    assert conn.poll(60) and conn.recv() == "committed", "the live save could not commit"
    process.join(30)
    assert process.exitcode == 0


def _crash_between_renames(target, save):
    """Run `save` in a child on a file system without RENAME_EXCHANGE, killed (no clean-up runs) at the
    rename that would put the new folder at `target`."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            real = os.replace
            atomic.exchange = lambda a, b: False

            def replace(src, dst):
                if os.path.abspath(dst) == os.path.abspath(target):
                    os._exit(17)                        # killed between the two renames
                real(src, dst)
            os.replace = replace
            save()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17, "the save was not interrupted between its renames"


# -- one process ---------------------------------------------------------------------------------
def test_loaders_put_back_a_checkpoint_a_crash_left_aside(tmp_path):
    target = str(tmp_path / "model")
    model = _model()
    save_model(model, target, shard=True, use_safetensors=True, size_per_shard=0.02)
    saved = _weights(model)
    _crash_between_renames(target, lambda: save_model(_model(seed=1), target, shard=True, use_safetensors=True))
    assert not os.path.exists(target), "the crash must leave the path empty (the fallback's two renames)"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.old-")], list(tmp_path.iterdir())

    # a live save holding the lock is between its renames: the loader says so and touches nothing
    process, conn, pid, _ = _start(target, "lock")
    with pytest.raises(SaveInProgress, match=f"save in progress .*pid {pid} "):
        load_model(_model(seed=2), target)
    assert not os.path.exists(target)
    _finish(process, conn)

    loaded = _model(seed=2)
    load_model(loaded, target)                      # the first thing a restart does
    got = _weights(loaded)
    assert all(torch.equal(got[n], t) for n, t in saved.items()), "the old checkpoint must come back whole"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[1:] == ["model"] and left[0].startswith(".model.tmp-"), left   # the dead save's staging...
    save_model(loaded, target, shard=True, use_safetensors=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "...goes with the next save"


def test_a_truncated_weight_file_is_named(tmp_path):
    model = _model()
    for name, kwargs in [("one", dict(use_safetensors=True)),
                         ("sharded", dict(shard=True, use_safetensors=True, size_per_shard=0.02)),
                         ("bin", dict(use_safetensors=False))]:
        folder = tmp_path / name
        save_model(model, str(folder), **kwargs)
        path = max(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))   # the last shard
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        with pytest.raises(RuntimeError, match="truncated or corrupt") as err:
            load_model(_model(seed=1), str(folder))
        assert str(path) in str(err.value) and "Save the checkpoint again" in str(err.value), err.value


# -- a process group of 2 ranks: pipeline saves, training checkpoints, concurrent loaders ---------------
def _on_rank0_crash_commit(rank, target):
    """Rank 0 (the committing rank) on a file system without RENAME_EXCHANGE, where both renames onto
    `target` fail: the old folder stays aside, as after a crash between them. Returns the undo."""
    if rank != 0:
        return lambda: None
    real_exchange, real_replace = atomic.exchange, os.replace

    def replace(src, dst):
        if os.path.abspath(dst) == os.path.abspath(target):
            raise OSError("the mount went away (simulated)")
        real_replace(src, dst)
    atomic.exchange, os.replace = (lambda a, b: False), replace

    def undo():
        atomic.exchange, os.replace = real_exchange, real_replace
    return undo


def _ranks(rank, world, root, live_pid, run_pid):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, microbatch_size=2)
    booster = Booster(plugin=plugin)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    own = SaveInProgress if rank == 0 else RuntimeError    # rank 0 takes the lock; the others quote it

    # 3. another live save of the same target: refused on every rank, its staging untouched
    with pytest.raises(own, match=f"another save is writing checkpoint .*live_model.*pid {live_pid} "):
        booster.save_model(model, os.path.join(root, "live_model"), shard=True)
    with pytest.raises(own, match=f"another save is writing checkpoint .*run.*pid {run_pid} "):
        booster.save_checkpoint(os.path.join(root, "run"), model, opt, sched, step=8)
    assert os.path.isdir(os.path.join(root, "run", ".step-00000007.tmp-live")), "a live save's staging was removed"
    # ... and a dead one (SIGKILL while holding the lock, having staged) blocks nothing
    booster.save_model(model, os.path.join(root, "dead_model"), shard=True, use_safetensors=True)

    # 8. both renames onto the path fail (the fallback's crash window): the loaders of every rank
    # (at once) put the old folder back
    opt_path = os.path.join(root, "optimizer")
    booster.save_optimizer(opt, opt_path, shard=True)
    undo = _on_rank0_crash_commit(rank, opt_path)
    try:
        with pytest.raises(OSError if rank == 0 else RuntimeError, match="simulated"):
            booster.save_optimizer(opt, opt_path, shard=True)
    finally:
        undo()
    assert not os.path.exists(opt_path) and any(n.startswith(".optimizer.old-") for n in os.listdir(root))
    dist.barrier()
    booster.load_optimizer(opt, opt_path)
    run8 = os.path.join(root, "run8")
    booster.save_checkpoint(run8, model, opt, sched, step=1, extra={"saved": "first"})
    step = os.path.join(run8, "step-00000001")
    undo = _on_rank0_crash_commit(rank, step)
    try:
        with pytest.raises(OSError if rank == 0 else RuntimeError, match="simulated"):
            booster.save_checkpoint(run8, model, opt, sched, step=1, extra={"saved": "second"})
    finally:
        undo()
    assert not os.path.exists(step) and any(n.startswith(".step-00000001.old-") for n in os.listdir(run8))
    dist.barrier()
    meta = booster.load_checkpoint(run8, model, opt, sched)
    assert meta["step"] == 1 and meta["extra"] == {"saved": "first"}, meta

    # 9b. a training checkpoint onto a regular file: a clear error on every rank
    afile = os.path.join(root, "afile")
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="is a file; pass a folder path"):
        booster.save_checkpoint(afile, model, opt, sched, step=1)
    with pytest.raises(ValueError, match="is a file; pass the folder save_checkpoint wrote"):
        booster.load_checkpoint(afile, model, opt, sched)
    dist.barrier()


def test_concurrent_dead_and_crashed_saves_on_two_ranks(tmp_path):
    root = tmp_path
    (root / "afile").write_text("not a folder")
    live, live_conn, live_pid, live_staging = _start(root / "live_model", "model")
    run, run_conn, run_pid, _ = _start(root / "run", "run")
    dead, _, _, dead_staging = _start(root / "dead_model", "model")
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(30)
    assert os.path.isdir(dead_staging) and os.path.exists(root / ".dead_model.lock")
    try:
        spawn(_ranks, 2, str(root), live_pid, run_pid)
        assert os.path.isdir(live_staging), "the refused save removed the live save's staging folder"
    finally:
        _finish(live, live_conn)
        _finish(run, run_conn)
    assert (root / "live_model" / "weights").read_text() == "written by the live save"
    leftovers = sorted(n for n in os.listdir(root) if n.startswith("."))
    assert leftovers == [], f"staging folders or locks left behind: {leftovers}"
    assert sorted(os.listdir(root / "run")) == [], "the refused save must not write into the live save's folder"
    assert sorted(os.listdir(root / "run8")) == ["latest", "step-00000001"]
    load_model(_model(seed=3), str(root / "dead_model"))
