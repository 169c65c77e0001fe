"""pycollectives against torch.distributed gloo and OpenMPI on local ranks, in one run.

    python benchmarks/collectives/cpu_compare.py [--ranks 1,2,3,4] [--out docs/benchmarks.md]

For each world size, runs all-reduce, reduce-scatter and all-gather from 16 B to 64 MiB
(50 calls per trial and 3x --trials trials up to 1 MiB, 10 calls and --trials trials from
4 MiB; SIZE_RUNS) twice: `pycollectives-bench --compare mpi --interleave 1` (pycollectives and
OpenMPI in the same ranks under mpirun) and `--compare gloo --interleave 1` (pycollectives and
gloo), each in rounds of one trial of both at every size, same timing method (median over
trials of the slowest rank's time). Each ratio compares pycollectives with its peer from the
same invocation: gloo's blocking calls of milliseconds (3-4 ranks on 2 cores) slow the
microsecond calls of whatever runs after them in the same processes, pycollectives' and
OpenMPI's alike, so gloo and OpenMPI do not share one. Then an 8-byte all-reduce latency run,
and the CPU section of docs/benchmarks.md is rewritten with the command, machine, date, every
figure and the issue's targets checked at every recorded size against those ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import round_trips, run_bench, size_label, write_section

COLLS = ["all_reduce", "reduce_scatter", "all_gather"]
# Sizes and iterations per trial: a trial of 10 calls of a few microseconds is over in less
# than a scheduler tick of this shared 2-core VM, so up to 1 MiB each trial times 50 calls.
# The machine drifts, and has slowdown episodes of a second or more: at every size
# pycollectives, gloo and OpenMPI run in the same ranks (--interleave 1), in --trials rounds
# over all sizes that each time one trial of every backend at every size, so that an episode
# spoils one trial of a size (which the median rejects) and weighs on all backends alike.
# Trials of microseconds swing most (3-4 ranks on 2 cores: 4-rank 8-byte all-reduce trials
# spread over 9.5-17.8 us between quartiles, the same for OpenMPI), and cost little: the
# small sizes take SMALL_TRIALS times as many trials. At least 5 warmup calls a size: the
# single-copy tuner's (one untimed call, then two timed calls of each path) fall in them
# (the run recorded in session 14 warmed the large sizes up with 3).
SMALL_TRIALS = 3
SIZE_RUNS = [
    ["-b", "16", "-e", "1M", "-f", "4", "-n", "50", "-w", "10", "--interleave", "1"],
    ["-b", "4M", "-e", "64M", "-f", "4", "-n", "10", "-w", "5", "--interleave", "1"],
]
BEGIN, END = "<!-- cpu_compare:begin -->", "<!-- cpu_compare:end -->"


def run_trials(trials: str) -> list[str]:
    """--trials of each of SIZE_RUNS for the script's --trials: SMALL_TRIALS times as many for
    the small sizes."""
    return [str(SMALL_TRIALS * int(trials)), trials]


def bench(nranks: int, extra: list[str], compare: str = "gloo,mpi") -> dict:
    """Runs one comparison; returns the bench's JSON (metadata and rows)."""
    return run_bench(nranks, ["--compare", compare, *extra])


# How the rows of each invocation are named in `rows`: the gloo invocation's pycollectives rows
# become pycoll-G, the registered (-R 1) invocation's pycoll-R and mpi-R (its OpenMPI, plain
# buffers); the OpenMPI invocation's keep their names.
GLOO_RUN = {"pycoll": "pycoll-G", "gloo": "gloo"}
REGISTERED_RUN = {"pycoll": "pycoll-R", "mpi": "mpi-R"}


def renamed(data: dict, rename: dict[str, str]) -> list[dict]:
    """The rows of one invocation whose backend `rename` names, renamed."""
    return [{**r, "backend": rename[r["backend"]]} for r in data["rows"] if r["backend"] in rename]


def _bw(r: dict | None) -> str:
    return f"{r['busbw']:.3f}" if r and r.get("busbw") else "n/a"


def _us(r: dict | None) -> str:
    return f"{r['time_us']:.2f}" if r and r.get("time_us") else "n/a"


