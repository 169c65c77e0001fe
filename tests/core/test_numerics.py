"""Random floats against a float64 reference, bitwise-identical all-reduce
results on every rank, and NumPy buffers."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import pycollectives as pc

# Relative L2 error allowed against the float64 reference.
TOL = {torch.float32: 1e-6, torch.float64: 1e-14, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def job_random_all_reduce(comm: pc.Communicator, seed: int) -> list[tuple]:
    out = []
    for dtype in TOL:
        for size in (5, 4099, 300_001):  # one-shot and ring paths
            for op in (pc.ReduceOp.SUM, pc.ReduceOp.AVG, pc.ReduceOp.MAX):
                inputs = [
                    torch.randn(size, generator=torch.Generator().manual_seed(seed + p)).to(dtype)
                    for p in range(comm.world_size)
                ]
                t = inputs[comm.rank].clone()
                comm.all_reduce(t, op)
                ref = torch.stack([x.to(torch.float64) for x in inputs])
                ref = {
                    pc.ReduceOp.SUM: ref.sum(0),
                    pc.ReduceOp.AVG: ref.mean(0),
                    pc.ReduceOp.MAX: ref.max(0).values,
                }[op]
                err = float((t.to(torch.float64) - ref).norm() / ref.norm())
                digest = hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()
                out.append((str(dtype), size, op.name, err, digest))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_random_against_float64_and_bitwise_identical(pool, world_size):
    results = pool(world_size).run(job_random_all_reduce, 1234, timeout=240)
    for case in range(len(results[0])):
        dtype, size, op, err, _ = results[0][case]
        tol = TOL[getattr(torch, dtype.split(".")[1])]
        assert err <= tol, f"{dtype} size={size} {op}: relative error {err:.3g} > {tol}"
        digests = {r[case][4] for r in results}
        assert len(digests) == 1, f"{dtype} size={size} {op}: ranks got different bits"


def job_numpy(comm: pc.Communicator) -> bool:
    n, r = comm.world_size, comm.rank
    a = np.full(1001, r + 1, dtype=np.int32)
    comm.all_reduce(a)
    out = np.zeros(3 * n, dtype=np.float64)
    comm.all_gather(out, np.arange(3, dtype=np.float64) + 10 * r)
    want = np.concatenate([np.arange(3) + 10 * p for p in range(n)])
    return bool((a == n * (n + 1) // 2).all() and (out == want).all())


def test_numpy_buffers(pool):
    assert all(pool(3).run(job_numpy))


def job_stats(comm: pc.Communicator) -> dict:
    before = comm.stats().get("all_reduce", {})
    calls, paths = before.get("calls", 0), dict(before.get("paths", {}))
    comm.all_reduce(torch.ones(1 << 16))  # 256 KiB: the ring through the slots
    comm.all_reduce(torch.ones(16))  # 64 bytes: the one-shot areas
    comm.all_reduce(torch.ones(1 << 16))
    s = comm.stats()["all_reduce"]
    taken = {p: k - paths.get(p, 0) for p, k in s["paths"].items() if k != paths.get(p, 0)}
    return {
        "calls": s["calls"] - calls,
        "sent": s["bytes_sent"],
        "time": s["time_s"],
        "paths": taken,
    }


def test_stats_count_calls_bytes_and_paths(pool):
    for s in pool(2).run(job_stats):
        assert s["calls"] == 3 and s["sent"] > 0 and s["time"] > 0
        assert s["paths"] == {"slots": 2, "oneshot": 1}
