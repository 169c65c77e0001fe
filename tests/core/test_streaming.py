"""Streaming stores into the caller's output (PYCOLL_STREAM_BYTES, Store::kStreaming).

With PYCOLL_STREAM_BYTES=0 every copy into a caller's buffer goes through the non-temporal
path: the ring's receives, single copy's own all-gather block, the direct path's copies (alloc_shared)
and one rank's copies. Every collective that copies into its output must stay exact at sizes that
put the output at every alignment, in and out of place. The copy kernel itself is checked byte by
byte in test_reduce_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from spawn import RankPool
from test_windows import _path, _reference, _vals

import pycollectives as pc

COUNTS = (1, 7, 1000, (1 << 16) + 3)
DTYPES = (torch.int8, torch.int32, torch.float64)


def job_streamed(comm: pc.Communicator) -> list[str]:
    """Every copying collective, plain and (2+ ranks) registered buffers, exact; the direct
    path is asserted where the registered buffer should take it (not under PYCOLL_ALGO=ring)."""
    n, r, bad = comm.world_size, comm.rank, []
    direct = comm.algorithm != "ring"
    for count in COUNTS:
        for dt in DTYPES:
            vals = [v.to(dt) for v in _vals(n, n * count)]
            stacked = torch.stack([v.to(torch.float64) for v in vals])
            full = _reference(stacked, pc.ReduceOp.SUM, dt).to(dt)
            x = vals[r].clone()
            comm.all_reduce(x)
            if not torch.equal(x, full):
                bad.append(f"all_reduce {count} {dt}")
            out = torch.empty(count, dtype=dt)
            comm.reduce_scatter(out, vals[r])
            if not torch.equal(out, full[r * count : (r + 1) * count]):
                bad.append(f"reduce_scatter {count} {dt}")
            want = torch.cat([v[:count] for v in vals])
            for in_place in (False, True):
                # an odd element offset into a larger tensor: the blocks start unaligned
                big = torch.zeros(n * count + 1, dtype=dt)
                out = big[1:]
                src = vals[r][:count]
                if in_place:
                    out[r * count : (r + 1) * count].copy_(src)
                    src = out[r * count : (r + 1) * count]
                comm.all_gather(out, src)
                if not torch.equal(out, want) or big[0] != 0:
                    bad.append(f"all_gather {count} {dt} in_place={in_place}")
            out = torch.empty(n * count, dtype=dt)
            comm.all_to_all(out, vals[r])
            want = torch.cat([vals[p][r * count : (r + 1) * count] for p in range(n)])
            if not torch.equal(out, want):
                bad.append(f"all_to_all {count} {dt}")
            y = vals[r][:count].clone()
            comm.broadcast(y, n - 1)
            if not torch.equal(y, vals[n - 1][:count]):
                bad.append(f"broadcast {count} {dt}")
            if n == 1:
                continue
            w = comm.alloc_shared(n * count, dt)
            w.copy_(vals[r])
            path = _path(comm, "all_reduce", w)
            if not torch.equal(w, full):
                bad.append(f"registered all_reduce {count} {dt} ({path})")
            if direct and count * dt.itemsize * n > 32 << 10 and path != "direct":
                bad.append(f"registered all_reduce {count} {dt}: took {path}")
            w.zero_()
            path = _path(comm, "all_gather", w, vals[r][:count])
            if not torch.equal(w, torch.cat([v[:count] for v in vals])):
                bad.append(f"registered all_gather {count} {dt} ({path})")
            if direct and count * dt.itemsize >= 4096 and path != "direct":
                bad.append(f"registered all_gather {count} {dt}: took {path}")
    return bad


@pytest.mark.parametrize(
    "world_size, algo", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (3, "ring")]
)
def test_streamed_outputs_exact(world_size, algo):
    pool = RankPool(world_size, env={"PYCOLL_STREAM_BYTES": "0", "PYCOLL_ALGO": algo})
    try:
        results = pool.run(job_streamed, timeout=240)
    finally:
        pool.close()
    for r, bad in enumerate(results):
        assert not bad, f"rank {r}: {bad}"


def test_stream_bytes_must_parse(monkeypatch):
    """A setting that does not parse is refused when the communicator is made, naming it."""
    from pycollectives import _C

    monkeypatch.setenv("PYCOLL_STREAM_BYTES", "lots")
    with pytest.raises(ValueError, match="PYCOLL_STREAM_BYTES=lots"):
        _C.Communicator(0, 1, _C.unique_segment_name(), True, 5.0)
