"""The planner's collective cost model fitted per path and cache regime (strategies/plan/fitted.py),
on synthetic bench rows whose times come from known latencies and bandwidths."""

from __future__ import annotations

import pytest

from pycollectives.strategies.plan import parse_request
from pycollectives.strategies.plan.cli import main, plan
from pycollectives.strategies.plan.costs import (
    LinkCost,
    core_share,
    hierarchical_time,
    ring_time,
)
from pycollectives.strategies.plan.fitted import fit_model, local_cache_bytes, row_path
from pycollectives.strategies.plan.inputs import PlanInputError

CACHE = 2 << 20
# (path, regime) -> (alpha s, seconds per byte); the path each size takes below
TRUTH = {
    ("slots", "cached"): (2e-6, 1 / 8e9),
    ("cma", "cached"): (5e-6, 1 / 14e9),
    ("cma", "memory"): (20e-6, 1 / 3e9),
    ("slots", "memory"): (40e-6, 1 / 2e9),
}
PATH = {2**16: "slots", 2**18: "slots", 2**20: "cma", 2**22: "cma", 2**24: "slots"}


def _steps(coll: str, n: int, size: float) -> tuple[float, float]:
    k = 2 if coll == "all_reduce" else 1
    return k * (n - 1), k * (n - 1) / n * size


def _time(coll: str, n: int, size: int, path: str) -> float:
    alpha, beta = TRUTH[(path, "cached" if size <= CACHE else "memory")]
    steps, wire = _steps(coll, n, size)
    return steps * alpha + wire * beta


def _rows(ranks=(2, 4), sizes=tuple(PATH)) -> list[dict]:
    return [
        {"backend": "pycoll", "collective": coll, "nranks": n, "size": size,
         "time_us": _time(coll, n, size, PATH[size]) * 1e6, "paths": {PATH[size]: 20}}
        for coll in ("all_reduce", "reduce_scatter", "all_gather")
        for n in ranks for size in sizes
    ]  # fmt: skip


def test_fit_per_path_and_regime_predicts_held_out_ranks():
    model = fit_model(_rows(), cache_bytes=CACHE)
    assert model.cache_bytes == CACHE and model.transport == "shm"
    for (path, regime), (alpha, beta) in TRUTH.items():
        got = model.link("all_reduce", path, regime)
        assert got.alpha == pytest.approx(alpha, rel=1e-6), (path, regime, got)
        assert got.beta == pytest.approx(beta, rel=1e-6), (path, regime, got)
    # 3 ranks were never measured: the path of the nearest measured point, its fit
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for size, path in PATH.items():
            assert model.path(coll, 3, size) == path
            assert model.time(coll, 3, size) == pytest.approx(_time(coll, 3, size, path))
    # costs.ring_time (and so hierarchical_time and the layouts) price with the model
    assert ring_time("all_gather", 4, 2**20, model) == model.time("all_gather", 4, 2**20)
    inter = LinkCost(10e-6, 1 / 1e9, "x")
    assert hierarchical_time("all_reduce", 8, 4, 2**24, model, inter) == pytest.approx(
        2 * model.time("reduce_scatter", 4, 2**24) + ring_time("all_reduce", 2, 2**22, inter)
    )
    assert model.time("all_reduce", 1, 2**20) == 0.0
    with pytest.raises(PlanInputError, match="broadcast"):
        model.time("broadcast", 4, 2**20)


def test_one_alpha_beta_cannot_fit_what_the_paths_do():
    """The old single fit over every row misses some rows by more than 20%: the per-path
    model is what brings them within (this fails if fit_model ignores paths or regimes)."""
    from pycollectives.strategies.plan.costs import fit

    rows = _rows()
    one = fit(rows)
    worst_one = max(abs(ring_time(r["collective"], r["nranks"], r["size"], one) * 1e6 / r["time_us"] - 1) for r in rows)  # fmt: skip
    model = fit_model(rows, cache_bytes=CACHE)
    worst = max(abs(model.time(r["collective"], r["nranks"], r["size"]) * 1e6 / r["time_us"] - 1) for r in rows)  # fmt: skip
    assert worst_one > 0.2 and worst < 1e-6, (worst_one, worst)


