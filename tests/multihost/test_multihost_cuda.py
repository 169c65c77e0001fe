"""CUDA tensors across hosts: 2 hosts x 1 rank (network namespaces, netns.py),
every collective and point-to-point operation on CUDA tensors, which go
through pinned host buffers (pycollectives/_staging.py). Marked `cuda`:
skipped without a CUDA device (staging needs torch.cuda only, not a CUDA build
of pycollectives) or without root for the namespaces.

Checks, all exact: the one-host suite's jobs (every collective, dtype and op,
sizes up to past several slots; test_cuda_collectives.OnCuda runs them on CUDA
copies of their tensors); asynchronous operations issued on a side stream and
waited for on another (the waiting stream reads the result), is_completed()
and synchronize(); a producer kernel still running when the operation is
issued (the copy in waits for it on the current stream); send/recv, receives
from any source, batch_p2p mixing CUDA and CPU buffers; the pinned buffers
reused across calls; errors naming the argument, the rank and the operation.
The staging logic itself runs on the CPU in tests/multihost/test_staging.py."""

from __future__ import annotations

import functools
import time

import netns
import pytest
import test_collectives as tc
import test_cuda_collectives as tcc
import torch
from multihost_jobs import run_on_hosts

import pycollectives as pc

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
]

SIZES = (0, 1, 7, 1000, 3 * 65536 + 5)


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def _dev(comm: pc.Communicator) -> torch.device:
    return torch.device("cuda", comm.rank % torch.cuda.device_count())


def job_streams(comm: pc.Communicator) -> list[str]:
    """Asynchronous operations and stream order."""
    dev, r, n, bad = _dev(comm), comm.rank, comm.world_size, []
    torch.cuda.set_device(dev)
    base = torch.arange(100_003, device=dev, dtype=torch.float32) % 101
    side, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = base * (r + 1)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        w = comm.all_reduce(x, async_op=True)
    with torch.cuda.stream(other):
        if not w.wait():
            bad.append("wait() returned False")
        y = x * 1  # on `other`: ordered after the copy back by wait()
    other.synchronize()
    if not torch.equal(y, base * (n * (n + 1) // 2)):
        bad.append("async all_reduce read on the waiting stream differs")
    # is_completed() alone: polled until true, the result then in place.
    g = torch.empty(n * 5, device=dev, dtype=torch.int64)
    w = comm.all_gather(g, torch.full((5,), r, device=dev, dtype=torch.int64), async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not w.is_completed():
        bad.append("all_gather never completed")
    elif not torch.equal(g.cpu(), torch.arange(n).repeat_interleave(5)):
        bad.append("all_gather completed but its output differs")
    w = comm.broadcast(x, 0, async_op=True)
    w.synchronize()
    if not torch.equal(x, base * (n * (n + 1) // 2)):
        bad.append("broadcast after synchronize differs")
    # A producer still running at issue: the copy in waits for it on the stream.
    z = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(100_000_000)
    z.fill_(r + 1.0)
    comm.all_reduce(z)
    if not bool((z == n * (n + 1) / 2).all()):
        bad.append("all_reduce read its tensor before the producer kernel wrote it")
    return bad


def job_p2p(comm: pc.Communicator) -> list[str]:
    """send/recv, any source, batch_p2p with CUDA and CPU buffers, async."""
    dev, r, bad = _dev(comm), comm.rank, []
    peer = 1 - r
    a = torch.arange(70_001, device=dev, dtype=torch.bfloat16) % 37 + r
    got = torch.empty_like(a)
    if r == 0:
        comm.send(a, 1)
        src = comm.recv(got, None)
    else:
        src = comm.recv(got, 0)
        comm.send(a, 0)
    want = torch.arange(70_001, device=dev, dtype=torch.bfloat16) % 37 + peer
    if src != peer or not torch.equal(got, want):
        bad.append(f"send/recv: source {src}, equal {torch.equal(got, want)}")
    cpu_out, cpu_in = torch.empty(9, dtype=torch.int32), torch.full((9,), r, dtype=torch.int32)
    got = torch.empty_like(a)
    ops = [("send", a, peer), ("recv", got, peer), ("send", cpu_in, peer), ("recv", cpu_out, peer)]
    w = comm.batch_p2p(ops, async_op=True)
    w.wait()
    if not (torch.equal(got, want) and bool((cpu_out == peer).all())):
        bad.append("batch_p2p with CUDA and CPU buffers differs")
    return bad


def job_cache_and_errors(comm: pc.Communicator) -> list[str]:
    dev, r, bad = _dev(comm), comm.rank, []
    x = torch.ones(4096, device=dev)
    comm.all_reduce(x)
    made = comm._stager.cache.allocated
    for _ in range(20):
        comm.all_reduce(x)
    if comm._stager.cache.allocated != made:
        bad.append(f"pinned buffers made per call: {made} -> {comm._stager.cache.allocated}")
    cases = [
        (lambda: comm.all_gather(torch.empty(8, device=dev), torch.ones(4)), "input is on cpu"),
        (lambda: comm.broadcast(x, 5), "broadcast: src=5"),
        (lambda: comm.reduce_scatter(torch.empty(3, device=dev), x), "reduce_scatter: input has"),
        (lambda: comm.all_reduce(x[::2]), "all_reduce: tensor is not contiguous"),
    ]
    for fn, want in cases:
        try:
            fn()
            bad.append(f"no error for {want}")
        except ValueError as e:
            if f"rank {r}" not in str(e) or want not in str(e):
                bad.append(f"error {e!r} does not name {want!r} and rank {r}")
    y = torch.ones(3, device=dev)
    comm.all_reduce(y)  # still usable
    return bad + ([] if bool((y == 2).all()) else ["all_reduce after the errors"])


def job_everything(comm: pc.Communicator) -> list[str]:
    bad = []
    cases = tc._cases
    tc._cases = functools.partial(cases, sizes=SIZES)  # the jobs look it up when they run
    try:
        for job in tcc.CUDA_JOBS:
            bad += [f"{job.__name__}: {x}" for x in job(comm)]
    finally:
        tc._cases = cases
    bad += job_streams(comm) + job_p2p(comm) + job_cache_and_errors(comm)
    if comm._stager is None:
        bad.append("the CUDA tensors did not go through staging")
    return bad


def test_cuda_tensors_across_two_hosts(fabric):
    for r, bad in enumerate(run_on_hosts(fabric, [0, 1], job_everything, timeout=300)):
        assert not bad, f"rank {r}: " + "\n".join(bad[:20])
