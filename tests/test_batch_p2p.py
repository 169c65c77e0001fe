"""batch_p2p: sends and receives that progress together, so patterns that
deadlock as separate blocking sends (every rank sending a large tensor first)
complete; pairs match in order; bad batches raise."""

from __future__ import annotations

import pytest
import torch

import pycollectives as pc

BIG = (3 << 20) // 4 + 5  # float32 elements: 3 MiB + 20 B, far more than the slots hold


def job_ring_shift(comm: pc.Communicator, count: int, dtype: torch.dtype) -> list[str]:
    """Every rank sends to the next and receives from the previous, twice per
    pair (two messages in order), plus a send to itself."""
    n, r, bad = comm.world_size, comm.rank, []
    nxt, prv = (r + 1) % n, (r - 1) % n
    a = (torch.arange(count) % 97 + r).to(dtype)
    b = (torch.arange(count // 3) % 89 + 10 * r).to(dtype)
    got_a, got_b = torch.empty_like(a), torch.empty_like(b)
    mine = torch.empty_like(a)
    ops = [("send", a, nxt), ("recv", got_a, prv), ("send", b, nxt), ("recv", got_b, prv)]
    ops += [("recv", mine, r), ("send", a, r)]
    comm.batch_p2p(ops)
    want_a = (torch.arange(count) % 97 + prv).to(dtype)
    want_b = (torch.arange(count // 3) % 89 + 10 * prv).to(dtype)
    if not torch.equal(got_a, want_a):
        bad.append("first message from prev differs")
    if not torch.equal(got_b, want_b):
        bad.append("second message from prev differs")
    if not torch.equal(mine, a):
        bad.append("send to self differs")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 7, BIG])
def test_ring_shift(pool, world_size, count):
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for r, bad in enumerate(pool(world_size).run(job_ring_shift, count, dtype)):
            assert not bad, f"rank {r} {dtype}: {bad}"


def job_exchange_async(comm: pc.Communicator) -> list[str]:
    """All-to-all of uneven sizes as one async batch, then a collective after it."""
    n, r, bad = comm.world_size, comm.rank, []
    size = lambda src, dst: (src + 1) * 100_000 + dst  # noqa: E731
    outs = {p: torch.empty(size(p, r), dtype=torch.int32) for p in range(n)}
    ops = []
    for p in range(n):
        ops.append(("send", torch.full((size(r, p),), r * 10 + p, dtype=torch.int32), p))
        ops.append(("recv", outs[p], p))
    before = comm.stats().get("batch_p2p", {}).get("calls", 0)
    w = comm.batch_p2p(ops, async_op=True)
    t = torch.ones(5)
    comm.all_reduce(t)
    if not w.is_completed():
        bad.append("batch not complete before the later all_reduce returned")
    w.wait()
    for p in range(n):
        if not torch.all(outs[p] == p * 10 + r):
            bad.append(f"from {p}: wrong data")
    if comm.stats().get("batch_p2p", {}).get("calls") != before + 1:
        bad.append(f"stats: {comm.stats().get('batch_p2p')}")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_exchange_async(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_exchange_async)):
        assert not bad, f"rank {r}: {bad}"


def job_bad_input(comm: pc.Communicator) -> list[str]:
    r, bad = comm.rank, []
    t = torch.ones(4)
    cases = [
        ([("sendx", t, 0)], "ops[0]"),
        ([("send", t, 5)], "ops[0] peer"),
        ([("send", t, r)], "do not pair up"),
        ([("send", t, r), ("recv", torch.ones(3), r)], "does not match"),
        ([("recv", torch.ones(4)[::2], 0)], "ops[0]"),
    ]
    for ops, needle in cases:
        try:
            comm.batch_p2p(ops)
            bad.append(f"{needle}: no error")
        except ValueError as e:
            if needle not in str(e) or f"rank {r}" not in str(e) or "batch_p2p" not in str(e):
                bad.append(f"{needle}: message {e}")
    return bad


def test_bad_input(pool):
    for r, bad in enumerate(pool(2).run(job_bad_input)):
        assert not bad, f"rank {r}: {bad}"
