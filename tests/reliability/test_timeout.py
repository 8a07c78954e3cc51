"""A stalled peer fails the others with a named error after the timeout, instead of a hang: the
timeout comes from launch (here the MESHBOOST_DIST_TIMEOUT environment variable) and every group the
mesh builds inherits it (torch would give new groups its own 30 min default)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from meshboost.distributed import ParallelDims, ParallelMesh, comm
from meshboost.distributed.comm import CollectiveTimeout
from meshboost.distributed.launch import TIMEOUT_ENV, group_timeout, resolve_timeout
from meshboost.testing import spawn

SECONDS = 3


def _body(rank, world):
    mesh = ParallelMesh(ParallelDims(tp=2, pp=2))
    limit = datetime.timedelta(seconds=SECONDS)
    assert group_timeout() == limit
    for axis in ("dp", "pp", "tp"):
        assert group_timeout(mesh.group(axis)) == limit, f"{axis} group did not inherit the timeout"
    assert group_timeout(mesh.tied_stage_group()) == limit
    if rank == 1:
        time.sleep(SECONDS + 5)                         # a stalled peer (a hung data loader, a dead node)
        return
    if rank == 0:
        start = time.perf_counter()
        with pytest.raises(CollectiveTimeout, match=rf"all_reduce over ranks \[0, 1\] did not complete within "
                                                    rf"0:00:0{SECONDS}.*{TIMEOUT_ENV}"):
            comm.all_reduce(torch.ones(1), mesh.tp_group)
        assert time.perf_counter() - start < SECONDS + 4, "the error must come after the timeout, not much later"


def test_stalled_peer_raises_collective_timeout(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, str(SECONDS))
    spawn(_body, 4)


def test_timeout_values_are_checked(monkeypatch):
    assert resolve_timeout(2.5) == datetime.timedelta(seconds=2.5)
    assert resolve_timeout(datetime.timedelta(minutes=1)) == datetime.timedelta(minutes=1)
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(None) is None                # torch's own default
    monkeypatch.setenv(TIMEOUT_ENV, "90")
    assert resolve_timeout(None) == datetime.timedelta(seconds=90)
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='soon' is not a number of seconds"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="timeout=0 must be a positive number"):
        resolve_timeout(0)
