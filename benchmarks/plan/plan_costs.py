"""The planner's collective cost model against this machine's measured times (shared memory).

    python benchmarks/plan/plan_costs.py              # fit 2 and 4 ranks, check 2, 3, 4
    python benchmarks/plan/plan_costs.py --no-write
    python benchmarks/plan/plan_costs.py --replay docs/data/plan_costs-DATE.json  # price a recorded run again
    python benchmarks/plan/plan_costs.py --replay docs/data/plan_costs-DATE.json --in-run --model paths

Two `pycollectives-bench --json` runs of all_reduce, reduce_scatter and all_gather: a fit
run (--fit-ranks, 64 KiB to 16 MiB x4 apart) and a check run (--check-ranks, 64 KiB to
16 MiB x2 apart), launched in turn --rounds times, each row's time by default the median
of all its trials over the launches (on this VM the cores' shared-memory traffic switches
between a fast state and one 3-6x slower for seconds at a time, with or without
pycollectives: benchmarks/collectives/fresh_communicators.py; pooling the trials of launches
spread over minutes weighs the states by how often the machine is in them, which the least
trial of one launch, or a median of a few launches' least trials, does not). The planner's model
(strategies/plan/shm_model.py: per algorithm the bytes each rank copies, reduces and has
the kernel copy and its handoffs, the cores' share when ranks outnumber them, the memory's
bandwidth past the last-level cache, the path the code would take) is fitted to the first
and predicts every row of the second, which holds sizes (128 KiB, 512 KiB, 2 MiB, 8 MiB)
and a rank count (3) the fit never saw. `--model paths` prices with the previous model
(strategies/plan/fitted.py: alpha and beta of the ring formulas per collective, path taken
and cache regime) for comparison. The points both runs measured say how far the machine
itself repeats (run to run). Target:
within 20% from 64 KiB up. Writes its section of docs/benchmarks.md (between
<!-- plan_costs:begin --> and <!-- plan_costs:end -->) and docs/data/plan_costs-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import busy_cores, cpu_model, emit_section, run_bench, size_label  # noqa: E402

from pycollectives.strategies.plan.costs import core_share  # noqa: E402
from pycollectives.strategies.plan.fitted import CostModel, fit_model, row_path  # noqa: E402
from pycollectives.strategies.plan.shm_fit import fit_busiest, fit_shm  # noqa: E402
from pycollectives.strategies.plan.shm_model import ShmModel, last_level_cache_bytes  # noqa: E402

BEGIN, END = "<!-- plan_costs:begin -->", "<!-- plan_costs:end -->"
COLLS = "all_reduce,reduce_scatter,all_gather"
DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


def row_times(rows: list[dict], estimator: str) -> list[dict]:
    """The pycoll rows with a time, each row's time_us from its trials: under "rounds" the
    median over its rounds of their least trial (round_mins: one per launch, each a fresh
    communicator), under "min" the least of all its trials (the least-disturbed trial: other
    processes only ever add time), under "median" the median of all."""
    rows = [r for r in rows if r.get("time_us") and r["backend"] == "pycoll"]
    for r in rows:
        if estimator == "rounds" and r.get("round_mins"):
            r["time_us"] = statistics.median(r["round_mins"])
        elif estimator in ("min", "rounds"):
            r["time_us"] = min(r["trials_us"])
        else:
            r["time_us"] = statistics.median(r["trials_us"])
    return rows


def merge_round(got: dict[tuple, dict], key: str, rows: list[dict]) -> None:
    """Adds one launch's pycoll rows to `got` ((key, collective, ranks, size) -> row): another
    round's row of the same point adds its trials, its least trial (round_mins) and its
    calls by path to the first round's."""
    for r in rows:
        if r["backend"] != "pycoll" or not r.get("time_us") or not r.get("trials_us"):
            continue
        r["round_mins"] = [min(r["trials_us"])]
        old = got.setdefault((key, r["collective"], ranks_of(r), r["size"]), r)
        if old is not r:
            old["trials_us"] += r["trials_us"]
            old["round_mins"] += r["round_mins"]
            for path, calls in r["paths"].items():
                old["paths"][path] = old["paths"].get(path, 0) + calls


