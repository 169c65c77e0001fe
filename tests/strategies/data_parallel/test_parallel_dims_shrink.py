"""ParallelDims.shrink(): after 1 of 4 ranks is killed (SIGKILL) in the middle
of the grid's collectives, the survivors rebuild the grid's sub-communicators
from the shrunk world. dp=4 goes on as dp=3; in dp=2 x tp=2 the dead rank's
tensor-parallel group lost a member: every survivor raises NeedsReplacement
naming that group, at once (the survivors waiting on a live peer are woken by
the revoke), never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from spawn import run

import pycollectives as pc
from pycollectives.strategies.parallel_dims import NeedsReplacement, ParallelDims

VICTIM = 3


def _until_failure(dims: ParallelDims) -> float:
    """Runs the grid's collectives (tp then dp, as a step would) until one
    fails here, the victim dying meanwhile; returns when it started."""
    if dims.world.rank == VICTIM:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t = torch.ones(1 << 14)
    with pytest.raises(pc.PyCollectivesError):
        for _ in range(1000000):
            dims.tp_comm.all_reduce(t)
            dims.dp_comm.all_reduce(t)
    return time.monotonic()


def _grid(rank: int, world_size: int, dp: int, tp: int) -> tuple:
    comm = pc.init(timeout=30)  # a survivor left waiting on a live peer would wait this long
    dims = ParallelDims(comm, dp=dp, tp=tp)
    start = _until_failure(dims)
    try:
        new = dims.shrink()
    except NeedsReplacement as e:
        comm.close()
        return "raised", str(e), e.failed, e.groups, time.monotonic() - start
    took = time.monotonic() - start
    # The new grid works: its dp all-reduce adds exactly the survivors.
    t = torch.full((5,), float(1 << rank))
    new.dp_comm.all_reduce(t)
    out = ("shrunk", new.sizes, new.coords, new.world.parent_ranks, t[0].item(), took)
    assert new.tp_comm.world_size == 1 and new.pp_comm.world_size == 1
    new.close()
    new.world.close()
    comm.close()
    return out


def test_pure_data_parallel_grid_shrinks_dp():
    got = run(_grid, 4, 4, 1, timeout=120, expect_exit={VICTIM: -signal.SIGKILL})
    for r in range(3):
        kind, sizes, coords, parents, total, took = got[r]
        assert kind == "shrunk" and sizes == {"pp": 1, "dp": 3, "tp": 1}, got[r]
        assert coords == {"pp": 0, "dp": r, "tp": 0} and parents == (0, 1, 2)
        assert total == 1 + 2 + 4 and took < 10.0, got[r]


def test_tensor_parallel_group_that_lost_a_member_needs_a_replacement():
    got = run(_grid, 4, 2, 2, timeout=120, expect_exit={VICTIM: -signal.SIGKILL})
    for r in range(3):
        kind, msg, failed, groups, took = got[r]
        assert kind == "raised" and failed == (VICTIM,) and groups == {"tp": [[2, 3]]}, got[r]
        assert f"rank {r}:" in msg and "rank 3 (dp=1, tp=1, pp=0) failed" in msg, msg
        assert "the tp group of world ranks [2, 3]" in msg and "grow" in msg, msg
        # Rank 0 waited in a dp all-reduce with rank 2, which is alive: the
        # revoke woke it, well before the communicator's 30 s timeout.
        assert took < 10.0, got[r]


def test_shrink_without_a_failure_keeps_the_grid():
    got = run(_no_failure, 4, timeout=90)
    # dp groups {0, 2} and {1, 3}, as before.
    assert got == [({"pp": 1, "dp": 2, "tp": 2}, t) for t in (4.0, 6.0, 4.0, 6.0)]


def _no_failure(rank: int, world_size: int) -> tuple:
    comm = pc.init(timeout=30)
    with ParallelDims(comm, dp=2, tp=2) as dims:
        new = dims.shrink()  # nobody failed: the same grid, rebuilt
    t = torch.full((1,), float(rank + 1))
    new.dp_comm.all_reduce(t)
    new.close()
    new.world.close()
    comm.close()
    return new.sizes, t.item()
