"""Symmetric shared-memory windows (comm.alloc_shared): the direct all-reduce,
reduce-scatter and all-gather that run in place across the ranks' buffers, and
the plain-buffer paths they fall back to when placements differ."""

from __future__ import annotations

import pytest
import torch

import pycollectives as pc


def _reference(stacked: torch.Tensor, op: pc.ReduceOp, dt: torch.dtype) -> torch.Tensor:
    """The reduction of the rows of `stacked` (float64) as `dt` computes it."""
    if stacked.shape[1] == 0:
        return stacked.sum(0)
    ref = {
        pc.ReduceOp.SUM: lambda: stacked.sum(0),
        pc.ReduceOp.PROD: lambda: stacked.prod(0),
        pc.ReduceOp.MIN: lambda: stacked.min(0).values,
        pc.ReduceOp.MAX: lambda: stacked.max(0).values,
        pc.ReduceOp.AVG: lambda: stacked.sum(0) / stacked.shape[0],
    }[op]()
    if not dt.is_floating_point and op == pc.ReduceOp.AVG:
        ref = torch.trunc(ref)
    return ref


def _vals(n: int, count: int) -> list[torch.Tensor]:
    """Small-integer data per rank (float64), exact in every dtype tested."""
    return [((torch.arange(count) * (q + 1)) % 3 + 1).to(torch.float64) for q in range(n)]


def _path(comm: pc.Communicator, coll: str, *args: object) -> str:
    """Runs comm.<coll>(*args) once and returns the path it took, from comm.stats()."""
    before = dict(comm.stats().get(coll, {}).get("paths", {}))
    getattr(comm, coll)(*args)
    after = comm.stats()[coll]["paths"]
    taken = [p for p, k in after.items() if k != before.get(p, 0)]
    assert len(taken) == 1, (before, after)
    return taken[0]


def _plain_paths(comm: pc.Communicator) -> set[str]:
    """The paths a plain buffer above the one-shot sizes may take: the slots, or single copy
    where it is available (which one depends on the size band)."""
    return {"slots", "cma"} if comm.single_copy else {"slots"}


def job_windows(comm: pc.Communicator) -> list[str]:
    """alloc_shared: the direct in-place all-reduce (symmetric), the plain-buffer paths when the
    ranks' placements differ, every op and dtype exact, views at an offset."""
    n, r, bad = comm.world_size, comm.rank, []
    for count in (0, 1, 7, 1000, (1 << 20) + 3):
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64):
            w = comm.alloc_shared(count + 16, dt)
            x = w[16:]  # a view at an offset: the same on every rank
            vals = _vals(n, count)
            stacked = torch.stack(vals)
            for op in pc.ReduceOp:
                ref = _reference(stacked, op, dt)
                x.copy_(vals[r].to(dt))
                path = _path(comm, "all_reduce", x, op)
                # Above the one-shot size (32 KiB) the direct path runs.
                if count * dt.itemsize > 32 << 10 and path != "direct":
                    bad.append(f"{count} {dt} {op.name}: took the {path} path, not direct")
                if not torch.equal(x, ref.to(dt)):
                    bad.append(f"{count} {dt} {op.name}: wrong")
    # Placements that differ across ranks: not the direct path, still right.
    w = comm.alloc_shared(101_000)
    x = w[r * 16 : r * 16 + 100_000]
    x.fill_(r + 1.0)
    path = _path(comm, "all_reduce", x)
    if not torch.all(x == n * (n + 1) / 2):
        bad.append("asymmetric placement: wrong")
    if path not in _plain_paths(comm):
        bad.append(f"asymmetric placement: took the {path} path")
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_windows_direct_all_reduce(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_windows, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


def job_windows_rs_ag(comm: pc.Communicator) -> list[str]:
    """Reduce-scatter with the input in a window and all-gather with the output in
    a window: exact for every op and dtype, in place and out of place, and the
    direct path taken from 4 KiB per rank (checked in comm.stats())."""
    n, r, bad = comm.world_size, comm.rank, []
    for count in (0, 1, 7, 1000, (1 << 18) + 3):
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64):
            nbytes = count * dt.itemsize
            direct = nbytes >= 4096  # the direct path's threshold (the one-shot one is above)
            w = comm.alloc_shared(n * count + 16, dt)
            inp = w[16:]  # a view at an offset: the same on every rank
            vals = [v.to(dt) for v in _vals(n, n * count)]
            stacked = torch.stack([v.to(torch.float64) for v in vals])
            for op in pc.ReduceOp:
                ref = _reference(stacked, op, dt)[r * count : (r + 1) * count]
                for in_place in (False, True):
                    inp.copy_(vals[r])
                    out = (
                        inp[r * count : (r + 1) * count]
                        if in_place
                        else torch.empty(count, dtype=dt)
                    )
                    path = _path(comm, "reduce_scatter", out, inp, op)
                    if direct and path != "direct":
                        bad.append(f"reduce_scatter {count} {dt}: took the {path} path")
                    if not torch.equal(out, ref.to(dt)):
                        bad.append(
                            f"reduce_scatter {count} {dt} {op.name} in_place={in_place}: wrong"
                        )
            # all-gather into the window: from a private input, and in place
            for in_place in (False, True):
                inp.zero_()
                src = vals[r][:count]
                if in_place:
                    inp[r * count : (r + 1) * count].copy_(src)
                    src = inp[r * count : (r + 1) * count]
                path = _path(comm, "all_gather", inp, src)
                if direct and path != "direct":
                    bad.append(f"all_gather {count} {dt}: took the {path} path")
                want = torch.cat([vals[q][:count] for q in range(n)])
                if not torch.equal(inp, want):
                    bad.append(f"all_gather {count} {dt} in_place={in_place}: wrong")
    # Placements that differ across ranks: not the direct path, still right.
    w = comm.alloc_shared(n * 100_000 + 64)
    inp = w[r * 16 : r * 16 + n * 100_000]
    inp.fill_(r + 1.0)
    out = torch.empty(100_000)
    path = _path(comm, "reduce_scatter", out, inp)
    if not torch.all(out == n * (n + 1) / 2):
        bad.append("asymmetric reduce_scatter: wrong")
    if path not in _plain_paths(comm):
        bad.append(f"asymmetric reduce_scatter: took the {path} path")
    src = torch.full((100_000,), float(r))
    path = _path(comm, "all_gather", inp, src)
    if not torch.equal(inp, torch.arange(n).repeat_interleave(100_000).float()):
        bad.append("asymmetric all_gather: wrong")
    if path not in _plain_paths(comm):
        bad.append(f"asymmetric all_gather: took the {path} path")
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_windows_direct_reduce_scatter_all_gather(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_windows_rs_ag, timeout=240)):
        assert not bad, f"rank {r}: {bad}"
