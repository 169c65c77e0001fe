"""The TCP cost model from what each algorithm does across hosts (strategies/plan/tcp_model.py):
per-rank work of the flat ring and the hierarchical schedules on small-integer sizes, the
cores' share, fits that recover known constants from rows they generated, and the CLI's
choice of model."""

from __future__ import annotations

import json

import pytest

from pycollectives.strategies.plan.cli import main
from pycollectives.strategies.plan.inputs import PlanInputError
from pycollectives.strategies.plan.shm_model import ShmModel, footprint, share, work
from pycollectives.strategies.plan.tcp_model import TcpModel, fit_sharing, fit_tcp, link_work

KIB, MIB = 1 << 10, 1 << 20
COLLS = ("all_reduce", "reduce_scatter", "all_gather")


def _shm() -> ShmModel:
    return ShmModel(3e-6, 1 / 10e9, 1 / 5e9, 1 / 8e9, 0.0, 0.0, None, 32 * MIB)


def _tcp(shm: ShmModel | None = None, cores: int | None = None) -> TcpModel:
    s = shm or _shm()
    return TcpModel(20e-6, 5e-6, 1 / 4e9, s.per_copy, s.per_reduce, shm, cores)


@pytest.mark.parametrize("hosts", [2, 3, 4])
def test_one_rank_per_host_both_sides_cross(hosts):
    s = hosts * MIB  # B = 1 MiB: 4 frames of 256 KiB a step and side
    ar, rs, ag = (link_work(c, hosts, 1, s) for c in COLLS)
    k = hosts - 1
    assert (ar.net, ar.frames, ar.steps, ar.handoffs) == (2 * 2 * k * MIB, 2 * 2 * k * 4, 2 * k, 2 * k * 4)  # fmt: skip
    assert (rs.net, rs.frames, rs.steps, rs.handoffs) == (2 * k * MIB, 2 * k * 4, k, k * 4)
    assert (ag.net, ag.frames, ag.steps, ag.handoffs) == (2 * k * MIB, 2 * k * 4, k, k * 4)
    # the copies and reductions are the ring's over shared memory (fused steps)
    for c, w in zip(COLLS, (ar, rs, ag), strict=True):
        sw = work(c, "slots", hosts, s)
        assert (w.copy, w.reduce) == (sw.copy, sw.reduce)
    assert link_work("all_gather", hosts, 1, hosts * (MIB + 1)).frames == 2 * k * 5


def test_flat_ring_over_hosts_one_side_per_rank():
    """2 hosts x 2 ranks: 4 links, 2 cross hosts; each rank sends or receives over TCP, the
    sender bearing the link's kernel work at both ends (module docstring)."""
    s = 4 * MIB  # B = 1 MiB
    ar = link_work("all_reduce", 2, 2, s)
    assert (ar.net, ar.frames, ar.steps, ar.handoffs) == (2 * 6 * MIB, 6 * 4, 6, 6 * 4)
    ag = link_work("all_gather", 2, 2, s)
    assert (ag.net, ag.frames, ag.steps) == (2 * 3 * MIB, 3 * 4, 3)
    one_host = link_work("all_reduce", 1, 4, s)
    assert (one_host.net, one_host.frames, one_host.handoffs) == (0, 0, 6 * 4)


def test_hierarchical_is_within_hosts_then_across():
    shm = _shm()
    m = _tcp(shm)
    s = 4 * MIB
    across = m.busy(link_work("all_reduce", 2, 1, s / 2))
    rs, ag = work("reduce_scatter", "slots", 2, s), work("all_gather", "slots", 2, s)
    intra = sum(
        shm.alpha * w.handoffs + w.copy * shm.per_copy + w.reduce * shm.per_reduce for w in (rs, ag)
    )
    busy, waits = m.parts("all_reduce", 2, 2, s, False)
    assert busy == pytest.approx(across + intra)
    assert waits == link_work("all_reduce", 2, 1, s / 2).handoffs + rs.handoffs + ag.handoffs
    assert m.hierarchical_time("all_reduce", 2, 2, s) == pytest.approx(busy)
    rs_only = m.busy(link_work("reduce_scatter", 2, 1, s / 2))
    rs_intra = shm.alpha * rs.handoffs + rs.copy * shm.per_copy + rs.reduce * shm.per_reduce
    assert m.hierarchical_time("reduce_scatter", 2, 2, s) == pytest.approx(rs_only + rs_intra)
    # one rank per host: the across-host ring alone, what time() prices
    assert m.hierarchical_time("all_gather", 3, 1, s) == pytest.approx(m.time("all_gather", 3, s))


def test_ranks_past_the_cores():
    m = _tcp(_shm(), cores=2)
    m.contention, m.per_wait = 0.5, 30e-6
    busy, waits = m.parts("all_gather", 2, 2, MIB, True)
    assert m.flat_time("all_gather", 2, 2, MIB, sharing=2) == pytest.approx(busy)
    want = share(4, 2, 0.5) * busy + 1.0 * 30e-6 * waits  # 2 ranks past 2 cores: 1 per core
    assert m.flat_time("all_gather", 2, 2, MIB, sharing=4) == pytest.approx(want)


def _rows(model: TcpModel, sharing: int | None = None) -> list[dict]:
    rows = []
    for c in COLLS:
        for size in (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB):
            t = model.hierarchical_time(c, 2, 1, size, sharing or 2)
            rows.append({"collective": c, "nranks": 2, "size": size, "time_us": t * 1e6,
                         "layout": "2x1"})  # fmt: skip
    return rows


