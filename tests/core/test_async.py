"""Asynchronous operations: several in flight complete in issue order while
Python computes, and Work reports errors."""

from __future__ import annotations

import time
import weakref

import torch

import pycollectives as pc


def job_in_order(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    bufs = [torch.full((200_000,), float(r + k)) for k in range(8)]
    works = [comm.all_reduce(b, async_op=True) for b in bufs]
    # Python keeps computing while the progress thread communicates.
    x = torch.randn(256, 256)
    for _ in range(20):
        x = torch.tanh(x @ x.T / 256)
    completed = [w.is_completed() for w in works]
    # Completion follows issue order: a later op is never done before an earlier one.
    if any(completed[i + 1] and not completed[i] for i in range(len(works) - 1)):
        bad.append(f"completion out of order: {completed}")
    for w in works:
        assert w.wait() is True
    for k, b in enumerate(bufs):
        want = sum(p + k for p in range(n))
        if not torch.all(b == want):
            bad.append(f"buffer {k}: got {b[0].item()} want {want}")
    # A synchronous call after async ones runs after them.
    t = torch.full((10,), 1.0)
    w = comm.all_reduce(torch.full((1 << 20,), 1.0), async_op=True)
    comm.all_reduce(t)
    if not w.is_completed():
        bad.append("sync op returned before the earlier async op completed")
    return bad


def test_async_in_order(pool):
    for r, bad in enumerate(pool(3).run(job_in_order)):
        assert not bad, f"rank {r}: {bad}"


def job_wait_timeout(comm: pc.Communicator) -> tuple:
    # Rank 0 issues first and waits with a short timeout while rank 1 is late.
    t = torch.ones(4)
    if comm.rank == 0:
        w = comm.all_reduce(t, async_op=True)
        early = w.wait(timeout=0.05)
        done = w.wait()
        return early, done, w.exception(), float(t[0])
    time.sleep(0.5)
    comm.all_reduce(t)
    return None, None, None, float(t[0])


def test_work_wait_timeout_returns_false(pool):
    res = pool(2).run(job_wait_timeout)
    early, done, exc, val = res[0]
    assert early is False and done is True and exc is None and val == 2.0


def job_dropped_work_keeps_buffers(comm: pc.Communicator) -> tuple:
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0's operation stays in flight meanwhile
    t = torch.ones(1 << 16)
    ref = weakref.ref(t)
    comm.all_reduce(t, async_op=True)  # the Work is dropped at once
    del t
    alive_in_flight = ref() is not None
    comm.barrier()
    comm.all_reduce(torch.ones(1), async_op=True).wait()  # prunes completed operations
    return alive_in_flight, ref() is None


def test_dropped_work_keeps_its_buffers_until_done(pool):
    (alive, released), _ = pool(2).run(job_dropped_work_keeps_buffers)
    assert alive, "the tensor of an in-flight operation was freed"
    assert released, "the tensor was kept after its operation completed"
