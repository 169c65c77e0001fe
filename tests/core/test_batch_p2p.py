"""batch_p2p: sends and receives that progress together, so patterns that
deadlock as separate blocking sends (every rank sending a large tensor first)
complete; pairs match in order; bad batches raise."""

from __future__ import annotations

import os

import pytest
import torch
from test_cma import _TRIALS, tuned_choice  # the tuner's schedule, its decision

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


# ---- single copy (CMA) ---------------------------------------------------------------------

SMALL, LARGE = 1000, 100_000  # float32: 4 KB through the slots, 400 KB read across (>= 64 KiB)
# Sends of single-copy size go across without timing it against the slots (the tests below
# that expect single copy by size; the tuner's are at the end).
UNTUNED = {"PYCOLL_CMA_TUNE": "0"}


def job_mixed_sizes(comm: pc.Communicator, want: str, sizes: list[int]) -> list[str]:
    """Small and large messages to the same peer in one batch keep their order
    and contents, and the batch went `want` ("cma" or "slots")."""
    n, r, bad = comm.world_size, comm.rank, []
    nxt, prv = (r + 1) % n, (r - 1) % n

    def msg(src: int, k: int, count: int) -> torch.Tensor:
        return torch.arange(count, dtype=torch.float32) * (k + 1) + 1000 * src

    got = [torch.empty(c) for c in sizes]
    ops = []
    for k, c in enumerate(sizes):
        ops += [("send", msg(r, k, c), nxt), ("recv", got[k], prv)]
    before = comm.stats().get("batch_p2p", {}).get("paths", {}).get(want, 0)
    comm.batch_p2p(ops)
    for k, c in enumerate(sizes):
        if not torch.equal(got[k], msg(prv, k, c)):
            bad.append(f"message {k} ({c} elements) from rank {prv} differs")
    after = comm.stats().get("batch_p2p", {}).get("paths", {})
    if n > 1 and after.get(want, 0) != before + 1:
        bad.append(f"expected the {want} path, counters {after}")
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", ["cma", "slots", "cma_forced"])
def test_single_copy_messages(pool, world_size, case):
    """From 64 KiB a message is read straight out of the sender's buffer when
    CMA is available (the slots otherwise, or with PYCOLL_CMA=0), mixed in
    order with the small messages that still cross the slots; with
    PYCOLL_ALGO=cma every message is read across."""
    env = {"slots": {"PYCOLL_CMA": "0"}, "cma_forced": {"PYCOLL_ALGO": "cma"}}.get(case, UNTUNED)
    p = pool(world_size, env)
    if case != "slots" and not p.run(job_single_copy_available)[0]:
        pytest.skip("CMA is not available here (ptrace refused)")
    want = "slots" if case == "slots" else "cma"
    # Forced, small messages alone must go across too.
    sizes = [SMALL] * 3 if case == "cma_forced" else [SMALL, LARGE, SMALL, LARGE, LARGE]
    for r, bad in enumerate(p.run(job_mixed_sizes, want, sizes)):
        assert not bad, f"rank {r}: {bad}"


def job_single_copy_available(comm: pc.Communicator) -> bool:
    return comm.single_copy


def _size_mismatch(rank: int, world_size: int) -> str:
    comm = pc.init(timeout=30)
    count = LARGE if rank == 0 else LARGE - 64  # rank 1 expects fewer elements
    t = torch.ones(count)
    try:
        comm.batch_p2p([("send", t, 1)] if rank == 0 else [("recv", t, 0)])
    except pc.CollectiveMismatch as e:
        return str(e)
    finally:
        comm.close()
    return "no error"


def test_single_copy_size_mismatch_raises():
    """A large send met by a receive of another size raises on both ranks
    (the descriptor's tag names the sender's call), never hangs."""
    from spawn import run

    msgs = run(_size_mismatch, 2, timeout=60)
    for r, m in enumerate(msgs):
        for call in (f"send(count={LARGE}, float32, peer=1)", f"recv(count={LARGE - 64}, float32"):
            assert call in m, f"rank {r}: {m}"


