"""Every collective x world size 1-4 x sizes {0, 1, 7, 1000, 2^20+3} x every
dtype x op, exact on small-integer data (any summation order gives the same
answer), on a pool of live ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from spawn import RankPool

import pycollectives as pc

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]
SIZES = [0, 1, 7, 1000, 2**20 + 3]
OPS = [pc.ReduceOp.SUM, pc.ReduceOp.PROD, pc.ReduceOp.MIN, pc.ReduceOp.MAX, pc.ReduceOp.AVG]
WORLD_SIZES = [1, 2, 3, 4]


def _values(
    ranks: torch.Tensor, start: int, stop: int, op: pc.ReduceOp, signed: bool
) -> torch.Tensor:
    """The ranks' small integers at elements [start, stop) (int64, [len(ranks), stop - start])."""
    i = torch.arange(start, stop, dtype=torch.int64)
    r = ranks.to(torch.int64).unsqueeze(1)
    if op == pc.ReduceOp.PROD:  # |product| <= 16 over 4 ranks
        table = torch.tensor([1, 2, -1] if signed else [1, 2, 1])
        return table[(i + r) % 3]
    # values in [-3, 3] (signed) or [0, 6]; varies along i and across ranks
    return (i * 5 + i // 7 + r * 3) % 7 - (3 if signed else 0)


@functools.lru_cache(maxsize=4)
def _row(rank: int, count: int, op: pc.ReduceOp, signed: bool) -> torch.Tensor:
    """One rank's data (int64), computed once per shape and cast to each dtype by the caller."""
    return _values(torch.tensor([rank]), 0, count, op, signed)[0]


@functools.lru_cache(maxsize=4)
def _pattern(n: int, start: int, stop: int, op: pc.ReduceOp, signed: bool) -> tuple:
    """Every rank's data at elements [start, stop) (int64, [n, stop - start]) and its
    exact reduction (float64): only the part a rank checks, once per shape."""
    v = _values(torch.arange(n), start, stop, op, signed)
    f = v.to(torch.float64)
    if op == pc.ReduceOp.SUM:
        red = f.sum(0)
    elif op == pc.ReduceOp.PROD:
        red = f.prod(0)
    elif op == pc.ReduceOp.MIN:
        red = f.min(0).values
    elif op == pc.ReduceOp.MAX:
        red = f.max(0).values
    else:
        red = f.sum(0) / n
    return v, red


def data(rank: int, count: int, dtype: torch.dtype, op: pc.ReduceOp, n: int) -> torch.Tensor:
    """Rank `rank`'s small integers: their reduction over n ranks is exact in every dtype."""
    return _row(rank, count, op, dtype != torch.uint8).to(dtype, copy=True)


def reference(
    n: int, count: int, dtype: torch.dtype, op: pc.ReduceOp, part: slice = slice(None)
) -> torch.Tensor:
    """The exact reduction of data(0..n-1)[part], in `dtype` (integer sums wrap, AVG
    truncates)."""
    start, stop, _ = part.indices(count)
    red = _pattern(n, start, stop, op, dtype != torch.uint8)[1]
    if dtype.is_floating_point:
        return red.to(dtype)
    if op == pc.ReduceOp.AVG:
        red = torch.trunc(red)
    bits = torch.iinfo(dtype).bits
    r = red.to(torch.int64)
    if dtype == torch.uint8:
        r = r % 256
    elif bits < 64:
        r = (r + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1)
    return r.to(dtype)


def mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.view(-1).to(torch.float64) != want.view(-1).to(torch.float64)).sum())


def _cases(dtypes=DTYPES, ops=OPS, sizes=SIZES):
    for size in sizes:  # op before dtype: one cached pattern serves every dtype
        for op in ops:
            for dtype in dtypes:
                yield size, dtype, op