def _ratio(peer: dict | None, own: dict | None) -> str:
    ok = peer and own and peer.get("time_us") and own.get("time_us")
    return f"{peer['time_us'] / own['time_us']:.2f}" if ok else "n/a"


def table(rows: list[dict], coll: str, n: int) -> list[str]:
    """One collective's figures for `n` ranks: pycollectives against OpenMPI (their
    invocation), against gloo (theirs) and, where run, on registered buffers."""
    by = {
        (r["backend"], r["size"]): r for r in rows if r["collective"] == coll and r["nranks"] == n
    }
    sizes = sorted({s for (_, s) in by})
    reg = any(b == "pycoll-R" for (b, _) in by)
    out = [
        "| size | pycoll us | pycoll busbw | mpi busbw | x mpi | pycoll us (gloo run) | gloo busbw "
        "| x gloo |" + (" registered us | registered busbw | x mpi | x gloo |" if reg else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if reg else ""),
    ]
    for s in sizes:
        p, m = by.get(("pycoll", s)), by.get(("mpi", s))
        pg, g = by.get(("pycoll-G", s)), by.get(("gloo", s))
        if p is None and pg is None:
            continue
        line = f"| {size_label(s)} | {_us(p)} | {_bw(p)} | {_bw(m)} | {_ratio(m, p)} "
        line += f"| {_us(pg)} | {_bw(g)} | {_ratio(g, pg)} |"
        if reg:
            q, mq = by.get(("pycoll-R", s)), by.get(("mpi-R", s))
            line += f" {_us(q)} | {_bw(q)} | {_ratio(mq, q)} | {_ratio(g, q)} |"
        out.append(line)
    return out


def speedup(
    rows: list[dict], coll: str, n: int, size: int, peer: str, own: str = "pycoll"
) -> float | None:
    """Peer time / pycollectives time (= busbw ratio) at one size, or None."""
    t = {
        r["backend"]: r["time_us"]
        for r in rows
        if r["collective"] == coll and r["nranks"] == n and r["size"] == size and r.get("time_us")
    }
    return t[peer] / t[own] if own in t and peer in t else None


def ratios(
    rows: list[dict], coll: str, n: int, lo: float, hi: float, peer: str, own: str = "pycoll"
) -> list[tuple[int, float | None]]:
    """(size, peer time / own time) at every size from lo to hi bytes recorded for `coll` with
    `n` ranks (by any backend), in size order; None where either side was not measured."""
    sizes = sorted(
        {
            r["size"]
            for r in rows
            if r["collective"] == coll and r["nranks"] == n and lo <= r["size"] <= hi
        }
    )
    return [(s, speedup(rows, coll, n, s, peer, own)) for s in sizes]


def verdict(pairs: list[tuple[int, float | None]], need: float) -> str:
    """Two table cells for one target from its (size, ratio) pairs: the sizes checked (the size,
    or their number and range), the lowest-highest ratio, each size below `need` with its ratio,
    each size not measured; then met, MISSED (a size below `need`), incomplete (none below, some
    not measured), or - when none was measured."""
    got = [(s, v) for s, v in pairs if v is not None]
    if not got:
        return "not measured | -"
    lo, hi = min(v for _, v in got), max(v for _, v in got)
    first, last = size_label(pairs[0][0]), size_label(pairs[-1][0])
    txt = first if len(pairs) == 1 else f"{len(pairs)} sizes, {first} to {last}"
    txt += f": {lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f": {lo:.2f}-{hi:.2f}x"
    below = [f"{size_label(s)} {v:.2f}x" for s, v in got if v < need]
    missing = [size_label(s) for s, v in pairs if v is None]
    if below:
        txt += f"; below: {', '.join(below)}"
    if missing:
        txt += f"; n/a: {', '.join(missing)}"
    return f"{txt} | {'MISSED' if below else 'incomplete' if missing else 'met'}"


