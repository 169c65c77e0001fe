"""Receiving from any source (`comm.recv(t, None)`, MPI_ANY_SOURCE): every
sender's message arrives once, with its sender named, in each pair's order,
beside named receives and batches; no sender means a timeout, not a hang."""

from __future__ import annotations

import pytest
import torch
from test_collectives import _cases, data, mismatches

import pycollectives as pc


def job_any_source_every_size_and_dtype(comm: pc.Communicator) -> list[str]:
    """Ranks 1..n-1 send rank 0 one message per size and dtype; rank 0 takes
    them from any source and checks each against its named sender's data. A
    barrier ends each case: a receive from any source would take a faster
    sender's next message, of another size, as MPI's would."""
    n, r, bad = comm.world_size, comm.rank, []
    for size, dtype, _ in _cases(ops=[pc.ReduceOp.SUM]):
        comm.barrier()
        if r != 0:
            comm.send(data(r, size, dtype, pc.ReduceOp.SUM, n), 0)
            continue
        seen = []
        for _ in range(n - 1):
            got = torch.full((size,), 99).to(dtype)
            src = comm.recv(got, None)
            seen.append(src)
            if k := mismatches(got, data(src, size, dtype, pc.ReduceOp.SUM, n)):
                bad.append(f"size={size} {dtype} from {src}: {k} wrong")
        if sorted(seen) != list(range(1, n)):
            bad.append(f"size={size} {dtype}: sources {seen}")
    comm.barrier()
    return bad


def job_any_source_order_and_mixing(comm: pc.Communicator) -> list[str]:
    """Each sender sends 2 small messages, then (after a barrier) one of 4 MiB
    from a batch, which crosses many slots or goes single copy. Rank 0 takes
    the first from rank 1 by name and the rest from any source, every other
    one asynchronously: per sender, messages arrive in the order sent."""
    n, r, bad = comm.world_size, comm.rank, []
    big = 1 << 20
    if r != 0:
        comm.send(torch.full((5,), float(10 * r)), 0)
        comm.send(torch.full((5,), float(10 * r + 1)), 0)
        comm.barrier()
        comm.batch_p2p([("send", torch.full((big,), float(10 * r + 2)), 0)])
        comm.barrier()
        return bad
    got = torch.empty(5)
    if comm.recv(got, 1) != 1 or got.tolist() != [10.0] * 5:
        bad.append(f"named recv from 1: {got.tolist()}")
    taken: list[tuple[int, torch.Tensor, int | pc.Work]] = [(-1, got, 1)]
    for i in range(2 * (n - 1) - 1):  # the small ones left, in issue order
        t = torch.empty(5)
        taken.append((i, t, comm.recv(t, None, async_op=bool(i % 2))))
    comm.barrier()
    for i in range(n - 1):
        t = torch.empty(big)
        taken.append((i, t, comm.recv(t, None, async_op=bool(i % 2))))
    per_sender: dict[int, list[float]] = {}
    for _, t, how in taken:  # in issue order
        if isinstance(how, pc.Work):
            how.wait()
            src = how.source
        else:
            src = how
        if not torch.all(t == t[0]):
            bad.append(f"message from {src} not uniform")
        per_sender.setdefault(src, []).append(float(t[0]))
    for s in range(1, n):
        if per_sender.get(s) != [10.0 * s, 10.0 * s + 1, 10.0 * s + 2]:
            bad.append(f"from {s}: {per_sender.get(s)}")
    comm.barrier()
    return bad


def job_any_source_pair_order(comm: pc.Communicator) -> list[str]:
    """One sender, many messages: a receive from any source takes them in order."""
    r, bad = comm.rank, []
    if r == 1:
        for k in range(20):
            comm.send(torch.full((3,), float(k)), 0)
    elif r == 0:
        got = []
        for _ in range(20):
            t = torch.empty(3)
            if comm.recv(t, None) != 1:
                bad.append("wrong source")
            got.append(float(t[0]))
        if got != [float(k) for k in range(20)]:
            bad.append(f"order {got}")
    comm.barrier()
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "job",
    [
        job_any_source_every_size_and_dtype,
        job_any_source_order_and_mixing,
        job_any_source_pair_order,
    ],
    ids=lambda j: j.__name__[15:],
)
def test_recv_from_any_source(pool, job, world_size):
    results = pool(world_size).run(job, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad[:40])


def _no_sender(rank: int, world_size: int, tmp: str) -> str:
    from fault_jobs import signal_done, wait_done

    comm = pc.init(timeout=30)
    try:
        if rank == 0:
            try:
                comm.recv(torch.empty(4), None, timeout=0.3)
            except pc.CollectiveTimeout as e:
                return str(e)
            finally:
                signal_done(f"{tmp}/timed_out")
            return "no error"
        wait_done(f"{tmp}/timed_out")  # alive and silent past rank 0's timeout
        return ""
    finally:
        comm.close()


def test_recv_from_any_source_times_out(tmp_path):
    from spawn import run

    msg = run(_no_sender, 2, str(tmp_path), timeout=60)[0]
    assert "recv(count=4, float32, peer=any)" in msg, msg
    assert "Timed out waiting 300ms for its peers" in msg, msg


def _alone(rank: int, world_size: int) -> str:
    comm = pc.init(timeout=30)
    try:
        comm.recv(torch.empty(4), None)
    except ValueError as e:
        return str(e)
    finally:
        comm.close()
    return "no error"


def test_recv_from_any_source_needs_a_peer():
    from spawn import run

    msg = run(_alone, 1, timeout=60)[0]
    assert "rank 0: recv" in msg and "any source" in msg, msg


def _empty_against_three(rank: int, world_size: int) -> str:
    comm = pc.init(timeout=30)
    try:
        try:
            if rank == 0:
                comm.send(torch.empty(0), 1)
                comm.barrier()  # the receiver's error aborts the communicator: raised here
            else:
                comm.recv(torch.empty(3), 0)
        except pc.CollectiveMismatch as e:
            return str(e)
        return "no error"
    finally:
        comm.close()


def test_empty_send_is_checked_against_its_receive():
    """An empty message takes a slot: a receive of 3 elements sees it at once
    and names both calls (it used to wait for a slot that never came)."""
    from spawn import run

    for msg in run(_empty_against_three, 2, timeout=60):
        assert "recv(count=3, float32, peer=0)" in msg and "send(count=0, float32" in msg, msg
