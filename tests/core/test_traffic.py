"""comm.stats(): a collective's bytes_sent / bytes_received are its traffic by
definition, the same on every path (ring, one-shot areas, windows, single
copy); what a rank itself copied (bytes_out / bytes_in) is test_cma's."""

from __future__ import annotations

import pytest
import torch

import pycollectives as pc

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")


def expected(kind: str, rank: int, n: int, count: int, es: int, root: int) -> tuple[int, int]:
    """(sent, received) by definition: `count` is the call's count argument."""
    b = count * es
    if kind == "all_reduce":
        own = (count * (rank + 1) // n - count * rank // n) * es
        return 2 * (b - own), 2 * (b - own)
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) * b, (n - 1) * b
    if kind == "broadcast":
        return ((n - 1) * b, 0) if rank == root else (0, b)
    return (0, (n - 1) * b) if rank == root else (b, 0)  # reduce


def job_traffic(comm: pc.Communicator, count: int, windows: bool) -> dict:
    """One call of each collective; the counters' growth per collective, and its path."""
    n = comm.world_size
    root = n - 1
    alloc = (lambda k: comm.alloc_shared(k)) if windows else (lambda k: torch.zeros(k))
    out = {}
    for kind in KINDS:
        before = comm.stats().get(kind, {})
        if kind == "all_reduce":
            comm.all_reduce(alloc(count))
        elif kind == "reduce_scatter":
            comm.reduce_scatter(torch.empty(count), alloc(n * count))
        elif kind == "all_gather":
            comm.all_gather(alloc(n * count), torch.ones(count))
        elif kind == "broadcast":
            comm.broadcast(alloc(count), root)
        elif kind == "reduce":
            comm.reduce(alloc(count), root)
        else:
            comm.all_to_all(torch.empty(n * count), torch.ones(n * count))
        after = comm.stats()[kind]
        got = {k: after[k] - before.get(k, 0) for k in ("bytes_sent", "bytes_received")}
        new_paths = {
            p: c - before.get("paths", {}).get(p, 0)
            for p, c in after["paths"].items()
            if c != before.get("paths", {}).get(p, 0)
        }
        got["path"] = next(iter(new_paths))
        out[kind] = got
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "case,env,count,windows",
    [
        ("ring", {"PYCOLL_ALGO": "ring"}, 300_001, False),
        ("oneshot", {}, 1001, False),
        ("windows", {"PYCOLL_CMA": "0"}, 300_001, True),
        ("cma", {"PYCOLL_ALGO": "cma"}, 300_001, False),
    ],
)
def test_traffic_is_the_same_on_every_path(pool, world_size, case, env, count, windows):
    results = pool(world_size, env=env).run(job_traffic, count, windows, timeout=120)
    paths = set()
    for r, got in enumerate(results):
        for kind, g in got.items():
            want = expected(kind, r, world_size, count, 4, world_size - 1)
            assert (g["bytes_sent"], g["bytes_received"]) == want, (case, r, kind, g, want)
            paths.add(g["path"])
    # the case took the path it is named for (single copy where the machine allows it)
    name = {"ring": "slots", "oneshot": "oneshot", "windows": "direct", "cma": "cma"}[case]
    if case != "cma" or any(g["path"] == "cma" for got in results for g in got.values()):
        assert name in paths, (case, paths)