def targets(rows: list[dict], lat: dict[str, float]) -> list[str]:
    """The issue's targets as table lines, each checked at every size recorded in its range."""
    mib, every = 1 << 20, (0, math.inf)
    lines = [
        "| target | plain buffers: ratio = peer time / pycollectives time (sizes checked: every "
        "recorded size in the range; lowest-highest ratio; below: sizes under the target; "
        "n/a: sizes not measured) | verdict | registered buffers (`-R 1`, alloc_shared) "
        "| verdict |",
        "|---|---|---|---|---|",
    ]

    def check(
        name: str, coll: str, n: int, peer: str, span: tuple[float, float], need: float
    ) -> None:
        # plain buffers: each peer against pycollectives from the same invocation; registered
        # buffers: OpenMPI from the same (-R 1) invocation, gloo from the gloo invocation
        plain = ratios(rows, coll, n, *span, peer, "pycoll" if peer == "mpi" else "pycoll-G")
        reg = ratios(rows, coll, n, *span, "mpi-R" if peer == "mpi" else peer, "pycoll-R")
        lines.append(f"| {name} | {verdict(plain, need)} | {verdict(reg, need)} |")

    check("all-reduce, 2 ranks, >= 1.25x OpenMPI from 1 to 16 MiB", "all_reduce", 2, "mpi",
          (mib, 16 * mib), 1.25)  # fmt: skip
    check("all-reduce, 2 ranks, >= 2x OpenMPI at 64 MiB", "all_reduce", 2, "mpi",
          (64 * mib, 64 * mib), 2)  # fmt: skip
    check("all-reduce, 4 ranks on 2 cores, >= OpenMPI at every size", "all_reduce", 4, "mpi",
          every, 1)  # fmt: skip
    for n in (2, 3, 4):
        check(f"all-reduce, {n} ranks, >= 5x gloo at every size from 64 KiB", "all_reduce", n,
              "gloo", (64 << 10, math.inf), 5)  # fmt: skip
    for coll in ("reduce_scatter", "all_gather"):
        check(f"{coll.replace('_', '-')}, 2 ranks, >= OpenMPI at every size", coll, 2, "mpi",
              every, 1)  # fmt: skip
    if "pycoll" in lat and "mpi" in lat:
        lines.append(
            f"| 8-byte all-reduce, 2 ranks, within 2x OpenMPI (Python call included) | pycollectives "
            f"{lat['pycoll']:.2f} us, OpenMPI {lat['mpi']:.2f} us, gloo {lat.get('gloo', float('nan')):.0f} us: "
            f"{lat['pycoll'] / lat['mpi']:.2f}x OpenMPI's time | {'met' if lat['pycoll'] <= 2 * lat['mpi'] else 'MISSED'} | - | - |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,3,4")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md")
    )
    ap.add_argument(
        "--trials", default="5", help="trials per size from 4 MiB (default 5; 3x that below)"
    )
    ap.add_argument(
        "--registered",
        type=int,
        choices=(0, 1),
        default=1,
        help="also run pycollectives on alloc_shared buffers (-R 1) with 2+ ranks (default 1)",
    )
    ap.add_argument(
        "--bind",
        choices=("auto", "core", "none"),
        default="auto",
        help="pycollectives-bench --bind for every run (default auto: 3-4 ranks on 2 cores "
        "unpinned, as mpirun leaves them; core: round robin, rank r on CPU r mod ncpus)",
    )
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]

    rows, meta = [], None
    single_copy: dict[int, str] = {}  # world size -> whether CMA ran between its ranks
    trips: dict[int, list[str]] = defaultdict(list)  # world size -> each invocation's round trips
    for n in ranks:
        parts = zip(SIZE_RUNS, run_trials(args.trials), ("small", "large"), strict=True)
        for sizes, trials, part in parts:
            common = [*sizes, "--coll", ",".join(COLLS), "--trials", trials, "-c", "1"]
            common += ["--bind", args.bind]
            data = bench(n, common, compare="mpi")
            trips[n].append(round_trips(f"{part} mpi", data))
            rows += data["rows"]
            meta = meta or data["metadata"]
            if n > 1:
                single_copy[n] = data["metadata"]["versions"].get("single_copy", "?")
            data = bench(n, common, compare="gloo")
            trips[n].append(round_trips(f"{part} gloo", data))
            rows += renamed(data, GLOO_RUN)
            if n > 1 and args.registered:
                # the same sizes on alloc_shared buffers; MPI again in that invocation
                data = bench(n, [*common, "-R", "1"], compare="mpi")
                trips[n].append(round_trips(f"{part} -R", data))
                rows += renamed(data, REGISTERED_RUN)
    lat: dict[str, float] = {}
    if 2 in ranks:
        runs = [
            bench(
                2,
                [
                    "-b",
                    "8",
                    "-e",
                    "8",
                    "--coll",
                    "all_reduce",
                    "-n",
                    "2000",
                    "-w",
                    "200",
                    "--trials",
                    "9",
                ],
            )
            for _ in range(3)
        ]
        for backend in ("pycoll", "gloo", "mpi"):
            ts = [
                r["time_us"]
                for d in runs
                for r in d["rows"]
                if r["backend"] == backend and r.get("time_us")
            ]
            if ts:
                lat[backend] = statistics.median(ts)
    wrong = sum(r.get("wrong") or 0 for r in rows)

    v = meta["versions"]
    small, large = run_trials(args.trials)
    body = [
        BEGIN,
        "## CPU: pycollectives vs gloo vs OpenMPI (shared memory, one host)",
        "",
        f"- Command: `python benchmarks/collectives/cpu_compare.py --ranks {args.ranks} --trials {args.trials} "
        f"--registered {args.registered} --bind {args.bind}` "
        f"(each world size: `pycollectives-bench --nproc N {' '.join(SIZE_RUNS[0])} --coll "
        f"{','.join(COLLS)} --trials {small} -c 1 --bind {args.bind} --compare mpi` and the same with "
        f"`{' '.join(SIZE_RUNS[1])} --trials {large}`: pycollectives and OpenMPI in the same ranks "
        "under mpirun, in as many rounds as trials, each round running one trial of both at every "
        "size; then the same with `--compare gloo` (pycollectives and gloo)"
        + (", then with `-R 1 --compare mpi`" if args.registered else "")
        + "; 8-byte latency: three runs of `-b 8 -e 8 -n 2000 -w 200 --trials 9`, median)",
        "- Each ratio compares pycollectives with its peer from the same invocation. gloo and "
        "OpenMPI do not share one: gloo's small calls block for milliseconds with 3-4 ranks on 2 "
        "cores, and the microsecond calls that follow them in the same processes come out slower "
        "(measured in 'Peers in separate invocations' above).",
        "- Registered buffers (`-R 1`): pycollectives' buffers come from `comm.alloc_shared` "
        "(symmetric windows, as nccl-tests `-R`), so all-reduce, reduce-scatter and all-gather "
        "run in place across the ranks' buffers; OpenMPI (same invocation) and gloo (the gloo "
        "invocation) keep plain buffers. Plain buffers are what a caller gets without asking; "
        "single copy (CMA) between the ranks: "
        + (", ".join(f"{n} ranks: {sc}" for n, sc in single_copy.items()) or "-")
        + " (docs/api.md, 'Single copy', says which sizes take it).",
        f"- Machine: {meta['cpu_model']}, {meta['cpu_count']} cores (KVM), host `{meta['hostname']}`",
        f"- Date: {meta['date']}",
        "- Cache-line round trip between the two CPUs before/after each invocation, ns (this VM "
        "shows two levels, ~80-120 and ~400, as the host moves its vCPUs; at ~400 the large "
        "sizes of 3-4 ranks took up to twice as long, see 'Reading the CPU figures'): "
        + "; ".join(f"{n} rank{'s' if n > 1 else ''}: {', '.join(t)}" for n, t in trips.items()),
        f"- Software: pycollectives {v['pycollectives']} ({v['simd_level']}), torch {v['torch']} (gloo), "
        f"{v.get('mpi', 'no MPI')}, mpi4py {v.get('mpi4py', '-')}, Python {v['python']}",
        "- float32, op sum; time = median over trials of the slowest rank's mean time per call; "
        "busbw in GB/s (nccl-tests factors); ratio = peer time / pycollectives time (> 1: pycollectives faster)",
        f"- Correctness: every pycollectives row was checked (`-c 1`): {wrong} wrong elements in total",
        "",
        "### Targets (issue 'The collective core on CPU'), checked on this run",
        "",
        *targets(rows, lat),
        "",
    ]
    for coll in COLLS:
        for n in ranks:
            body += [f"### {coll}, {n} rank{'s' if n > 1 else ''}", "", *table(rows, coll, n), ""]
    body.append(END)

    out = Path(args.out)
    write_section("\n".join(body), BEGIN, END, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