def test_ranks_beyond_the_cores_are_divided_out_of_the_fit_and_multiplied_back():
    """Rows of 4 ranks time-sharing 2 cores take twice the per-core time: fitted with the
    cores, the model recovers the per-core costs exactly, and prices 3 ranks (never
    measured) at 1.5 times them; without the cores, one fit across 2 and 4 ranks cannot."""
    rows = _rows()
    for r in rows:
        r["time_us"] *= core_share(r["nranks"], 2)
    model = fit_model(rows, cache_bytes=CACHE, cores=2)
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for size, path in PATH.items():
            for n in (2, 3, 4):
                got = model.time(coll, n, size) * core_share(n, 2)
                assert got == pytest.approx(_time(coll, n, size, path) * max(1, n / 2)), (coll, n)
    naive = fit_model(rows, cache_bytes=CACHE)
    worst = max(abs(naive.time(r["collective"], r["nranks"], r["size"]) * 1e6 / r["time_us"] - 1) for r in rows)  # fmt: skip
    assert worst > 0.2, worst
    assert core_share(3, None) == 1.0 and core_share(1, 8) == 1.0 and core_share(12, 8) == 1.5
    with pytest.raises(PlanInputError, match="cores"):
        core_share(4, 0)


def test_fallbacks_and_bad_rows():
    rows = _rows()
    for r in rows:
        del r["paths"]  # a JSON from before rows recorded paths: one fit per regime
    model = fit_model(rows, cache_bytes=CACHE)
    assert model.path("all_reduce", 2, 2**20) == "any"
    assert row_path({"paths": {"slots": 3, "cma": 17}}) == "cma" and row_path({}) == "any"
    with pytest.raises(PlanInputError, match="no usable rows"):
        fit_model([r for r in rows if r["size"] < 2**16])
    with pytest.raises(PlanInputError, match="cache_bytes"):
        fit_model(rows, cache_bytes=0)
    assert local_cache_bytes() > 0


def test_cli_prices_with_the_fitted_model(tmp_path, capsys):
    import json

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"metadata": {}, "rows": _rows()}))
    argv = ["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
            "--global-batch", "8", "--hosts", "1", "--devices-per-host", "4",
            "--memory-per-device", "1GB", "--intra-host", "10GB/s,1us",
            "--inter-host", "1GB/s,10us", "--flops", "100GFLOP/s"]  # fmt: skip
    out_json = tmp_path / "plan.json"
    assert main([*argv, "--bench-json", str(path), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "shm, per algorithm" in out, out  # --bench-json: shm_model.fit_shm
    intra = json.loads(out_json.read_text())["links"]["intra"]
    assert intra["transport"] == "shm" and {"constant", "value"} <= set(intra["fitted"][0])
    agreed = intra["agreement"]  # how the fit prices the rows it was fitted to, in both
    assert agreed["rows"] > 0 and 0 <= agreed["within_20pct"] <= agreed["rows"]
    assert f"rows it was fitted to: {agreed['within_20pct']}/{agreed['rows']} rows within" in out
    req = parse_request(json.loads(json.dumps({"layers": 4, "hidden": 64, "heads": 4,
        "vocab": 256, "seq": 32, "global_batch": 8, "hosts": 1, "devices_per_host": 4,
        "memory_per_device": "1GB", "intra_host": "10GB/s,1us", "inter_host": "1GB/s,10us",
        "flops": "100GFLOP/s"})))  # fmt: skip
    fits, _ = plan(req, {"intra": fit_model(_rows()), "inter": LinkCost(1e-5, 1e-9, "x")})
    assert fits and fits[0].step_s > 0


def test_train_gpt_plan_says_how_its_bench_fit_prices_the_rows(tmp_path):
    """local_request (train_gpt.py --plan --bench-json): the intra-host link it fits says
    how it prices the rows it was fitted to, beside its source."""
    import json

    from pycollectives.strategies.plan.local import local_request

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"metadata": {}, "rows": _rows()}))
    model = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8}
    _, links, said = local_request(model, 4, 2, 1, bench_json=str(path), collective=(0.0, 0.0))
    agreed = links["intra"].agreement
    line = next(x for x in said if x.startswith("intra-host link:"))
    assert str(path) in line and f"{agreed['within_20pct']}/{agreed['rows']} rows within" in line
