"""The planner's collectives across hosts: the within-host steps of the hierarchical
schedules priced on the shared slots, per collective; what the communicator runs (its own
rule: hierarchical where every host holds as many ranks, else one flat ring); ring against
hierarchical at 8 to 4096 ranks from a TCP link fitted to bench rows; --inter-bench-json.
Synthetic bench rows whose times come from known latencies and bandwidths."""

from __future__ import annotations

import json

import pytest

from pycollectives.strategies.plan import parse_request
from pycollectives.strategies.plan.cli import main
from pycollectives.strategies.plan.costs import (
    INTRA_PATH,
    LinkCost,
    across_hosts_time,
    hierarchical_time,
    ring_time,
    ring_vs_hierarchical,
)
from pycollectives.strategies.plan.fitted import fit_model
from pycollectives.strategies.plan.inputs import PlanInputError
from pycollectives.strategies.plan.layout import _collective

CACHE = 1 << 30  # one regime: the rows below test paths and collectives
COLLS = ("all_reduce", "reduce_scatter", "all_gather")
SIZES = (2**16, 2**18, 2**20, 2**22, 2**24)
# shared memory: (collective, path) -> (alpha s, seconds per byte); a one-host collective
# of >= 1 MiB takes the single copy (cma), the hierarchical schedules' steps the slots
SHM = {
    ("all_reduce", "slots"): (3e-6, 1 / 6e9),
    ("reduce_scatter", "slots"): (2e-6, 1 / 5e9),
    ("all_gather", "slots"): (4e-6, 1 / 9e9),
    ("all_reduce", "cma"): (9e-6, 1 / 20e9),
    ("reduce_scatter", "cma"): (8e-6, 1 / 21e9),
    ("all_gather", "cma"): (7e-6, 1 / 22e9),
}
# TCP, 2 hosts x 1 rank: every row's path is "hierarchical" (the communicator's name for
# its schedules across hosts, even of one rank per host)
TCP = {"all_reduce": (40e-6, 1 / 0.9e9), "reduce_scatter": (30e-6, 1 / 1.1e9),
       "all_gather": (35e-6, 1 / 1.2e9)}  # fmt: skip


def _ring(coll: str, n: int, size: float, alpha: float, beta: float) -> float:
    k = 2 if coll == "all_reduce" else 1
    return k * (n - 1) * alpha + k * (n - 1) / n * size * beta


def _row(coll: str, n: int, size: int, seconds: float, path: str) -> dict:
    return {"backend": "pycoll", "collective": coll, "nranks": n, "size": size,
            "time_us": seconds * 1e6, "paths": {path: 20}}  # fmt: skip


def _shm_rows() -> list[dict]:
    rows = []
    for coll in COLLS:
        for n in (2, 4):
            for size in SIZES:
                path = "cma" if size >= 2**20 else "slots"
                rows.append(_row(coll, n, size, _ring(coll, n, size, *SHM[(coll, path)]), path))
    # the slots at large sizes too (a PYCOLL_ALGO=ring run on 4 ranks)
    for coll in COLLS:
        for size in (3 << 20, 12 << 20):
            rows.append(_row(coll, 4, size, _ring(coll, 4, size, *SHM[(coll, "slots")]), "slots"))
    return rows


def _tcp_rows() -> list[dict]:
    return [_row(c, 2, s, _ring(c, 2, s, *TCP[c]), "hierarchical") for c in COLLS for s in SIZES]


def test_time_of_a_given_path():
    shm = fit_model(_shm_rows(), cache_bytes=CACHE)
    size = 2**23
    assert shm.path("all_gather", 2, size) == "cma"  # what a one-host call of 8 MiB takes
    got = shm.time("all_gather", 2, size, "slots")
    assert got == pytest.approx(_ring("all_gather", 2, size, *SHM[("all_gather", "slots")]))
    assert shm.time("all_gather", 2, size) == pytest.approx(
        _ring("all_gather", 2, size, *SHM[("all_gather", "cma")])
    )
    # a path with no rows: the collective's fit over every path (link()'s fallback)
    assert shm.time("all_gather", 2, size, "direct") == shm.time("all_gather", 2, size, "any")
    assert ring_time("all_gather", 2, size, shm, "slots") == got
    assert ring_time("all_gather", 2, size, LinkCost(1e-6, 1e-9, "x"), "slots") == pytest.approx(
        1e-6 + size / 2 * 1e-9
    )