def job_all_reduce(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, op in _cases():
        t = data(r, size, dtype, op, n)
        comm.all_reduce(t, op)
        want = reference(n, size, dtype, op)
        if k := mismatches(t, want):
            bad.append(f"all_reduce size={size} {dtype} {op.name}: {k} wrong")
    return bad


def job_reduce_scatter(comm: pc.Communicator) -> list[str]:
    """`size` is the output's, except the largest: there the input keeps about
    2^20 elements at every world size (the output 2^20 // n + 3, odd-sized), the
    bytes the other collectives' largest case moves, instead of n times them."""
    n, r, bad = comm.world_size, comm.rank, []
    sizes = [s if s < 2**20 else 2**20 // n + 3 for s in SIZES]
    for size, dtype, op in _cases(sizes=sizes):
        inp = data(r, size * n, dtype, op, n)
        out = torch.full((size,), 99).to(dtype)
        comm.reduce_scatter(out, inp, op)
        want = reference(n, size * n, dtype, op, slice(r * size, (r + 1) * size))
        if k := mismatches(out, want):
            bad.append(f"reduce_scatter size={size} {dtype} {op.name}: {k} wrong")
    return bad


def job_all_gather(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, _ in _cases(ops=[pc.ReduceOp.SUM]):
        out = torch.full((size * n,), 99).to(dtype)
        comm.all_gather(out, data(r, size, dtype, pc.ReduceOp.SUM, n))
        want = _pattern(n, 0, size, pc.ReduceOp.SUM, dtype != torch.uint8)[0].reshape(-1).to(dtype)
        if k := mismatches(out, want):
            bad.append(f"all_gather size={size} {dtype}: {k} wrong")
    return bad


def job_broadcast(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, _ in _cases(ops=[pc.ReduceOp.SUM]):
        for root in sorted({0, n - 1}):
            t = data(r, size, dtype, pc.ReduceOp.SUM, n)
            comm.broadcast(t, root)
            if k := mismatches(t, data(root, size, dtype, pc.ReduceOp.SUM, n)):
                bad.append(f"broadcast size={size} {dtype} root={root}: {k} wrong")
    return bad


def job_reduce(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, op in _cases():
        for root in sorted({0, n - 1}):
            t = data(r, size, dtype, op, n)
            comm.reduce(t, root, op)
            want = reference(n, size, dtype, op) if r == root else data(r, size, dtype, op, n)
            if k := mismatches(t, want):
                bad.append(f"reduce size={size} {dtype} {op.name} root={root}: {k} wrong")
    return bad


def job_all_to_all(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, _ in _cases(ops=[pc.ReduceOp.SUM]):
        mine = slice(r * size, (r + 1) * size)  # every rank's block for this rank
        out = torch.full((size * n,), 99).to(dtype)
        comm.all_to_all(out, data(r, size * n, dtype, pc.ReduceOp.SUM, n))
        signed = dtype != torch.uint8
        want = _pattern(n, mine.start, mine.stop, pc.ReduceOp.SUM, signed)[0].reshape(-1).to(dtype)
        if k := mismatches(out, want):
            bad.append(f"all_to_all size={size} {dtype}: {k} wrong")
    return bad


def job_send_recv(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    if n == 1:
        return bad
    nxt, prv = (r + 1) % n, (r - 1) % n
    for size, dtype, _ in _cases(ops=[pc.ReduceOp.SUM]):
        out = data(r, size, dtype, pc.ReduceOp.SUM, n)
        got = torch.full((size,), 99).to(dtype)
        # Even ranks send first, odd ranks receive first: no cycle of blocked sends.
        if r % 2 == 0:
            comm.send(out, nxt)
            comm.recv(got, prv)
        else:
            comm.recv(got, prv)
            comm.send(out, nxt)
        if k := mismatches(got, data(prv, size, dtype, pc.ReduceOp.SUM, n)):
            bad.append(f"send/recv size={size} {dtype}: {k} wrong")
    comm.barrier()
    return bad


JOBS = [
    job_all_reduce,
    job_reduce_scatter,
    job_all_gather,
    job_broadcast,
    job_reduce,
    job_all_to_all,
    job_send_recv,
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.__name__[4:])
def test_collective_exact(pool, job, world_size):
    results = pool(world_size).run(job, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad[:40])


@pytest.fixture(scope="module")
def ring_pool():
    """3 ranks with the ring forced (PYCOLL_ALGO=ring), shared by the tests below."""
    ring = RankPool(3, env={"PYCOLL_ALGO": "ring"})
    yield ring
    ring.close()


def job_algorithm(comm: pc.Communicator) -> str:
    return comm.algorithm


@pytest.mark.parametrize(
    "job",
    [job_all_reduce, job_reduce_scatter, job_all_gather, job_broadcast],
    ids=lambda j: j.__name__[4:],
)
def test_ring_forced_at_every_size(ring_pool, job):
    """Small sizes take the one-shot path by default: force the ring so its
    uneven and empty chunks are checked too (3 ranks: sizes not divisible)."""
    assert ring_pool.run(job_algorithm) == ["ring"] * 3
    results = ring_pool.run(job, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad[:40])
