"""Small messages: the one-shot areas' inline line (a payload of up to 40 bytes
travels in its flag's cache line, larger ones after it), the synchronous
all_reduce as a C callable (Communicator.all_reduce without a Python frame),
the GIL kept while a small call spins and let go once it blocks, ranks pinned
to one CPU waiting on each other (they yield at once) and ranks pinned apart
(they spin where they would yield)."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

import pycollectives as pc

# Around the 40 bytes that fit the flag's line: both sides of the boundary, in
# an order that moves between them from one operation (and parity) to the next.
SIZES = [8, 40, 44, 4, 36, 64, 40, 8, 48, 40]


def job_inline_boundary(comm: pc.Communicator) -> list[str]:
    """Every one-shot collective at sizes on both sides of the inline limit,
    checked exactly, for float32 and int64."""
    n, r, bad = comm.world_size, comm.rank, []
    for dtype in (torch.float32, torch.int64):
        es = torch.tensor([], dtype=dtype).element_size()
        for rep in range(2):
            for nbytes in SIZES:
                k = max(nbytes // es, 1)
                base = torch.arange(k, dtype=dtype)
                t = base + (r + 1) * (rep + 1)
                comm.all_reduce(t)
                want = base * n + (rep + 1) * n * (n + 1) // 2
                if not torch.equal(t, want):
                    bad.append(f"all_reduce {dtype} {k}: {t.tolist()} != {want.tolist()}")
                inp = torch.arange(k * n, dtype=dtype) + r
                out = torch.full((k,), -1, dtype=dtype)
                comm.reduce_scatter(out, inp)
                want = torch.arange(r * k, (r + 1) * k, dtype=dtype) * n + n * (n - 1) // 2
                if not torch.equal(out, want):
                    bad.append(f"reduce_scatter {dtype} {k}: {out.tolist()} != {want.tolist()}")
                g = torch.full((k * n,), -1, dtype=dtype)
                comm.all_gather(g, base + r)
                want = torch.cat([base + q for q in range(n)])
                if not torch.equal(g, want):
                    bad.append(f"all_gather {dtype} {k}: {g.tolist()} != {want.tolist()}")
                b = base + 100 * r
                comm.broadcast(b, n - 1)
                if not torch.equal(b, base + 100 * (n - 1)):
                    bad.append(f"broadcast {dtype} {k}: {b.tolist()}")
    return bad


def job_fast_method(comm: pc.Communicator) -> list[str]:
    """comm.all_reduce is a C callable with the method's doc; keywords, async_op,
    timeout and declined arguments reach the Python method; it does not keep
    its communicator alive (no cycle through the instance's __dict__)."""
    n, bad = comm.world_size, []
    if type(comm.all_reduce).__name__ != "FastMethod":
        bad.append(f"comm.all_reduce is a {type(comm.all_reduce)}")
    if comm.all_reduce.__doc__ != pc.Communicator.all_reduce.__doc__:
        bad.append(f"doc: {comm.all_reduce.__doc__!r}")
    calls = [
        ("positional op", lambda t: comm.all_reduce(t, pc.ReduceOp.MAX), lambda q: q),
        ("int op", lambda t: comm.all_reduce(t, 3), lambda q: q),
        ("keyword op", lambda t: comm.all_reduce(t, op=pc.ReduceOp.MIN), lambda q: 0),
        ("keyword tensor", lambda t: comm.all_reduce(tensor=t), lambda q: q * (q + 1) // 2),
        ("timeout", lambda t: comm.all_reduce(t, timeout=30), lambda q: q * (q + 1) // 2),
        ("async", lambda t: comm.all_reduce(t, async_op=True).wait(), lambda q: q * (q + 1) // 2),
    ]
    for what, call, want in calls:
        t = torch.full((2,), float(comm.rank), dtype=torch.float64)
        call(t)
        if t.tolist() != [float(want(n - 1))] * 2:
            bad.append(f"{what}: {t.tolist()}")
    for args in [(), (torch.zeros(1), 0, 0)]:
        try:
            comm.all_reduce(*args)
            bad.append(f"{len(args)} arguments: no error")
        except TypeError:
            pass
    sub = comm.split(0)
    ref = weakref.ref(sub)
    method = sub.all_reduce
    gc.disable()
    try:
        sub.close()
        del sub
        if ref() is not None:
            bad.append("a split communicator outlived its last reference (a cycle?)")
    finally:
        gc.enable()
    try:
        method(torch.zeros(2), op=pc.ReduceOp.SUM)  # the method's path needs the communicator
        bad.append("a FastMethod of a dead communicator ran its method")
    except ReferenceError:
        pass
    return bad


def job_gil_released_while_waiting(comm: pc.Communicator) -> list[str]:
    """A small synchronous all-reduce that waits for a late peer lets another
    Python thread run meanwhile, run inline and when queued behind an
    asynchronous operation."""
    bad = []
    for queued in (False, True):
        comm.barrier()
        if comm.rank != 0:
            time.sleep(0.4)
            if queued:
                comm.all_reduce(torch.ones(1 << 16), async_op=True).wait()
            comm.all_reduce(torch.ones(2))
            continue
        counts, stop = [0], threading.Event()

        def spin(counts: list[int], stop: threading.Event) -> None:
            while not stop.is_set():
                counts[0] += 1

        thread = threading.Thread(target=spin, args=(counts, stop))
        work = comm.all_reduce(torch.ones(1 << 16), async_op=True) if queued else None
        thread.start()
        time.sleep(0.01)
        before = counts[0]
        t = torch.ones(2)
        comm.all_reduce(t)  # waits ~0.4 s for the other ranks
        during = counts[0] - before
        stop.set()
        thread.join()
        if work is not None:
            work.wait()
        if t.tolist() != [float(comm.world_size)] * 2:
            bad.append(f"queued={queued}: {t.tolist()}")
        if during < 1000:
            bad.append(f"queued={queued}: the other thread ran {during} times while it waited")
    return bad


def job_one_cpu(comm: pc.Communicator) -> list[str]:
    """Every rank pinned to the same CPU (each waits on peers that can only run
    once it yields): a child communicator made there gets every result right."""
    cpus = sorted(os.sched_getaffinity(0))
    bad = []
    os.sched_setaffinity(0, {cpus[0]})
    try:
        sub = comm.split(0)
        try:
            n = sub.world_size
            for i in range(300):
                t = torch.tensor([float(sub.rank + i), 1.0])
                sub.all_reduce(t)
                want = [float(n * i + n * (n - 1) // 2), float(n)]
                if t.tolist() != want:
                    bad.append(f"call {i}: {t.tolist()} != {want}")
                    break
        finally:
            sub.close()
    finally:
        os.sched_setaffinity(0, set(cpus))
    return bad


def job_pinned_apart(comm: pc.Communicator) -> list[str]:
    """Every rank pinned to a CPU of its own (its waits spin instead of
    yielding): a late peer is waited for, and a timeout still fires."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < comm.world_size:
        return []  # needs a CPU per rank
    bad = []
    os.sched_setaffinity(0, {cpus[comm.rank]})
    try:
        sub = comm.split(0)
        try:
            if sub.rank == 1:
                time.sleep(0.3)
            t = torch.ones(2)
            sub.all_reduce(t)  # rank 0 spins ~1 ms, then sleeps until rank 1 comes
            if t.tolist() != [float(sub.world_size)] * 2:
                bad.append(f"late peer: {t.tolist()}")
            if sub.rank == 0:
                start = time.monotonic()
                try:
                    sub.all_reduce(t, timeout=0.3)  # nobody else comes
                    bad.append("no timeout")
                except pc.CollectiveTimeout:
                    if time.monotonic() - start > 10:
                        bad.append(f"timed out after {time.monotonic() - start:.1f} s")
            comm.barrier()
        finally:
            sub.close()
    finally:
        os.sched_setaffinity(0, set(cpus))
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "job",
    [
        job_inline_boundary,
        job_fast_method,
        job_gil_released_while_waiting,
        job_one_cpu,
        job_pinned_apart,
    ],
    ids=lambda j: j.__name__[4:],
)
def test_small_messages(pool, job, world_size):
    results = pool(world_size).run(job, timeout=180)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)
