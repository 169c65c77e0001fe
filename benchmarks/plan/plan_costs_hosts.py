"""The planner's collective cost model across hosts (TCP) against this machine's measured times.

    sudo python benchmarks/plan/plan_costs_hosts.py        # root: network namespaces
    sudo python benchmarks/plan/plan_costs_hosts.py --no-write

Two hosts made of network namespaces on one bridge (tests/support/netns.py), the
project's `pycollectives-bench` run across them (benchmarks/common/_bench_hosts.py: one
rank process per namespace, met the torchrun way), all_reduce, reduce_scatter and
all_gather, in --rounds rounds, each of which runs every fit and check once in turn (each
at another moment: see plan_costs.py), each row's time by default the median of all its
trials over the rounds. Fit runs, 64 KiB to --max x4 apart:

- TCP: 2 hosts x 1 rank (strategies/plan/tcp_model.py: per algorithm the bytes each rank
  copies, reduces and has the kernel copy for TCP, its frames and ring steps, with the
  shared-memory fit's copy and reduction rates; --model paths: fitted.py's alpha and beta
  of the ring formulas per collective, path and cache regime);
- shared memory: 2 ranks on one host under PYCOLL_ALGO=ring, the rings over the shared
  slots that the hierarchical schedules run within a host (costs.INTRA_PATH), fitted as
  plan_costs.py fits shared memory (strategies/plan/shm_model.py: the bytes each rank
  copies and reduces, its handoffs, the memory's bandwidth past the last-level cache);
- ranks past the cores: 2 hosts x 2 ranks (hierarchical), whose 4 ranks share the 2 cores,
  to fit tcp_model's contention and wait per handoff past the cores (tcp_model.fit_sharing).

Check runs, 64 KiB to --max x2 apart: 2 hosts x 1 rank (sizes the fit never saw between
its own), 2 hosts x 2 ranks as the code chooses (PYCOLL_ALGO default: hierarchical,
priced by costs.hierarchical_time) and 2 hosts x 2 ranks under PYCOLL_ALGO=ring (one flat
ring over the four ranks, priced as a ring paced by the TCP link), so that the measured
choice between ring and hierarchical checks the predicted one. Target: within 20% from
64 KiB up. Then the fitted figures' ring against hierarchical at 8 to 4096 ranks
(costs.ring_vs_hierarchical). `--replay JSON` prices a record again; with `--in-run` the
algorithms model's cost of ranks past the cores is fitted to its 2 x 2 check rows at the
fit's sizes instead (hierarchical and flat ring) and checked on the rest. Writes its section of docs/benchmarks.md (between
<!-- plan_costs_hosts:begin --> and <!-- plan_costs_hosts:end -->),
docs/data/plan_costs_hosts-DATE.json and the TCP fit run as a bench JSON
(docs/data/plan_costs_hosts-DATE-tcp.json, for `pycollectives-plan --inter-bench-json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
sys.path.insert(0, str(ROOT / "tests" / "support"))
import netns  # noqa: E402
from _bench_hosts import run_bench_hosts  # noqa: E402
from _doc import cpu_model, emit_section, size_label  # noqa: E402
from plan_costs import (  # noqa: E402
    DATA,
    ESTIMATORS,
    check_table,
    constants_table,
    fitted_table,
    merge_round,
    ranks_of,
    row_times,
    summarize,
)

from pycollectives.strategies.plan.costs import (  # noqa: E402
    core_share,
    hierarchical_time,
    ring_time,
    ring_vs_hierarchical,
)
from pycollectives.strategies.plan.fitted import fit_model  # noqa: E402
from pycollectives.strategies.plan.shm_fit import fit_shm  # noqa: E402
from pycollectives.strategies.plan.tcp_model import fit_sharing, fit_tcp  # noqa: E402

BEGIN, END = "<!-- plan_costs_hosts:begin -->", "<!-- plan_costs_hosts:end -->"
COLLS = "all_reduce,reduce_scatter,all_gather"
# name -> (rank r's host, PYCOLL_ALGO or None for the default)
LAYOUTS = {
    "2x1": ([0, 1], None),
    "2x2": ([0, 0, 1, 1], None),
    "2x2 ring": ([0, 0, 1, 1], "ring"),
    "1x2 ring": ([0, 0], "ring"),
}


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# The runs, in the order of each round: (key in the recorded data, layout name, -f factor)
RUNS = (
    ("tcp_fit", "2x1", "4"),
    ("shm_fit", "1x2 ring", "4"),
    ("share_fit", "2x2", "4"),
    ("check", "2x1", "2"),
    ("check", "2x2", "2"),
    ("check", "2x2 ring", "2"),
)


def measure(args: argparse.Namespace) -> tuple[dict[str, list[dict]], list[dict]]:
    """The fit and check runs on a fresh 2-host fabric, --rounds times over (a round runs
    each once, in RUNS' order, so that a change of the machine's load between runs weighs on
    fit and check alike): ({"tcp_fit", "shm_fit", "check"}: their pycoll rows, each tagged
    with its layout, its trials those of every round; what ran, with the load average)."""
    if why := netns.unavailable():
        raise SystemExit(f"plan_costs_hosts: {why}")
    runs: list[dict] = []  # what ran, with the load average (1/5/15 min) before and after
    got: dict[tuple, dict] = {}  # (key, collective, layout, size) -> row

    def run(fabric: netns.Fabric, key: str, name: str, factor: str) -> None:
        layout, algo = LAYOUTS[name]
        flags = ["-b", "64K", "-e", args.max, "-f", factor, "-c", "0", "-w", "3"]
        flags += ["-n", args.iters, "--trials", args.trials, "--coll", COLLS]
        before, t = _load(), time.perf_counter()
        data = run_bench_hosts(fabric, layout, flags, {"PYCOLL_ALGO": algo} if algo else {})
        for r in data["rows"]:
            r["layout"] = name
        merge_round(got, key, data["rows"])  # another round's trials of a point add to its
        runs.append({"run": f"{name} -f {factor}", "load_before": before, "load_after": _load(),
                     "seconds": round(time.perf_counter() - t, 1), "metadata": data["metadata"]})  # fmt: skip

    with netns.Fabric(2) as fabric:
        for _ in range(args.rounds):
            for key, name, factor in RUNS:
                run(fabric, key, name, factor)
    raw: dict[str, list[dict]] = {key: [] for key, _, _ in RUNS}
    for (key, *_), r in got.items():
        raw[key] += row_times([r], args.estimator)
    return raw, runs


def rounds_agree(rows: list[dict], trials: int) -> str:
    """Per layout, how many rows' least trial of the first round lies within 20% of the
    second's (a row's trials_us: each round's `trials` in turn): how far the machine repeats
    itself between rounds, a floor under any model's error."""
    by: dict[str, list[float]] = {}
    for r in rows:
        t = r.get("trials_us") or []
        if trials > 0 and len(t) >= 2 * trials:
            by.setdefault(r["layout"], []).append(min(t[trials : 2 * trials]) / min(t[:trials]))
    if not by:
        return "one round only"
    return "; ".join(
        f"{k} {sum(abs(x - 1) <= 0.2 for x in v)}/{len(v)} within 20% (median |difference| "
        f"{statistics.median(abs(x - 1) for x in v):.0%})"
        for k, v in sorted(by.items())
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", default="16M", help="largest size (default 16M)")
    ap.add_argument("--trials", default="10", help="trials per size and round (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every run (default 3)")
    ap.add_argument("--iters", default="5", help="calls per trial (-n; default 5)")
    ap.add_argument(
        "--estimator",
        choices=tuple(ESTIMATORS),
        help="a row's time from its trials: median (default): the median of all its trials "
        "over the rounds; rounds: the median over the rounds of each one's least trial; min: "
        "the least of all (with --replay: default the record's)",
    )
    ap.add_argument(
        "--replay",
        metavar="JSON",
        help="price the runs recorded in this plan_costs_hosts JSON again instead of measuring",
    )
    ap.add_argument(
        "--model",
        choices=("algorithms", "paths"),
        default="algorithms",
        help="TCP: algorithms: tcp_model.py (default); paths: the per-path alpha/beta of fitted.py",
    )
    ap.add_argument(
        "--in-run",
        action="store_true",
        help="with --replay (writes nothing): fit the algorithms model's cost of ranks past the "
        "cores (tcp_model.fit_sharing) to the 2 x 2 check rows at the fit's sizes, check the rest",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.in_run and not args.replay:
        ap.error("--in-run: only with --replay")
    args.no_write = args.no_write or args.in_run  # an analysis of a record: nothing written
    t0 = time.perf_counter()
    chosen, args.estimator = args.estimator, args.estimator or "median"
    settings = {k: getattr(args, k) for k in ("max", "trials", "rounds", "iters", "estimator")}
    date = datetime.date.today().isoformat()
    cmd = "sudo python benchmarks/plan/plan_costs_hosts.py" + "".join(f" {a}" for a in sys.argv[1:])
    cores = os.cpu_count() or 1
    if args.replay:  # the recorded runs, priced by the model as it is now
        old = json.loads(Path(args.replay).read_text())
        raw, runs, settings, date, cmd = (
            old[k] for k in ("raw", "runs", "settings", "date", "command")
        )
        cores = old.get("cores") or int(old["machine"].rsplit(", ", 1)[1].split()[0])
        if chosen and chosen != settings["estimator"]:  # the rows' times by another estimator
            settings = {**settings, "estimator": chosen}
            raw = {k: row_times(v, chosen) for k, v in raw.items()}
    else:
        raw, runs = measure(args)
    t_all = sum(r["seconds"] for r in runs)
    tcp_rows, shm_rows, check = raw["tcp_fit"], raw["shm_fit"], raw["check"]
    # Every "host" is a namespace of this one machine: a run's ranks share its cores.
    shm = fit_shm(shm_rows, cores, old.get("cache_bytes") if args.replay else None, source="shm")
    if args.model == "paths":
        tcp = fit_model(tcp_rows, "tcp", source="TCP fit run", cores=cores)
    else:  # every "host" a namespace of this machine: all of a run's ranks share its cores
        tcp = fit_tcp(tcp_rows, shm, cores, source="TCP fit run", sharing="all")
    seen = {(r["collective"], ranks_of(r), r["size"]) for r in tcp_rows}
    share_rows = raw.get("share_fit", [])  # 2 x 2 at the fit's sizes (records since 2026-12-07)
    if share_rows and args.model == "algorithms" and not args.in_run:
        tcp = fit_sharing(tcp, share_rows, sharing="all")
        seen |= {(r["collective"], ranks_of(r), r["size"]) for r in share_rows}
    if args.in_run and args.model == "algorithms":  # 4 ranks on the cores: from the check run
        sizes = {r["size"] for r in tcp_rows}
        shared = [r for r in check if r["layout"] != "2x1" and r["size"] in sizes]
        tcp = fit_sharing(tcp, shared, sharing="all")
        seen |= {(r["collective"], ranks_of(r), r["size"]) for r in shared}

    def predict(r: dict) -> tuple[float, str]:
        coll, n, size = r["collective"], r["nranks"], r["size"]
        per_host = 1 if r["layout"] == "2x1" else 2
        if args.model == "algorithms":
            if r["layout"] == "2x2 ring":
                return tcp.flat_time(coll, n // per_host, per_host, size, sharing=n), "flat"
            t = tcp.hierarchical_time(coll, n // per_host, per_host, size, sharing=n)
            return t, "hierarchical"
        share = core_share(n, cores)  # all of the run's ranks on this machine's cores
        if r["layout"] == "2x2 ring":  # one ring over every rank, paced by its TCP links
            return ring_time(coll, n, size, tcp) * share, "flat"
        return hierarchical_time(coll, n, per_host, size, shm, tcp) * share, "hierarchical"

    table, out_rows, _ = check_table(check, predict, seen)
    by: dict[str, list[tuple[float, bool]]] = {}
    for o in out_rows:
        by.setdefault(o["ranks"], []).append((o["predicted_us"] / o["measured_us"], o["held_out"]))
    what = {"2x1": "TCP", "2x2": "hierarchical", "2x2 ring": "flat ring"}
    summaries = [summarize(f"{k} ({what[k]})", v) for k, v in by.items()]
    # The noise floor: the points both 2 x 1 runs measured (the fit's sizes), check / fit.
    fit_at = {(r["collective"], r["size"]): r["time_us"] for r in tcp_rows}
    again = sorted(
        r["time_us"] / fit_at[(r["collective"], r["size"])]
        for r in check
        if r["layout"] == "2x1" and (r["collective"], r["size"]) in fit_at
    )

    # Ring against hierarchical on the 2 x 2 check run, measured and predicted, per size.
    meas = {(r["layout"], r["collective"], r["size"]): r["time_us"] for r in check}
    pred = {(o["ranks"], o["collective"], o["size"]): o["predicted_us"] for o in out_rows}
    choice = ["| collective | size | measured ring / hierarchical | predicted ring / hierarchical | same choice |",
              "|---|---:|---:|---:|---|"]  # fmt: skip
    agree = total = 0
    for coll, size in sorted({(c, s) for lay, c, s in meas if lay == "2x2"}):
        m = [meas.get((lay, coll, size)) for lay in ("2x2 ring", "2x2")]
        p = [pred.get((lay, coll, size)) for lay in ("2x2 ring", "2x2")]
        if None in m or None in p:
            continue
        same = (m[0] < m[1]) == (p[0] < p[1])
        agree, total = agree + same, total + 1
        choice.append(f"| {coll} | {size_label(size)} | {m[0] / m[1]:.2f} | {p[0] / p[1]:.2f} | "
                      f"{'yes' if same else 'no'} |")  # fmt: skip

    # The fitted figures at scale: the flat ring against what the communicator runs.
    scale = ["| all-reduce of | ranks per host | " + " | ".join(str(n) for n in (8, 64, 512, 4096)) + " |",
             "|---|---:|" + "---:|" * 4]  # fmt: skip
    at_scale = []
    for size in (1 << 20, 64 << 20):
        for per_host in (2, 8):
            got = ring_vs_hierarchical("all_reduce", size, per_host, shm, tcp)
            at_scale.append({"size": size, "per_host": per_host, "rows": got})
            cells = [f"{g['ring_s'] / g['hierarchical_s']:.2f}" for g in got if g["ranks"] in (8, 64, 512, 4096)]  # fmt: skip
            scale.append(f"| {size_label(size)} | {per_host} | " + " | ".join(cells) + " |")

    again_rounds = rounds_agree(tcp_rows + shm_rows + check, int(settings["trials"]))
    notes = [
        "Result: " + "; ".join(summaries) + f"; ring vs hierarchical at 2 x 2: the predicted "
        f"faster one measured faster at {agree}/{total} sizes.",
        f"A row's time: {ESTIMATORS[settings['estimator']].replace('launches', 'rounds')}, of "
        f"{settings['trials']} trials of {settings['iters']} calls in each of "
        f"{settings['rounds']} rounds (a round runs each fit and check once, in turn) "
        "(pycollectives-bench trials_us; each trial the slowest rank's mean over its calls).",
        (
            f"Cache regime boundary of the TCP fit: {tcp.cache_bytes >> 10} KiB (the L2 per core); "
            if args.model == "paths"
            else "TCP (strategies/plan/tcp_model.py): per algorithm, the bytes each rank copies, "
            "reduces and has the kernel copy for TCP, its frames and ring steps; "
        )
        + f"the shared-memory fit's cache boundary: {shm.cache_bytes >> 20} MiB (the last-level cache).",
        "Load average (1/5/15 min) before and after each run: "
        + "; ".join(f"{r['run']}: {r['load_before']} -> {r['load_after']}" for r in runs)
        + f"; {t_all:.0f} s of runs."
        + (
            f" Priced again ({time.perf_counter() - t0:.0f} s) with --replay."
            if args.replay
            else ""
        ),
        f"The same points measured twice (2 x 1, the fit's {len(again)} collective and size "
        "pairs, in the check run against the fit run): check / fit from "
        + (
            f"{again[0]:.2f} to {again[-1]:.2f}, median {statistics.median(again):.2f}, "
            f"{sum(abs(x - 1) <= 0.2 for x in again)}/{len(again)} within 20%"
            if again
            else "-"
        )
        + ": how far apart two runs of the same thing land on this machine at this load, a "
        "floor under any model's error.",
        f"Round against round (the least trial of round 2 over round 1's, per row): "
        f"{again_rounds}.",
        "Hosts: network namespaces on one machine, one veth pair each to a bridge: the two "
        f"hosts' ranks share its {cores} cores (and the kernel that copies TCP's bytes); "
        + (
            "the fits divide each row by the share of the cores its ranks had (costs.core_share: "
            "max(1, ranks / cores)) and the predictions multiply the check run's back."
            if args.model == "paths"
            else "the model prices all of a run's ranks on them (shm_model.share with the "
            "shared-memory fit's contention; tcp_model's contention and wait per handoff past "
            "the cores fitted to a 2 x 2 hierarchical fit run at the fit's sizes (tcp_model."
            "fit_sharing; records without it: 0, unless --in-run fits them to the check run))."
        ),
    ]
    if not args.no_write:
        DATA.mkdir(exist_ok=True)
        fit_json = DATA / f"plan_costs_hosts-{date}-tcp.json"
        fit_json.write_text(json.dumps({"metadata": {**runs[0]["metadata"], "estimator": settings["estimator"]},
                                        "rows": tcp_rows}, indent=1) + "\n")  # fmt: skip
        (DATA / f"plan_costs_hosts-{date}.json").write_text(json.dumps({
            "summary": summaries, "ring_vs_hierarchical_agree": [agree, total], "command": cmd,
            "machine": f"{cpu_model()}, {cores} cores", "cores": cores, "cache_bytes": shm.cache_bytes, "date": date, "runs": runs,
            "model": args.model, "fitted": {"tcp": tcp.describe(), "shm": shm.describe()}, "rows": out_rows,
            "at_scale": at_scale, "settings": settings, "raw": raw,
        }, indent=1) + "\n")  # fmt: skip
    tables = [
        "Fitted, TCP (2 hosts x 1 rank):", "", *(fitted_table(tcp) if args.model == "paths" else constants_table(tcp)), "",
        "Fitted, shared memory within a host (2 ranks, PYCOLL_ALGO=ring):", "", *constants_table(shm), "",
        "Check runs against the fit (N: hosts x ranks per host):", "", *table, "",
        "Ring (PYCOLL_ALGO=ring) against hierarchical (the default) at 2 x 2, time ratios:", "", *choice, "",
        "The fitted figures at scale: predicted flat ring / hierarchical all-reduce time "
        "(above 1: hierarchical faster; the communicator runs hierarchical wherever every host "
        "has as many ranks):", "", *scale,
    ]  # fmt: skip
    emit_section(
        BEGIN,
        END,
        "Planner: the collective cost model across hosts (TCP) against measured times",
        f"`{cmd}` (data: docs/data/plan_costs_hosts-{date}.json)",
        notes,
        tables,
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
