"""comm.split(color, key): sub-communicators as MPI_Comm_split builds them."""

from __future__ import annotations

import torch

import pycollectives as pc


def job_split(comm: pc.Communicator) -> tuple:
    r, n = comm.rank, comm.world_size
    # Two groups by parity, ordered by descending old rank.
    sub = comm.split(r % 2, key=-r)
    t = torch.tensor([float(r)])
    sub.all_reduce(t)
    members = [p for p in range(n) if p % 2 == r % 2]
    ok = t.item() == sum(members) and sub.world_size == len(members)
    ok = ok and sub.rank == sorted(members, reverse=True).index(r)
    # The parent still works after the split, interleaved with the child.
    u = torch.ones(3)
    comm.all_reduce(u)
    sub.barrier()
    none = comm.split(None if r == 0 else 1)
    ok = ok and (none is None) == (r == 0) and bool(torch.all(u == n))
    if none is not None:
        v = torch.ones(2)
        none.all_reduce(v)
        ok = ok and none.world_size == n - 1 and bool(torch.all(v == n - 1))
        none.close()
    sub.close()
    return ok


def test_split_by_color_and_key(pool):
    assert all(pool(4).run(job_split))
    assert all(pool(3).run(job_split))