def measure(args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    """The fit run (--fit-ranks, 64 KiB to 16 MiB x4 apart) and the check run (--check-ranks,
    x2 apart), --rounds times over in turn, each launch a fresh communicator at another
    moment (on this VM the machine's state for seconds decides much of its speed) whose
    trials go round its sizes (--interleave 1). Returns (fit rows, check rows, one entry per launch: what
    ran, the load average before and after, the CPUs' cache-line round trip)."""
    got: dict[tuple, dict] = {}
    launches: list[dict] = []
    for rnd in range(args.rounds):
        for key, ranks, factor in (("fit", args.fit_ranks, "4"), ("check", args.check_ranks, "2")):
            for n in (int(x) for x in ranks.split(",")):
                flags = ["-b", "64K", "-e", "16M", "-f", factor, "-c", "0", "--trials",
                         args.trials, "--interleave", "1", "--coll", COLLS]  # fmt: skip
                before = os.getloadavg()
                data = run_bench(n, flags)
                merge_round(got, key, data["rows"])
                launches.append({"round": rnd, "run": key, "nranks": n, "load_before": before,
                                 "load_after": os.getloadavg(),
                                 "cpu_round_trip_ns": data["metadata"].get("cpu_round_trip_ns")})  # fmt: skip
    fit = row_times([r for k, r in got.items() if k[0] == "fit"], args.estimator)
    check = row_times([r for k, r in got.items() if k[0] == "check"], args.estimator)
    return fit, check, launches


ESTIMATORS = {
    "rounds": "the median over the launches of each one's least trial",
    "min": "the least of its trials",
    "median": "the median of its trials",
}


def round_trips(launches: list[dict]) -> str:
    """The range of the launches' CPU round trips (ns), or "not recorded"."""
    ns = [t["before"] for x in launches if (t := x.get("cpu_round_trip_ns")) and t.get("before")]
    return f"{min(ns):.0f}-{max(ns):.0f} ns" if ns else "not recorded"


def rounds_spread(rows: list[dict]) -> str:
    """How far a point moves from one launch to the next: per row, its slowest
    round's least trial over its fastest round's."""
    spans = [max(m) / min(m) for r in rows if len(m := r.get("round_mins") or []) >= 2]
    if not spans:
        return "one round only"
    return (
        f"per row, the slowest round's least trial over the fastest round's: median "
        f"{statistics.median(spans):.2f}, above 1.5 at {sum(x > 1.5 for x in spans)}/"
        f"{len(spans)} rows, above 2 at {sum(x > 2 for x in spans)}"
    )


def ranks_of(r: dict) -> str:
    """A row's ranks as the tables name them: its layout ("2x2": hosts x ranks per host)
    where it has one, else its rank count."""
    return str(r.get("layout", r["nranks"]))


def check_table(
    rows: list[dict], predict: Callable[[dict], tuple[float, str]], seen: set[tuple]
) -> tuple[list[str], list[dict], list[tuple[float, bool]]]:
    """The check run against the model: per row (collective, ranks_of, size) the path the
    model priced and the one the row took, measured and predicted us and their ratio, held
    out when (collective, ranks_of, size) is not in `seen` (the fit's points).
    predict(row) -> (predicted seconds, the path priced). Returns (table lines, JSON rows,
    (ratio, held out) per row)."""
    table = [
        "| collective | N | size | path (priced / taken) | measured us | predicted us | "
        "predicted / measured | held out |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    out_rows, ratios = [], []
    for r in sorted(rows, key=lambda r: (r["collective"], ranks_of(r), r["size"])):
        coll, n, size = r["collective"], ranks_of(r), r["size"]
        seconds, chosen = predict(r)
        pred = seconds * 1e6
        ratio = pred / r["time_us"]
        held = (coll, n, size) not in seen
        ratios.append((ratio, held))
        table.append(
            f"| {coll} | {n} | {size_label(size)} | {chosen} / {row_path(r)} | "
            f"{r['time_us']:.1f} | {pred:.1f} | {ratio:.2f} | {'yes' if held else ''} |"
        )
        out_rows.append({"collective": coll, "nranks": r["nranks"], "ranks": n, "size": size,
                         "measured_us": r["time_us"], "predicted_us": pred, "path_fit": chosen,
                         "path_check": row_path(r), "held_out": held})  # fmt: skip
    return table, out_rows, ratios


def summarize(what: str, ratios: list[tuple[float, bool]]) -> str:
    """`what: k/n rows within 20% (h/m held out), median |error| e%`."""
    within = sum(abs(x - 1) <= 0.2 for x, _ in ratios)
    within_held = sum(abs(x - 1) <= 0.2 for x, h in ratios if h)
    n_held = sum(h for _, h in ratios)
    med_err = statistics.median(abs(x - 1) for x, _ in ratios)
    return (
        f"{what}: {within}/{len(ratios)} rows within 20% ({within_held}/{n_held} held out), "
        f"median |error| {med_err:.0%}"
    )


def fitted_table(model: CostModel) -> list[str]:
    """One line per fitted (collective, path, regime) of `model`."""
    return [
        "| collective | path | regime | alpha us | GB/s | rows |",
        "|---|---|---|---:|---:|---|",
    ] + [
        f"| {d['collective']} | {d['path']} | {d['regime']} | {d['alpha_us']:.2f} | "
        f"{d['bandwidth_GBps']:.2f} | {d['source'].split(', ')[-1]} |"
        for d in model.describe()
        if d["path"] != "any" and d["regime"] != "any"
    ]


def constants_table(model: ShmModel) -> list[str]:
    """One line per fitted constant of `model`."""
    return ["| constant | value | unit |", "|---|---:|---|"] + [
        f"| {d['constant']} | {d['value']:.3g} | {d['unit']} |" for d in model.describe()
    ]


def run_to_run(fit_rows: list[dict], check_rows: list[dict]) -> str:
    """How far the check run repeats the fit run at the points both measured: the ceiling
    of any model fitted to the one and checked on the other."""
    first = {(r["collective"], ranks_of(r), r["size"]): r["time_us"] for r in fit_rows}
    ratios = [
        r["time_us"] / first[k]
        for r in check_rows
        if (k := (r["collective"], ranks_of(r), r["size"])) in first
    ]
    if not ratios:
        return "no point measured by both runs"
    within = sum(abs(x - 1) <= 0.2 for x in ratios)
    med = statistics.median(abs(x - 1) for x in ratios)
    return (
        f"{within}/{len(ratios)} points measured by both runs within 20% of each other "
        f"(check / fit), median |difference| {med:.0%}"
    )


def breakdown(out_rows: list[dict]) -> str:
    """Within-20% counts of the check rows per rank count, and of those whose priced path
    is (or is not) the one they took."""
    groups: dict[str, list[float]] = {}
    for o in out_rows:
        ratio = o["predicted_us"] / o["measured_us"]
        groups.setdefault(f"{o['ranks']} ranks", []).append(ratio)
        same = "path priced = taken" if o["path_fit"] == o["path_check"] else "path differs"
        groups.setdefault(same, []).append(ratio)
    return "; ".join(
        f"{k} {sum(abs(x - 1) <= 0.2 for x in v)}/{len(v)} within 20% (median "
        f"{statistics.median(v):.2f} of measured)"
        for k, v in sorted(groups.items())
    )


def record_rows(old: dict) -> tuple[list[dict], list[dict]]:
    """(fit rows, check rows) of a plan_costs record: its raw rows where it has them, else
    no fit rows and the check rows as its table recorded them."""
    if "raw" in old:
        return old["raw"]["fit"], old["raw"]["check"]
    return [], [
        {"backend": "pycoll", "collective": r["collective"], "nranks": r["nranks"],
         "size": r["size"], "time_us": r["measured_us"], "paths": {r["path_check"]: 1}}
        for r in old["rows"]
    ]  # fmt: skip


def in_run_split(check_rows: list[dict], fit_ranks: str) -> tuple[list[dict], list[dict]]:
    """(the check rows at fit_ranks and the fit run's sizes, the rest)."""
    ranks = {int(x) for x in fit_ranks.split(",")}
    at = {64 << 10 << 2 * k for k in range(5)}  # 64 KiB to 16 MiB x4 apart, the fit run's
    fit = [r for r in check_rows if r["nranks"] in ranks and r["size"] in at]
    return fit, [r for r in check_rows if r not in fit]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit-ranks", default="2,4")
    ap.add_argument("--check-ranks", default="2,3,4")
    ap.add_argument("--trials", default="5", help="trials per size and launch (default 5)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="launches of every run, in turn, each a fresh communicator (default 5)",
    )
    ap.add_argument(
        "--estimator",
        choices=tuple(ESTIMATORS),
        help="a row's time from its trials: median (default): the median of all its trials "
        "over the launches; rounds: the median over the launches of each one's least trial; "
        "min: the least of all (with --replay: default the record's)",
    )
    ap.add_argument(
        "--replay",
        metavar="JSON",
        help="price the rows recorded in this plan_costs JSON again instead of measuring",
    )
    ap.add_argument(
        "--model",
        choices=("algorithms", "paths"),
        default="algorithms",
        help="algorithms: shm_model.py (default); paths: the per-path alpha/beta of fitted.py",
    )
    ap.add_argument(
        "--in-run",
        action="store_true",
        help="with --replay: fit the check run's rows at --fit-ranks and the fit run's sizes, "
        "check its other rows (no drift between runs; also for a JSON without raw rows); "
        "writes nothing",
    )
    ap.add_argument(
        "--busiest-from",
        metavar="JSON",
        help="with --replay, algorithms model: the busiest core's weight (shm_model.share) fitted "
        "on another plan_costs record's rows at rank counts not a multiple of the cores "
        "(cross-record check); writes nothing",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if (args.in_run or args.busiest_from) and not args.replay:
        ap.error("--in-run, --busiest-from: only with --replay")
    args.no_write = args.no_write or bool(args.busiest_from)
    args.no_write = args.no_write or args.in_run  # an analysis of a record: nothing written
    load0, t0 = os.getloadavg(), time.perf_counter()
    cores = os.cpu_count() or 1
    cache = last_level_cache_bytes()
    date = datetime.date.today().isoformat()
    if args.replay:
        old = json.loads(Path(args.replay).read_text())
        if "raw" not in old and not args.in_run:
            ap.error(f"--replay {args.replay}: no raw rows (recorded before 2026-12-07 04:50; "
                     "--in-run prices its check rows)")  # fmt: skip
        fit_rows, check_rows = record_rows(old)
        cores = old.get("cores") or int(old["machine"].rsplit(", ", 1)[1].split()[0])
        date, load0, load1 = old["date"], old["load_start"], old["load_end"]
        cache = old.get("cache_bytes", cache)
        launches = old.get("launches", [])
        busy0 = old.get("busy_before")  # records since 2026-12-07 19:00
        chosen = args.estimator
        for k, v in old.get("settings", {"trials": "7", "rounds": 1, "estimator": "min"}).items():
            setattr(args, k, v)  # the recorded run's, for the notes
        if chosen and chosen != args.estimator:  # the rows' times again, by another estimator
            args.estimator = chosen
            fit_rows = row_times(fit_rows, chosen)
            check_rows = row_times(check_rows, chosen)
    else:
        args.estimator = args.estimator or "median"
        busy0 = busy_cores()
        fit_rows, check_rows, launches = measure(args)
        load1 = os.getloadavg()
    repeat = run_to_run(fit_rows, check_rows)  # the two runs as recorded
    if args.in_run:  # the check run alone: the fit's ranks at the fit's sizes against the rest
        fit_rows, check_rows = in_run_split(check_rows, args.fit_ranks)
    seen = {(r["collective"], ranks_of(r), r["size"]) for r in fit_rows}
    if args.model == "paths":
        model = fit_model(fit_rows, "shm", source="fit run", cores=cores)

        def predict(r: dict) -> tuple[float, str]:
            coll, n, size = r["collective"], r["nranks"], r["size"]
            return model.time(coll, n, size) * core_share(n, cores), model.path(coll, n, size)

        fitted = fitted_table(model)
        described = model.describe()
        how = (
            f"Cache regime boundary: {model.cache_bytes >> 10} KiB (the L2 per core). {cores} "
            f"cores: a row of N ranks is priced at max(1, N / {cores}) times the fit's per-core "
            "costs (costs.core_share)."
        )
    else:
        shm = fit_shm(fit_rows, cores, cache, source="fit run")
        if args.busiest_from:  # the busiest core's weight of another record, fitted there
            other = json.loads(Path(args.busiest_from).read_text())
            o_fit, o_check = record_rows(other)
            if not o_fit:  # a record without raw rows: its own check run's split
                o_fit, o_check = in_run_split(o_check, args.fit_ranks)
            o_cores = other.get("cores") or int(other["machine"].rsplit(", ", 1)[1].split()[0])
            o_model = fit_shm(o_fit, o_cores, other.get("cache_bytes", cache), source="other")
            shm = replace(shm, busiest=fit_busiest(o_model, o_check).busiest,
                          source=f"{shm.source}; busiest from {args.busiest_from}")  # fmt: skip

        def predict(r: dict) -> tuple[float, str]:
            coll, n, size = r["collective"], r["nranks"], r["size"]
            return shm.time(coll, n, size), shm.path(coll, n, size)

        fitted = constants_table(shm)
        described = shm.describe()
        how = (
            f"Model: per algorithm the bytes each rank copies, reduces and has the kernel copy "
            f"and its handoffs (shm_model.work), on {cores} cores (N ranks past them: the "
            f"load of the busiest core, from N / {cores} towards ceil(N / {cores}) by the "
            "busiest core's weight, times the fitted contention per rank past the cores), "
            f"once the ranks' inputs and outputs together fill {shm.cache_share:g} of the "
            f"{cache >> 20} MiB last-level cache (the share fitted) the memory's bandwidth if "
            "slower; where the "
            "code may take single copy or the slots (its tuner times both), the faster; where "
            "the ranks outnumber the cores, single copy only if the fit run's tuners took it in "
            "half their calls there (here: "
            + ("they did" if shm.cma_past_cores else "they did not: the slots")
            + ")."
        )
    table, out_rows, ratios = check_table(check_rows, predict, seen)
    summary = summarize(
        f"shared memory ({args.model} model), fit {args.fit_ranks} ranks / check "
        f"{args.check_ranks}",
        ratios,
    )
    parts = breakdown(out_rows)
    notes = [
        f"Result: {summary}.",
        f"The machine against itself: {repeat} (no model fitted to the one run can do better "
        "on those points of the other).",
        f"By rows: {parts}.",
        f"A row's time: {ESTIMATORS[args.estimator]}, of {args.rounds} launches in turn of "
        f"{args.trials} trials each (pycollectives-bench trials_us, --interleave 1 where "
        "rounds > 1; each trial the slowest rank's mean over its calls).",
        f"Fresh communicators: {rounds_spread(fit_rows + check_rows)}; cache-line round trip "
        f"between the 2 CPUs (before each launch's ranks ran) {round_trips(launches)}.",
        how,
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all"
        + (f" (priced again with --replay {args.replay})." if args.replay else "."),
    ]
    if busy0 is not None:
        notes.append(f"Other processes kept {busy0:.2f} of the {cores} CPUs busy in the 2 s "
                     "before the run (/proc/stat)" + (": other processes took the ranks' "
                     "cores, a quiet rerun is needed to judge the target." if busy0 > 0.25 else
                     "."))  # fmt: skip
    if args.in_run:
        notes.insert(1, "Split within the check run (--in-run): fitted to its rows at "
                     f"{args.fit_ranks} ranks and 64 KiB to 16 MiB x4 apart, checked on the rest.")  # fmt: skip
    if not args.no_write and not args.replay:  # a replay rewrites the section, not the record
        DATA.mkdir(exist_ok=True)
        (DATA / f"plan_costs-{date}.json").write_text(json.dumps({
            "summary": summary, "command": "python benchmarks/plan/plan_costs.py " + " ".join(sys.argv[1:]),
            "machine": f"{cpu_model()}, {os.cpu_count()} cores", "date": date,
            "load_start": load0, "load_end": load1, "cores": cores, "cache_bytes": cache, "model": args.model, "fitted": described,
            "rows": out_rows, "raw": {"fit": fit_rows, "check": check_rows}, "launches": launches, "busy_before": busy0,
            "settings": {k: getattr(args, k) for k in ("trials", "rounds", "estimator")},
        }, indent=1) + "\n")  # fmt: skip
    argv = " ".join(sys.argv[1:])
    emit_section(
        BEGIN,
        END,
        "Planner: the collective cost model against measured times",
        f"`python benchmarks/plan/plan_costs.py{' ' + argv if argv else ''}` "
        f"(data: docs/data/plan_costs-{date}.json)",
        notes,
        ["Fitted (fit run):", "", *fitted, "", "Check run against the fit:", "", *table],
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