def job_batch_meets_single(comm: pc.Communicator, sizes: list[int]) -> list[str]:
    """For each ordered pair (a, b) in turn: a batch send from a met by a single recv on b, then
    a single send from a met by a batch recv on b; contents exact, and a batch's large message
    reaches the single recv by single copy where CMA is on."""
    n, r, bad = comm.world_size, comm.rank, []

    def msg(src: int, dst: int, count: int) -> torch.Tensor:
        return torch.arange(count, dtype=torch.float32) + 1000 * src + 100 * dst

    for a in range(n):
        for b in range(n):
            if a == b or r not in (a, b):
                continue
            for count in sizes:
                before = comm.stats().get("recv", {}).get("paths", {}).get("cma", 0)
                for batch_sends in (True, False):
                    if r == a:
                        t = msg(a, b, count)
                        comm.batch_p2p([("send", t, b)]) if batch_sends else comm.send(t, b)
                        continue
                    got = torch.full((count,), -1.0)
                    comm.recv(got, a) if batch_sends else comm.batch_p2p([("recv", got, a)])
                    if not torch.equal(got, msg(a, b, count)):
                        how = "batch send -> recv" if batch_sends else "send -> batch recv"
                        bad.append(f"{how}, {count} elements from rank {a} differ")
                across = comm.stats().get("recv", {}).get("paths", {}).get("cma", 0) - before
                # the batch send went across (and so its recv) from 64 KiB, or forced
                big = comm.algorithm == "cma" or count * 4 >= 64 << 10
                want = int(comm.single_copy and count > 0 and big)
                if r == b and across != want:
                    bad.append(f"{count} elements from rank {a}: recv took cma {across} times")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["default", "cma_forced", "slots"])
def test_batch_meets_single_calls(pool, world_size, case):
    """A batch on one side and single send / recv on the other pair up (torch's
    batch_isend_irecv against recv): a single receive takes a batch's single-copy
    descriptor, a batch receive expecting one takes a single send's chunks."""
    env = {"slots": {"PYCOLL_CMA": "0"}, "cma_forced": {"PYCOLL_ALGO": "cma"}}.get(case, UNTUNED)
    for r, bad in enumerate(pool(world_size, env).run(job_batch_meets_single, [0, SMALL, LARGE])):
        assert not bad, f"rank {r}: {bad}"


# ---- single copy timed against the slots ---------------------------------------------------


def job_sendrecv_paths(
    comm: pc.Communicator, count: int, calls: int
) -> tuple[list[str], str | None] | None:
    """`calls` sendrecv batches (send `count` int32 to the next rank, receive from the
    previous): contents exact every time; the paths they took and the path this rank's
    tuner kept (None untuned); None without CMA."""
    n, r = comm.world_size, comm.rank
    if not comm.single_copy:
        return None
    paths = []
    for k in range(calls):
        x = torch.arange(count, dtype=torch.int32) + 1000 * r + k
        got = torch.full((count,), -1, dtype=torch.int32)
        before = dict(comm.stats().get("batch_p2p", {}).get("paths", {}))
        comm.batch_p2p([("send", x, (r + 1) % n), ("recv", got, (r - 1) % n)])
        after = comm.stats()["batch_p2p"]["paths"]
        paths += [p for p in after if after[p] != before.get(p, 0)]
        want = torch.arange(count, dtype=torch.int32) + 1000 * ((r - 1) % n) + k
        assert torch.equal(got, want), f"rank {r}, call {k}: wrong data from rank {(r - 1) % n}"
    tuning = comm.cma_tuning().get("batch_p2p")
    return paths, tuned_choice(tuning, count * 4) if tuning else None


