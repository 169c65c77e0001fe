"""A replacement process joins the survivors (docs/recovery.md, "Growing
back"): 1 of 4 ranks dies (SIGKILL), the 3 survivors shrink, a fresh process
that was never in the job calls pycollectives.join(store) while the
survivors call comm.grow(store, 1), and an all-reduce over the 4 gives the
right result. Every run is bounded."""

from __future__ import annotations

import datetime
import os
import signal
import threading

import pytest
import torch
from spawn import run
from test_faults import expect

import pycollectives as pc

KILL = -signal.SIGKILL


def _store(rank: int, n: int, port: int) -> object:
    import torch.distributed as dist

    t = datetime.timedelta(seconds=60)
    return dist.TCPStore("127.0.0.1", port, n, rank == 0, t, wait_for_workers=False)


def _replace(rank: int, world_size: int, port: int) -> tuple:
    """Processes 0-3 make a communicator of 4; 3 dies; process 4 replaces it."""
    store = _store(rank, world_size, port)
    if rank == 4:  # the replacement: a fresh process, never in the first communicator
        grown = pc.join(store, timeout=60)
        assert (grown.rank, grown.world_size) == (3, 4)
    else:
        comm = pc.init(rank, 4, store=store, timeout=30)
        comm.barrier()
        if rank == 3:
            threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        with pytest.raises(pc.PeerFailure):
            for _ in range(1_000_000):
                comm.all_reduce(torch.ones(1 << 16))
        shrunk = comm.shrink()
        comm.close()
        assert shrunk.world_size == 3 and shrunk.failed == (3,)
        expect(ValueError, lambda: shrunk.grow(store, 0), "new_ranks")
        grown = shrunk.grow(store, 1, timeout=60)
        shrunk.close()
        assert (grown.rank, grown.world_size) == (rank, 4)
        assert grown._c.default_timeout == 30  # the communicator's, not grow's bound
    # Every rank of the grown communicator, the newcomer included, adds in.
    for numel in (3, 1 << 16):
        t = torch.full((numel,), float(1 << grown.rank))
        grown.all_reduce(t)
        assert torch.equal(t, torch.full((numel,), 15.0)), t[:3]
    x = torch.arange(4.0) if grown.rank == 0 else torch.zeros(4)
    grown.broadcast(x, 0)
    assert torch.equal(x, torch.arange(4.0))
    out = grown.parent_ranks
    grown.barrier()
    grown.close()
    return out


def test_replacement_joins_the_survivors_and_a_collective_over_four_is_right():
    import spawn

    out = run(_replace, 5, spawn.free_port(), timeout=120, expect_exit={3: KILL})
    assert out[0] == out[4] == (0, 1, 2, -1), out


def _no_grow(rank: int, world_size: int, port: int) -> str:
    store = _store(rank, world_size, port)
    return expect(pc.CollectiveTimeout, lambda: pc.join(store, timeout=0.5), "no grow")


def test_join_without_a_grow_times_out():
    import spawn

    run(_no_grow, 1, spawn.free_port(), timeout=60)


@pytest.mark.parametrize(
    ("value", "failed"),
    [
        (b"2,3;the state of rank 2 is lost", (2, 3)),
        (b"\xff\xfe;garbage \xff", ()),  # not ranks: none named, no crash
        ("²,3;unicode digits".encode(), ()),  # isdigit() but not int()-able
        (b"-1,2;negative", ()),
        (b"9" * 5000, ()),  # huge: cut, no rank of 4096 digits
        (b"", ()),
    ],
)
def test_a_refusal_from_the_store_is_checked_and_join_raises_at_once(value, failed):
    store = torch.distributed.HashStore()
    store.set("pycoll-grow/refused", value)
    with pytest.raises(pc.GrowRefused, match="pycoll-grow/refused") as got:
        pc.join(store, timeout=30)
    assert got.value.failed == failed
    assert len(str(got.value)) < 4096 + 200
