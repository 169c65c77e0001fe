"""The shared-memory cost model from what each algorithm does (strategies/plan/shm_model.py):
its per-rank work on small-integer sizes, the cores' share, the paths the code may take, and
a fit that recovers known constants from rows it generated."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pycollectives.strategies.plan.inputs import PlanInputError
from pycollectives.strategies.plan.shm_fit import cma_past_cores, fit_busiest, fit_shm
from pycollectives.strategies.plan.shm_model import (
    ShmModel,
    agreement,
    agreement_text,
    cma_band,
    code_paths,
    footprint,
    share,
    slot_bytes,
    traffic,
    work,
)

KIB, MIB = 1 << 10, 1 << 20
DATA = Path(__file__).resolve().parents[3] / "docs" / "data"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_work_per_rank(n):
    s = n * MIB  # B = 1 MiB: 4 slots of 256 KiB
    ar, rs, ag = (work(c, "slots", n, s) for c in ("all_reduce", "reduce_scatter", "all_gather"))
    assert (ar.copy, ar.reduce, ar.kernel, ar.handoffs) == (s, (n - 1) * MIB, 0, 2 * (n - 1) * 4)
    assert (rs.copy, rs.reduce, rs.kernel, rs.handoffs) == (MIB, (n - 1) * MIB, 0, (n - 1) * 4)
    assert (ag.copy, ag.reduce, ag.kernel, ag.handoffs) == (s, 0, 0, (n - 1) * 4)
    # the all-reduce is the reduce-scatter then the all-gather of its result
    assert ar.copy == rs.copy + ag.copy - MIB and ar.reduce == rs.reduce
    assert ar.handoffs == rs.handoffs + ag.handoffs
    # a partial slot is a handoff of its own
    assert work("all_gather", "slots", n, n * (MIB + 1)).handoffs == (n - 1) * 5


def test_slots_shrink_with_the_ranks():
    assert [slot_bytes(n) for n in (2, 4, 5, 8, 9, 4096)] == [256 * KIB] * 2 + [128 * KIB] * 2 + [64 * KIB] * 2  # fmt: skip
    assert (
        work("reduce_scatter", "slots", 8, 8 * MIB).handoffs == 7 * 8
    )  # 1 MiB blocks, 128 KiB slots
    assert work("reduce_scatter", "slots", 8, 8 * MIB, slot=MIB).handoffs == 7


@pytest.mark.parametrize("n", [2, 3, 4])
def test_oneshot_and_single_copy_work_per_rank(n):
    s = n * 8 * KIB
    w = work("all_reduce", "oneshot", n, s)
    assert (w.copy, w.reduce, w.handoffs) == (s, (n - 1) * s, 1)
    w = work("reduce_scatter", "oneshot", n, s)
    assert (w.copy, w.reduce, w.handoffs) == (s, (n - 1) * 8 * KIB, 1)
    w = work("all_gather", "oneshot", n, s)
    assert (w.copy, w.reduce, w.handoffs) == (s + 8 * KIB, 0, 1)
    s = n * MIB  # single copy: each rank's n-th of the whole; chunks of 256 KiB
    w = work("all_reduce", "cma", n, s)
    assert (w.copy, w.reduce, w.kernel, w.handoffs) == (0, (n - 1) * MIB, 2 * (n - 1) * MIB, 2 * (n - 1) * 4)  # fmt: skip
    w = work("reduce_scatter", "cma", n, s)
    assert (w.copy, w.reduce, w.kernel) == (0, (n - 1) * MIB, (n - 1) * MIB)
    w = work("all_gather", "cma", n, s)
    assert (w.copy, w.reduce, w.kernel) == (MIB, 0, (n - 1) * MIB)
    assert traffic(w) == 2 * MIB + 2 * (n - 1) * MIB


def test_bad_work_arguments():
    with pytest.raises(PlanInputError, match="broadcast"):
        work("broadcast", "slots", 2, MIB)
    with pytest.raises(PlanInputError, match="path='tcp'"):
        work("all_reduce", "tcp", 2, MIB)
    with pytest.raises(PlanInputError, match="n=1"):
        work("all_reduce", "slots", 1, MIB)


def test_share_of_the_cores():
    assert share(2, 2) == 1.0 and share(8, None) == 1.0 and share(1, 4, 3.0) == 1.0
    assert share(4, 2) == 2.0 and share(3, 2, 0.0, 0.0) == 1.5  # time-sharing alone
    assert share(3, 2) == 2.0  # unless fitted, the busiest core's load (ceil(3 / 2))
    assert share(3, 2, 1.0, 0.0) == pytest.approx(1.5 * 1.5)  # one rank past 2 cores: +1/2
    assert share(4, 2, 1.0) == pytest.approx(2 * 2)
    assert share(12, 8, 2.0, 0.0) == pytest.approx(1.5 * 2)
    assert share(12, 8, 2.0) == pytest.approx(2 * 2)  # 2 ranks on the busiest core
    with pytest.raises(PlanInputError, match="cores"):
        share(4, 0)
    # the busiest core's weight moves the load of 3 ranks on 2 cores from 1.5 towards 2
    assert share(3, 2, 0.0, 1.0) == 2.0 and share(3, 2, 0.0, 0.5) == 1.75
    assert share(3, 2, 1.0, 1.0) == pytest.approx(2 * 1.5)
    assert share(4, 2, 0.0, 1.0) == 2.0  # a multiple of the cores: no busier core


def test_the_paths_the_code_may_take():
    # one-shot up to 32 KiB (an all-gather's block per rank), single copy inside its bands
    assert code_paths("all_reduce", 2, 32 * KIB) == ["oneshot"]
    assert code_paths("all_reduce", 2, 64 * KIB) == ["slots"]
    assert code_paths("all_reduce", 2, MIB) == ["cma", "slots"]
    assert code_paths("all_reduce", 4, 32 * MIB) == ["slots"]
    assert code_paths("all_gather", 2, 64 * KIB) == ["cma", "oneshot"]
    assert code_paths("all_gather", 4, 128 * KIB) == ["oneshot"]
    assert code_paths("all_gather", 4, 256 * KIB) == ["slots"]
    assert code_paths("reduce_scatter", 4, 8 * MIB) == ["slots"]
    assert code_paths("reduce_scatter", 3, 64 * MIB) == ["cma", "slots"]
    assert not cma_band("all_reduce", 8, MIB)
    assert code_paths("all_reduce", 64, 16 * KIB) == ["oneshot"]
    assert code_paths("all_reduce", 65, 16 * KIB) == ["slots"]


def test_the_recorded_paths_are_among_those_priced():
    """Every row of the recorded runs took a path code_paths() allows (the Python mirror of
    cma_band and the one-shot size keeps to csrc/comm/)."""
    runs = sorted(DATA.glob("plan_costs-*.json"))
    seen = 0
    for run in runs:
        data = json.loads(run.read_text())
        for r in data.get("raw", {}).get("fit", []) + data.get("raw", {}).get("check", []):
            for path in r["paths"]:
                assert path in code_paths(r["collective"], r["nranks"], r["size"]), (run, r)
                seen += 1
        for r in data["rows"]:
            assert r["path_check"] in code_paths(r["collective"], r["nranks"], r["size"]), r
            seen += 1
    assert seen > 100, runs


# Past the 8 MiB cache every row is memory-bound (its memory time exceeds its cores').
TRUTH = ShmModel(2e-6, 1 / 16e9, 1 / 12e9, 1 / 6e9, 1.0, 1 / 8e9, 2, 8 * MIB)


def _rows(ranks=(2, 4), sizes=(64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)):
    rows = []
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for n in ranks:
            for size in sizes:
                for path in code_paths(coll, n, size):
                    t = TRUTH.path_time(coll, path, n, size)
                    rows.append({"collective": coll, "nranks": n, "size": size,
                                 "time_us": t * 1e6, "paths": {path: 10}})  # fmt: skip
    return rows


def test_fit_recovers_the_constants_and_predicts_held_out_ranks():
    model = fit_shm(_rows(), cores=2, cache_bytes=8 * MIB)
    for name in ("alpha", "per_copy", "per_reduce", "per_kernel", "contention", "per_traffic"):
        assert getattr(model, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for size in (128 * KIB, 512 * KIB, 2 * MIB, 8 * MIB):
            for n in (3, 4):  # 3 ranks: never fitted; past the cores
                want = min(TRUTH.path_time(coll, p, n, size) for p in code_paths(coll, n, size))
                assert model.time(coll, n, size) == pytest.approx(want, rel=1e-6), (coll, n, size)
                assert model.path(coll, n, size) in code_paths(coll, n, size)
    assert model.time("all_reduce", 1, MIB) == 0.0
    assert model.time("all_gather", 4, MIB, "slots") == pytest.approx(
        TRUTH.path_time("all_gather", "slots", 4, MIB)
    )
    assert {d["constant"] for d in model.describe()} >= {"copy bandwidth", "alpha (per handoff)"}


def test_fit_busiest_from_ranks_not_a_multiple_of_the_cores():
    """2 and 4 ranks on 2 cores cannot tell the busiest core's weight; rows at 3 can."""
    truth = replace(TRUTH, busiest=0.35)
    rows = []
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for size in (64 * KIB, 256 * KIB, MIB):
            path = code_paths(coll, 3, size)[-1]
            t = truth.path_time(coll, path, 3, size)
            rows.append({"collective": coll, "nranks": 3, "size": size, "time_us": t * 1e6,
                         "paths": {path: 10}})  # fmt: skip
    assert fit_shm(_rows(), cores=2, cache_bytes=8 * MIB).busiest == 1.0  # unfitted: 1
    model = fit_shm(_rows() + rows, cores=2, cache_bytes=8 * MIB)
    assert model.busiest == pytest.approx(0.35) and "busiest: 9 rows" in model.source
    assert fit_busiest(TRUTH, rows).busiest == pytest.approx(0.35)
    assert fit_busiest(TRUTH, _rows()) is TRUTH  # no row it moves