def test_fit_recovers_its_constants():
    shm = _shm()
    true = _tcp(shm, cores=2)
    got = fit_tcp(_rows(true), shm, cores=2, sharing="all")
    for k in ("per_step", "per_frame", "per_net", "per_copy", "per_reduce"):
        assert getattr(got, k) == pytest.approx(getattr(true, k), rel=1e-6), k
    assert got.rows == 15 and "tcp, per algorithm" in got.source
    # it prices its own rows (exact here) as it says: every one within 20%, by its schedule
    assert got.agreement["rows"] == 15 and got.agreement["within_20pct"] == 15
    assert got.agreement["median_abs_error"] == pytest.approx(0.0, abs=1e-6)
    assert got.agreement["worst"]["row"].split(", ")[1] == "2x1"
    # without a shared-memory model the copy and reduction rates are fitted as well
    alone = fit_tcp(_rows(true), None, cores=2, sharing="all")
    assert alone.per_net == pytest.approx(true.per_net, rel=1e-6)
    assert alone.per_reduce == pytest.approx(true.per_reduce, rel=1e-6)


def test_fit_sharing_recovers_contention_and_wait():
    shm = _shm()
    true = _tcp(shm, cores=2)
    true.contention, true.per_wait = 0.25, 40e-6
    rows = []
    for layout, flat in (("2x2", False), ("2x2 ring", True)):
        for c in COLLS:
            for size in (64 * KIB, MIB, 16 * MIB):
                busy, waits = true.parts(c, 2, 2, size, flat)
                t = true._shared(busy, waits, 4)
                rows.append({"collective": c, "nranks": 4, "size": size, "time_us": t * 1e6,
                             "layout": layout})  # fmt: skip
    start = _tcp(shm, cores=2)
    got = fit_sharing(start, rows)
    assert got.contention == pytest.approx(0.25, rel=1e-6)
    assert got.per_wait == pytest.approx(40e-6, rel=1e-6)
    assert fit_sharing(start, _rows(true)) is start  # no row past the cores: unchanged


def test_bad_input_is_named():
    with pytest.raises(PlanInputError, match="collective='broadcast'"):
        link_work("broadcast", 2, 1, MIB)
    with pytest.raises(PlanInputError, match="hosts=0"):
        link_work("all_reduce", 0, 2, MIB)
    with pytest.raises(PlanInputError, match="size=0"):
        link_work("all_gather", 2, 1, 0)
    with pytest.raises(PlanInputError, match="sharing='some'"):
        fit_tcp([], None, sharing="some")
    with pytest.raises(PlanInputError, match="0 usable rows"):
        fit_tcp([{"collective": "all_reduce", "nranks": 2, "size": 1024, "time_us": 1.0}])
    assert _tcp().time("all_reduce", 1, MIB) == 0.0


def test_cli_prices_tcp_per_algorithm_or_per_path(tmp_path, capsys):
    inter = tmp_path / "tcp.json"
    inter.write_text(json.dumps({"metadata": {}, "rows": _rows(_tcp(_shm()))}))
    argv = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
            "--global-batch", "8", "--hosts", "2", "--devices-per-host", "2",
            "--memory-per-device", "1GB", "--intra-host", "10GB/s,1us",
            "--inter-host", "100GB/s,1us", "--flops", "100GFLOP/s",
            "--inter-bench-json", str(inter)]  # fmt: skip
    for model, want in (("algorithms", "tcp, per algorithm"), ("paths", "per path and regime")):
        out_json = tmp_path / f"{model}.json"
        assert main([*argv, "--inter-model", model, "--json", str(out_json)]) == 0
        out = capsys.readouterr().out
        inter_link = json.loads(out_json.read_text())["links"]["inter"]
        assert want in inter_link["source"] and inter_link["transport"] == "tcp", out


def test_past_the_cache_the_memory_may_pace_it():
    """4 ranks whose buffers together pass the shared-memory model's cache: the memory's
    time for every rank's traffic (a copy 2 bytes per byte, a reduction 3, a kernel copy 2)
    where it is longer than the cores'."""
    shm = ShmModel(3e-6, 1 / 10e9, 1 / 5e9, 1 / 8e9, 0.0, 1 / 1e9, None, 4 * MIB)
    m = _tcp(shm)
    s = 4 * MIB
    across = link_work("all_gather", 2, 1, s / 2)
    intra = work("all_gather", "slots", 2, s)
    per_rank = 2 * intra.copy + 2 * across.copy + 2 * across.net
    want = 4 * per_rank / 1e9
    assert m.memory_time("all_gather", 2, 2, s, False, 4) == pytest.approx(want)
    assert m.hierarchical_time("all_gather", 2, 2, s, sharing=4) == pytest.approx(want)
    assert m.memory_time("all_gather", 2, 2, MIB / 2, False, 4) == 0.0  # within the cache
    flat = link_work("reduce_scatter", 2, 2, s)
    want = 4 * (2 * flat.copy + 3 * flat.reduce + 2 * flat.net) / 1e9
    assert m.memory_time("reduce_scatter", 2, 2, s, True, 4) == pytest.approx(want)
    # the fit leaves the rows past the cache to the memory, and recovers the rest
    rows = _rows(_tcp(shm, cores=2))
    got = fit_tcp(rows, shm, cores=2, sharing="all")
    assert got.per_net == pytest.approx(1 / 4e9, rel=1e-6)
    # within the cache: the 2 ranks' inputs and outputs under 4 MiB
    assert got.rows == sum(footprint(r["collective"], 2, r["size"]) < 4 * MIB for r in rows)