@pytest.mark.parametrize("per_host", [2, 4])
def test_hierarchical_steps_within_a_host_take_the_slots(per_host):
    """All-reduce: a reduce-scatter and an all-gather of the whole buffer within each host
    (rings over the slots, whatever a one-host call of that size takes), an all-reduce of
    1/per_host of it across the hosts; reduce-scatter and all-gather one half of each."""
    shm = fit_model(_shm_rows(), cache_bytes=CACHE)
    tcp = fit_model(_tcp_rows(), "tcp", cache_bytes=CACHE)
    assert INTRA_PATH == "slots"
    hosts, size = 2, 2**24
    n = hosts * per_host
    rs = _ring("reduce_scatter", per_host, size, *SHM[("reduce_scatter", "slots")])
    ag = _ring("all_gather", per_host, size, *SHM[("all_gather", "slots")])
    across = {c: _ring(c, hosts, size / per_host, *TCP[c]) for c in COLLS}
    want = {
        "all_reduce": rs + across["all_reduce"] + ag,
        "reduce_scatter": rs + across["reduce_scatter"],
        "all_gather": across["all_gather"] + ag,
    }
    for coll in COLLS:
        got = hierarchical_time(coll, n, per_host, size, shm, tcp)
        assert got == pytest.approx(want[coll], rel=1e-6), coll
    # one rank per host: the TCP ring alone, as fitted
    assert hierarchical_time("all_reduce", 2, 1, size, shm, tcp) == pytest.approx(
        _ring("all_reduce", 2, size, *TCP["all_reduce"]), rel=1e-6
    )


def test_across_hosts_follows_the_codes_rule():
    """csrc/algo/hierarchical.cc: hierarchical where every host holds as many ranks and
    PYCOLL_ALGO is not ring; else one flat ring over every rank; one host: its own path."""
    intra, inter = LinkCost(1e-6, 1 / 50e9, "i"), LinkCost(20e-6, 1 / 1e9, "x")
    s = 2**24
    assert across_hosts_time("all_reduce", [4], s, intra, inter) == (
        ring_time("all_reduce", 4, s, intra),
        "one host",
    )
    assert across_hosts_time("all_reduce", [4, 4], s, intra, inter) == (
        hierarchical_time("all_reduce", 8, 4, s, intra, inter),
        "hierarchical",
    )
    assert across_hosts_time("all_reduce", [4, 4], s, intra, inter, "ring") == (
        ring_time("all_reduce", 8, s, inter),
        "flat",
    )
    assert across_hosts_time("reduce_scatter", [4, 2], s, intra, inter) == (
        ring_time("reduce_scatter", 6, s, inter),
        "flat",
    )
    with pytest.raises(PlanInputError, match="ranks_per_host"):
        across_hosts_time("all_reduce", [2, 0], s, intra, inter)
    # the layouts price their groups by the same rule: 6 ranks of stride 1 on hosts of 4
    # are 4 + 2 (flat); 8 are 4 + 4 (hierarchical); 4 of stride 2 are 2 + 2
    req = parse_request({
        "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "global_batch": 8,
        "hosts": 2, "devices_per_host": 4, "memory_per_device": "1GB",
        "intra_host": "50GB/s,1us", "inter_host": "1GB/s,20us", "flops": "1TFLOP/s",
    })  # fmt: skip
    links = {"intra": intra, "inter": inter}
    assert _collective(req, "all_reduce", 6, 1, s, links) == ring_time("all_reduce", 6, s, inter)
    assert _collective(req, "all_reduce", 8, 1, s, links) == hierarchical_time(
        "all_reduce", 8, 4, s, intra, inter
    )
    assert _collective(req, "all_gather", 4, 2, s, links) == hierarchical_time(
        "all_gather", 4, 2, s, intra, inter
    )


