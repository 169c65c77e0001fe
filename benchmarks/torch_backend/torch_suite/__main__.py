"""The command line: `python benchmarks/torch_backend/torch_suite [options]` (see the package's docstring)."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

if not __package__:
    # Run as `python benchmarks/torch_backend/torch_suite`: sys.path[0] is this directory, whose modules
    # would import as top-level ones; the package's parent directory takes its place.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0]) == _HERE:
        sys.path[0] = os.path.dirname(_HERE)

import torch_suite  # noqa: E402
from torch_suite.config import DEFAULT_GRACE, DEFAULT_TIMEOUT, REFERENCE  # noqa: E402
from torch_suite.report import load, report, save  # noqa: E402
from torch_suite.runner import Run, code_state, gated_tests, list_tests, run_tests, select  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=torch_suite.__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="pycoll,gloo", help="comma list (gloo is the reference)")
    ap.add_argument("--world-sizes", default="2", help="comma list, e.g. 2,3,4,8")
    ap.add_argument("--bypass-gate", action="store_true",
                    help="also run the name-gated tests on each non-gloo backend, gates seeing gloo")  # fmt: skip
    ap.add_argument("--bypass-only", action="store_true",
                    help="with --bypass-gate: no plain run of the non-gloo backends")  # fmt: skip
    ap.add_argument("-k", action="append", default=[], dest="patterns",
                    help="run only tests matching (substring or fnmatch); repeatable")  # fmt: skip
    ap.add_argument("--exclude", action="append", default=[], help="skip tests matching")
    ap.add_argument("--timeout-per-test", type=float, default=DEFAULT_TIMEOUT)
    ap.add_argument("--grace", type=float, default=DEFAULT_GRACE, help="watchdog slack (s)")
    ap.add_argument("--start-method", choices=["forkserver", "spawn"], default="forkserver")
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--log-dir", type=Path, help="keep the workers' output here")
    ap.add_argument(
        "--report", type=Path, nargs="+", help="print the comparison of --json files and exit"
    )
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per test")
    a = ap.parse_args(argv)
    if a.report:
        print(report(load(*a.report)))
        return 0
    backends = [b for b in a.backends.split(",") if b]
    world_sizes = [int(w) for w in a.world_sizes.split(",") if w]
    if REFERENCE in backends:  # the reference first: its results are there when others finish
        backends = [REFERENCE] + [b for b in backends if b != REFERENCE]
    echo = None if a.quiet else (lambda s: print("   " + s, flush=True))
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": importlib.metadata.version("torch"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timeout_per_test": a.timeout_per_test,
        "start_method": a.start_method,
    }
    runs: list[Run] = []
    t_all = time.time()
    for ws in world_sizes:
        names = select(list_tests(backends[0], ws), a.patterns)
        excluded = set(select(names, a.exclude)) if a.exclude else set()
        names = [n for n in names if n not in excluded]
        gated: dict[str, list[str]] = {}
        if a.bypass_gate:
            gated = {b: [n for n in gated_tests(b, ws) if n in names] for b in backends if b != REFERENCE}  # fmt: skip
        plan: list[tuple[str, str, list[str]]] = []
        for b in backends:
            if b == REFERENCE or not a.bypass_only:
                plan.append((b, "plain", names))
            if b in gated:
                plan.append((b, "bypass", gated[b]))
        for b, mode, tests in plan:
            print(f"== {b} world size {ws} {mode}: {len(tests)} tests", flush=True)
            log = a.log_dir / f"{b}_ws{ws}_{mode}.log" if a.log_dir else None
            if log:
                log.parent.mkdir(parents=True, exist_ok=True)
            t0, before = time.time(), code_state()
            res = run_tests(b, ws, tests, bypass_gate=mode == "bypass", timeout=a.timeout_per_test,
                            grace=a.grace, start_method=a.start_method, log=log, echo=echo)  # fmt: skip
            runs.append(Run(b, ws, mode, res, time.time() - t0, [before, code_state()]))
            if a.json:
                meta["wall_s"] = round(time.time() - t_all, 1)
                save(a.json, meta, runs)
    print(report(runs))
    print(f"total wall time {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