def test_footprint_counts_every_rank_input_and_output():
    assert footprint("all_reduce", 4, 8 * KIB) == 4 * 16 * KIB
    assert footprint("reduce_scatter", 4, 8 * KIB) == 4 * (8 + 2) * KIB
    assert footprint("all_gather", 2, 8 * KIB) == 2 * (8 + 4) * KIB
    with pytest.raises(PlanInputError, match="collective"):
        footprint("broadcast", 2, KIB)


@pytest.mark.parametrize("cache_share", [1.0, 0.5, 0.25])
def test_fit_finds_the_share_of_the_cache_the_buffers_get(cache_share):
    """Rows made with the memory regime from a share of the cache: the fit takes that
    share (the rows between the shares tell them apart) and the constants with it."""
    truth = replace(TRUTH, cache_share=cache_share)
    rows = []
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for n in (2, 4):
            for size in (64 * KIB, 256 * KIB, 512 * KIB, MIB, 2 * MIB, 4 * MIB, 16 * MIB):
                path = code_paths(coll, n, size)[-1]
                t = truth.path_time(coll, path, n, size)
                rows.append({"collective": coll, "nranks": n, "size": size,
                             "time_us": t * 1e6, "paths": {path: 10}})  # fmt: skip
    model = fit_shm(rows, cores=2, cache_bytes=8 * MIB)
    assert model.cache_share == cache_share
    assert model.per_traffic == pytest.approx(TRUTH.per_traffic, rel=1e-6)
    assert model.per_copy == pytest.approx(TRUTH.per_copy, rel=1e-6)
    assert model.past_cache("all_reduce", 2, MIB) == (cache_share < 1)  # 4 MiB of buffers


