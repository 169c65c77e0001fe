"""How long a waiting rank should yield before it sleeps (PYCOLL_YIELD_US), measured in one
run: the same ranks hold one communicator per budget and time them in turn, round after
round, so that every budget sees the machine in the same states.

    python benchmarks/collectives/yield_budget.py [--ranks 4] [--budgets 1000,100,0] [--no-write]

A wait past its spin yields the CPU (sched_yield) until the budget runs out, then sleeps on
a futex until the peer publishes (csrc/core/wait.cc). Yielding catches data that comes a
few microseconds later without a wake-up; where the ranks outnumber the cores, a yielding
rank also keeps getting the core it shares with a peer that has work to do. Each budget's
communicator is split from the first after PYCOLL_YIELD_US is set to it (the setting is
read per communicator). A round: per case (collective and size, float32) and budget, in an
order that rotates from round to round, --calls calls after a barrier; the figure the
slowest rank's mean per call, and the CPU time the ranks used per call (all ranks summed,
getrusage of each process's threads). Reported per case and budget: the median over
--rounds rounds, and its ratio to the first budget's. Single copy is off unless --cma (each
communicator's tuner would choose its path on its own timings, and they may differ); the
paths taken are listed. Writes docs/data/yield_budget-DATE.json
and, unless --no-write, its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import pycollectives as pc
from pycollectives.bench.specs import parse_size
from pycollectives.launcher import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import busy_cores, publish, run_note, size_label  # noqa: E402
from _in_turn import buffers, call  # noqa: E402

CASES = "all_reduce:16,all_reduce:64K,all_reduce:2M,reduce_scatter:2M,all_gather:2M"


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _rank(
    budgets: list[int], cases: list[tuple[str, int]], rounds: int, calls: int, out: str
) -> None:
    os.environ["PYCOLL_YIELD_US"] = str(budgets[0])
    first = pc.init()
    comms = {budgets[0]: first}
    for b in budgets[1:]:  # read per communicator: a split reads it again
        os.environ["PYCOLL_YIELD_US"] = str(b)
        comms[b] = first.split(color=0)
    n = first.world_size
    bufs = {case: buffers(case[0], case[1], n) for case in cases}
    got: dict[str, dict[str, list[list[float]]]] = {}
    for case in cases:
        for c in comms.values():
            for _ in range(5):  # warm up, and let each communicator's tuner decide
                call(c, case[0], bufs[case])
    for rnd in range(rounds):
        for case in cases:
            order = budgets[rnd % len(budgets) :] + budgets[: rnd % len(budgets)]
            for b in order:
                c = comms[b]
                first.barrier()
                cpu0, t0 = _cpu_s(), time.perf_counter()
                for _ in range(calls):
                    call(c, case[0], bufs[case])
                wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
                x = torch.tensor([wall / calls * 1e6, cpu / calls * 1e6], dtype=torch.float64)
                slowest = x[:1].clone()
                first.all_reduce(slowest, op=pc.ReduceOp.MAX)
                first.all_reduce(x[1:])  # the ranks' CPU time, summed
                key = f"{case[0]}:{case[1]}"
                got.setdefault(key, {}).setdefault(str(b), []).append([slowest.item(), x[1].item()])
    paths = {
        str(b): {f"{k}": dict(v.get("paths", {})) for k, v in c.stats().items() if v.get("calls")}
        for b, c in comms.items()
    }
    for b in budgets[1:]:
        comms[b].close()
    first.close()
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps({"rounds": got, "paths": paths}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument(
        "--budgets", default="1000,100,0", help="PYCOLL_YIELD_US values, the first the reference"
    )
    ap.add_argument("--cases", default=CASES, help="collective:size,... (sizes in bytes, K or M)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument(
        "--cma",
        action="store_true",
        help="leave single copy to each communicator's tuner (default: off, PYCOLL_CMA=0: "
        "the tuners of the budgets' communicators may choose differently)",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not args.cma:
        os.environ["PYCOLL_CMA"] = "0"
    budgets = [int(x) for x in args.budgets.split(",")]
    cases = [(c, parse_size(s)) for c, s in (x.split(":") for x in args.cases.split(","))]
    busy0, load0, t0 = busy_cores(), os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rounds.json")
        rc = spawn(_rank, args.ranks, (budgets, cases, args.rounds, args.calls, out),
                   prog="yield_budget")  # fmt: skip
        if rc != 0:
            return rc
        got = json.loads(Path(out).read_text())
    load1 = os.getloadavg()
    cols = " | ".join(f"{b} us: per call (CPU)" for b in budgets)
    table = [f"| case | {cols} | " + " | ".join(f"{b} / {budgets[0]}" for b in budgets[1:]) + " |",
             "|---|" + "---:|" * (2 * len(budgets) - 1)]  # fmt: skip
    medians: dict[str, dict[str, list[float]]] = {}
    for coll, size in cases:
        key = f"{coll}:{size}"
        med = {
            str(b): [statistics.median(r[i] for r in got["rounds"][key][str(b)]) for i in (0, 1)]
            for b in budgets
        }
        medians[key] = med
        ref = med[str(budgets[0])][0]
        table.append(
            f"| {coll} {size_label(size)} | "
            + " | ".join(f"{med[str(b)][0]:.1f} ({med[str(b)][1]:.1f})" for b in budgets)
            + " | "
            + " | ".join(f"{med[str(b)][0] / ref:.2f}" for b in budgets[1:])
            + " |"
        )
    summary = (
        f"{args.ranks} ranks on {os.cpu_count()} CPUs, per call against {budgets[0]} us: "
        + "; ".join(
            f"{k.split(':')[0]} {size_label(int(k.split(':')[1]))} "
            + ", ".join(f"{b} us {v[str(b)][0] / v[str(budgets[0])][0]:.2f}" for b in budgets[1:])
            for k, v in medians.items()
        )
    )
    notes = [
        f"Result: {summary}.",
        f"Per case and budget: the median over {args.rounds} rounds of the slowest rank's mean "
        f"per call ({args.calls} calls after a barrier), us; in brackets the CPU time all ranks "
        "used per call, us (the yields' share of it shows there).",
        f"Paths taken per budget's communicator: {json.dumps(got['paths'])}.",
        run_note(load0, load1, t0, busy0),
    ]
    record = {"summary": summary, "load_start": load0, "load_end": load1, "busy_before": busy0,
              "rounds": got["rounds"], "paths": got["paths"], "medians": medians}  # fmt: skip
    publish("yield_budget", "Yielding or sleeping: how long a waiting rank yields (PYCOLL_YIELD_US)",
            notes, table, record, not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