@pytest.mark.parametrize("per_host", [2, 8])
def test_ring_vs_hierarchical_from_fitted_tcp(per_host):
    """From 8 to 4096 ranks with the fitted TCP and shared-memory models: the flat ring is
    the fitted TCP ring over every rank, hierarchical the formula above, "faster" the
    lesser of the two, and the communicator runs hierarchical on every multi-host count.
    At 4096 ranks the flat ring's 8190 TCP latencies lose."""
    shm = fit_model(_shm_rows(), cache_bytes=CACHE)
    tcp = fit_model(_tcp_rows(), "tcp", cache_bytes=CACHE)
    size = 2**22
    rows = ring_vs_hierarchical("all_reduce", size, per_host, shm, tcp)
    assert [r["ranks"] for r in rows] == [8 * 2**k for k in range(10)]
    for r in rows:
        n = r["ranks"]
        one_host = n == per_host
        ring = _ring("all_reduce", n, size, *TCP["all_reduce"])
        assert r["ring_s"] == pytest.approx(shm.time("all_reduce", n, size) if one_host else ring)
        assert r["hierarchical_s"] == pytest.approx(
            hierarchical_time("all_reduce", n, per_host, size, shm, tcp)
        )
        assert r["faster"] == ("ring" if r["ring_s"] < r["hierarchical_s"] else "hierarchical")
        assert r["runs"] == ("one host" if one_host else "hierarchical")
    assert rows[-1]["faster"] == "hierarchical"
    assert rows[-1]["ring_s"] > 1.5 * rows[-1]["hierarchical_s"]


def test_cli_fits_the_inter_host_link(tmp_path, capsys):
    inter = tmp_path / "tcp.json"
    inter.write_text(json.dumps({"metadata": {}, "rows": _tcp_rows()}))
    argv = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
            "--global-batch", "8", "--hosts", "2", "--devices-per-host", "2",
            "--memory-per-device", "1GB", "--intra-host", "10GB/s,1us",
            "--inter-host", "100GB/s,1us", "--flops", "100GFLOP/s"]  # fmt: skip
    out_json = tmp_path / "plan.json"
    # the per-path model (--inter-model paths; the default is tcp_model's, test_plan_tcp_model)
    paths = ["--inter-model", "paths"]
    assert main([*argv, *paths, "--inter-bench-json", str(inter), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "link inter: alpha" in out and str(inter) in out, out
    links = json.loads(out_json.read_text())["links"]
    assert links["inter"]["transport"] == "tcp" and links["intra"]["source"].startswith("given")
    fitted = {(d["collective"], d["path"]) for d in links["inter"]["fitted"]}
    assert ("all_reduce", "hierarchical") in fitted
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main([*argv, "--inter-bench-json", str(bad)]) == 2
    assert "cannot be read as JSON" in capsys.readouterr().err


def test_a_regime_without_latency_takes_the_paths_latency():
    """TCP rows whose large sizes resolve no latency (their intercept negative: noise) take
    the latency of the path's small-size rows; without it a flat ring over 4096 ranks would
    pay none of its 8190 steps and win against hierarchical."""
    cache, alpha, beta = 2**19, 100e-6, 1 / 1e9
    rows = []
    for coll in COLLS:
        for size in (2**16, 2**18):  # cached: latency and bandwidth
            rows.append(_row(coll, 2, size, _ring(coll, 2, size, alpha, beta), "hierarchical"))
        for size, slow in ((2**20, 1.0), (2**22, 1.0), (2**24, 1.3)):  # memory, noisy
            t = _ring(coll, 2, size, 0.0, beta / 4) * slow
            rows.append(_row(coll, 2, size, t, "hierarchical"))
    tcp = fit_model(rows, "tcp", cache_bytes=cache)
    for coll in COLLS:
        cached = tcp.link(coll, "hierarchical", "cached")
        memory = tcp.link(coll, "hierarchical", "memory")
        assert cached.alpha == pytest.approx(alpha, rel=1e-6)
        assert memory.alpha == cached.alpha and "latency of the cached rows" in memory.source
        assert 0 < memory.beta < beta / 4  # refitted with the latency: the noisy row weighs
    shm = fit_model(_shm_rows(), cache_bytes=CACHE)
    far = ring_vs_hierarchical("all_reduce", 2**24, 2, shm, tcp)[-1]
    assert far["ranks"] == 4096 and far["faster"] == "hierarchical"
    assert far["ring_s"] > 8190 * alpha