def test_single_copy_is_priced_past_the_cores_only_where_the_tuners_took_it():
    """Past the cores (4 ranks on 2) the fit prices single copy only if the rows' tuners ran
    it in at least half of their calls there; within the cores it is priced as before."""
    rows = _rows()
    band = [
        r for r in rows if r["nranks"] == 4 and "cma" in code_paths(r["collective"], 4, r["size"])
    ]
    assert band
    for r in band:
        r["paths"] = {"slots": 7, "cma": 3} if r["paths"].get("slots") else {"cma": 10}
    assert cma_past_cores(rows, cores=2)  # every band row ran once on each path: 3 + 10 of 20
    for r in band:
        r["paths"] = {"slots": 7, "cma": 3}
    assert not cma_past_cores(rows, cores=2)
    assert cma_past_cores(rows, cores=4) and cma_past_cores(rows, cores=None)  # none past
    model = fit_shm(rows, cores=2, cache_bytes=8 * MIB)
    assert not model.cma_past_cores
    assert set(model.options("all_gather", 4, 4 * MIB)) == {"slots"}
    assert "cma" in model.options("all_gather", 2, 4 * MIB)  # ranks within the cores


def test_agreement_summarizes_predicted_over_measured():
    a = agreement([("a", 1.0), ("b", 0.5), ("c", 1.3), ("d", 1.1)])
    assert a["rows"] == 4 and a["within_20pct"] == 2  # |error| 0 and 0.1
    assert a["median_abs_error"] == pytest.approx(0.2)  # of 0, 0.1, 0.3, 0.5
    assert a["worst"] == {"row": "b", "ratio": 0.5}  # 2x off beats 1.3x off
    assert agreement_text(a) == "2/4 rows within 20%, median |error| 20%, worst 0.50x (b)"
    assert agreement([]) == {"rows": 0} and agreement_text(None) == ""


def test_the_fit_says_how_it_prices_its_own_rows():
    rows = _rows()
    model = fit_shm(rows, cores=2, cache_bytes=8 * MIB)
    a = model.agreement
    assert a["rows"] == len(rows) and a["within_20pct"] == len(rows)  # made by a ShmModel
    assert a["median_abs_error"] == pytest.approx(0.0, abs=1e-6)
    # a row measured 2x slower than the rest say is the worst, named
    rows[5]["time_us"] *= 2
    a = fit_shm(rows, cores=2, cache_bytes=8 * MIB).agreement
    r = rows[5]
    assert a["worst"]["row"] == f"{r['collective']}, {r['nranks']} ranks, {r['size'] >> 10} KiB"
    assert a["worst"]["ratio"] < 0.8 and a["within_20pct"] < len(rows)


def test_fit_without_rows_past_the_cores_or_the_cache():
    rows = _rows(ranks=(2,), sizes=(64 * KIB, 256 * KIB, MIB))
    model = fit_shm(rows, cores=2, cache_bytes=8 * MIB)
    assert model.per_copy == pytest.approx(TRUTH.per_copy, rel=1e-6)
    assert model.per_traffic == 0.0  # nothing past the cache: the cores' time alone
    with pytest.raises(PlanInputError, match="usable rows"):
        fit_shm(rows[:1], cores=2)
