"""pycollectives-bench across hosts made of network namespaces
(benchmarks/common/_bench_hosts.py, what benchmarks/plan/plan_costs_hosts.py measures with):
the ranks find their hosts as on a cluster, rows record the cross-host path, and a rank
that fails is reported by rank, never a hang."""

from __future__ import annotations

import sys

import netns
import paths
import pytest

sys.path.insert(0, str(paths.BENCH / "common"))

from _bench_hosts import run_bench_hosts  # noqa: E402

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

FLAGS = ["-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--trials", "2", "-c", "1",
         "--coll", "all_reduce,all_gather"]  # fmt: skip


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


@pytest.mark.parametrize("layout, algo, path", [
    ([0, 1], None, "hierarchical"),
    ([0, 0, 1, 1], None, "hierarchical"),
    ([0, 0, 1, 1], "ring", "flat"),
])  # fmt: skip
def test_bench_rows_across_hosts(fabric, layout, algo, path):
    data = run_bench_hosts(fabric, layout, FLAGS, {"PYCOLL_ALGO": algo} if algo else {}, 300)
    rows = [r for r in data["rows"] if r["backend"] == "pycoll"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather"}
    for r in rows:
        assert r["nranks"] == len(layout) and r["wrong"] == 0, r
        assert list(r["paths"]) == [path], r
        assert len(r["trials_us"]) == 2 and min(r["trials_us"]) > 0, r


def test_a_failing_rank_is_named(fabric):
    with pytest.raises(RuntimeError, match=r"rank \d exited with status 2"):
        run_bench_hosts(fabric, [0, 1], [*FLAGS, "--root", "5", "--coll", "broadcast"], None, 120)
    with pytest.raises(ValueError, match="must put rank 0 on host 0"):
        run_bench_hosts(fabric, [1, 0], FLAGS)