@pytest.mark.parametrize("world_size", [2, 3])
def test_batch_tuner_times_single_copy_against_the_slots(pool, world_size):
    # 256-byte slots. Every rank tries single copy untimed, then timed against the slots
    # twice each (cma, slots, cma, slots), then keeps what its own timings favoured (which,
    # under load, need not be single copy: test_cma.py). In the slots trials every receive
    # expecting single copy by size meets 1 MiB of chunks through 1 KiB of slots while its
    # own send is in flight: it must take them chunk by chunk, not hang.
    p = pool(world_size, {"PYCOLL_SLOT_BYTES": "256"})
    out = p.run(job_sendrecv_paths, 1 << 18, 8)
    if out[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here")
    tried = ["cma" if c else "slots" for c, _ in _TRIALS]
    # A batch counts as single copy where its send went across (this rank's choice) or its
    # receive came across (the previous rank's).
    kept = [{out[r][1], out[r - 1][1]} for r in range(world_size)]
    want = [tried + ["cma" if "cma" in k else "slots"] * 3 for k in kept]
    assert [paths for paths, _ in out] == want, out


def _mixed_choices(rank: int, world_size: int) -> list[str] | None:
    # Rank 0 sends across throughout (untuned, a local choice); the others try the slots in
    # their trials, so a batch meets single copy from one side and chunks from the other.
    if rank == 0:
        os.environ["PYCOLL_CMA_TUNE"] = "0"
    with pc.init(timeout=60) as comm:
        out = job_sendrecv_paths(comm, 1 << 18, 8)
        return out and out[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_batch_sends_choosing_different_paths_pair_up(world_size):
    from spawn import run

    paths = run(_mixed_choices, world_size, env={"PYCOLL_SLOT_BYTES": "256"}, timeout=120)
    if paths[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here")
    assert paths[0] == ["cma"] * 8, paths  # its sends go across every time


def _fill(tag: int, count: int) -> torch.Tensor:
    return (torch.arange(count) % 251 + tag).float()


def job_batches_against_other_groupings(comm: pc.Communicator, count: int) -> list[str]:
    """A batch on one side, its counterparts grouped differently on the other
    (single calls, several batches, another order of peers): each pattern is
    matched, and it completes whatever the sizes, because every message
    progresses on its own (they used to run in lockstep: chunk k of every
    send, then chunk k of every receive, which hung these past the slots)."""
    r, bad = comm.rank, []
    if r > 1:
        return bad

    def check(name: str, got: torch.Tensor, tag: int) -> None:
        if not torch.equal(got, _fill(tag, count)):
            bad.append(f"{name}: wrong data (count={count})")

    # 1. [send, recv] against a recv, then a send (GPipe's last step)
    if r == 0:
        y = torch.empty(count)
        comm.batch_p2p([("send", _fill(1, count), 1), ("recv", y, 1)])
        check("send+recv vs recv;send", y, 2)
    else:
        x = torch.empty(count)
        comm.batch_p2p([("recv", x, 0)])
        comm.batch_p2p([("send", _fill(2, count), 0)])
        check("recv;send vs send+recv", x, 1)
    # 2. two sends and a receive to one peer against single calls
    if r == 0:
        c = torch.empty(count)
        comm.batch_p2p([("send", _fill(3, count), 1), ("send", _fill(4, count), 1), ("recv", c, 1)])
        check("2 sends + recv vs singles", c, 5)
    else:
        a, b = torch.empty(count), torch.empty(count)
        comm.recv(a, 0)
        comm.recv(b, 0)
        comm.send(_fill(5, count), 0)
        check("singles vs 2 sends + recv (a)", a, 3)
        check("singles vs 2 sends + recv (b)", b, 4)
    # 3. both sides one batch, the receives listed first on one side
    x = torch.empty(count)
    ops = [("send", _fill(6 + r, count), 1 - r), ("recv", x, 1 - r)]
    comm.batch_p2p(ops if r == 0 else ops[::-1])
    check("recv-first vs send-first", x, 7 - r)
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("count", [0, 7, BIG])
@pytest.mark.parametrize("cma", ["0", "1"])
def test_batches_against_other_groupings(pool, world_size, count, cma):
    results = pool(world_size, env={"PYCOLL_CMA": cma}).run(
        job_batches_against_other_groupings, count, timeout=120
    )
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)
