"""Small-message all-reduce latency, paired in one run: this tree, another build of
pycollectives (--old-tree) and OpenMPI (mpi4py's `Allreduce` on numpy).

    python benchmarks/collectives/small_latency.py --old-tree /tmp/old [--ranks 2,3,4] [--bytes 8]
        [--rounds 40] [--calls 2000] [--stages] [--json docs/data/small_latency-DATE.json]

--old-tree: a source tree with its extension built in place (`python setup.py
build_ext --inplace`), e.g. a `git worktree add --detach` of an older commit; left
out, only this tree and OpenMPI run. Each side keeps its ranks alive for the
whole run of a world size: pycollectives' ranks as plain processes (PYTHONPATH
its tree), OpenMPI's as one mpirun job (bound as `pycollectives-bench --bind
auto` binds them). Every rank r runs on CPU r mod ncpus, and waits for its next
block asleep in a read of its own FIFO, so that only one side runs at a time.
The driver sends each side a block of `--calls` synchronous all-reduces of a
float32 tensor (a numpy array for MPI) of --bytes, in place, timed by each rank
after a barrier; a block's figure is the slowest rank's mean time per call
(Python call included). Each round runs one block of every side (and stage
variant), in an order that rotates and reverses from round to round, so a
machine whose speed drifts weighs on all alike; the ratios are taken per round
and their median reported with the interquartile range.

--stages adds, in the same rounds, variants that skip stages of the call:
`fast` calls the communicator's FastPath directly (no Python method); `solo`
runs the same call on a one-rank communicator split off the ranks' one (no peer:
argument checks, bookkeeping, no handshake); for MPI, `solo` is Allreduce on
COMM_SELF. The cache-line round trip between two CPUs (_C.cpu_round_trip_ns,
the floor of any handshake) is measured before and after each world size.

Writes a JSON file (command, machine, load, date, medians, ratios and a one-line
"summary") and, unless --no-write, its section of docs/benchmarks.md. Needs
mpirun and mpi4py (`apt-get install openmpi-bin libopenmpi-dev && pip install
mpi4py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))

BEGIN, END = "<!-- small_latency:begin -->", "<!-- small_latency:end -->"
TITLE = "Small-message all-reduce: this tree vs an older build vs OpenMPI"
ANCHOR = "small-message-all-reduce-this-tree-vs-an-older-build-vs-openmpi"

# Every rank: pin, open its FIFOs, set up, then answer "variant nbytes calls"
# lines with its mean microseconds per call.
COMMON = r"""
import os, sys, time
fifo = sys.argv[1]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", sys.argv[2]))  # mpirun's ranks: from mpirun
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
cmd = open(fifo + f"-{rank}.cmd")
res = open(fifo + f"-{rank}.res", "w", buffering=1)
def serve(run):
    for line in cmd:
        variant, nbytes, calls = line.split()
        res.write(f"{run(variant, int(nbytes), int(calls))}\n")
"""

PYCOLL_RANK = (
    COMMON
    + r"""
import torch, torch.distributed as dist
import pycollectives as pc
torch.set_num_threads(1)
n = int(sys.argv[3])
comm = pc.init(rank, n, store=dist.FileStore(sys.argv[4], n), timeout=600)
solo = comm.split(rank)
SUM = pc.ReduceOp.SUM
res.write(f"pycollectives {pc.__file__}\n")
bufs = {}
def run(variant, nbytes, calls):
    t = bufs.setdefault(nbytes, torch.zeros(max(nbytes // 4, 1)))
    if variant == "call":
        f = comm.all_reduce
    elif variant == "fast":
        fp = comm._fast.all_reduce
        f = lambda x: fp(x, SUM)
    elif variant == "solo":
        f = solo.all_reduce
    else:
        raise SystemExit(f"unknown variant {variant}")
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(t)
    us = (time.perf_counter() - t0) / calls * 1e6
    t.fill_(rank + 1)  # one checked call after the timed ones
    f(t)
    want = rank + 1 if variant == "solo" else n * (n + 1) // 2
    if not bool((t == want).all()):
        raise SystemExit(f"rank {rank}: {variant}: got {t.tolist()}, expected {want}")
    t.zero_()  # the timed calls' sums stay 0
    return us
serve(run)
solo.close()
comm.close()
"""
)

MPI_RANK = (
    COMMON
    + r"""
import numpy as np
from mpi4py import MPI
comm, IP, SUM = MPI.COMM_WORLD, MPI.IN_PLACE, MPI.SUM
res.write(f"mpi {MPI.Get_library_version().splitlines()[0]}; mpi4py {__import__('mpi4py').__version__}\n")
bufs = {}
def run(variant, nbytes, calls):
    a = bufs.setdefault(nbytes, np.zeros(max(nbytes // 4, 1), dtype=np.float32))
    c = comm if variant == "call" else MPI.COMM_SELF
    if variant not in ("call", "solo"):
        raise SystemExit(f"unknown variant {variant}")
    f = c.Allreduce
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(IP, a, SUM)
    us = (time.perf_counter() - t0) / calls * 1e6
    n = c.Get_size()
    a.fill(c.Get_rank() + 1)
    f(IP, a, SUM)
    if not (a == n * (n + 1) // 2).all():
        raise SystemExit(f"rank {rank}: mpi {variant}: got {a.tolist()}")
    a.fill(0)
    return us
serve(run)
"""
)


class Side:
    """The ranks of one side (a pycollectives tree, or OpenMPI), fed blocks through FIFOs."""

    def __init__(
        self, name: str, nranks: int, tmp: str, tree: Path | None, extra_env: dict[str, str]
    ) -> None:
        self.name, self.nranks = name, nranks
        fifo = os.path.join(tmp, name)
        for r in range(nranks):
            os.mkfifo(f"{fifo}-{r}.cmd")
            os.mkfifo(f"{fifo}-{r}.res")
        if tree is None:  # OpenMPI: one mpirun job, bound as the bench binds it
            from pycollectives.bench.launch import _mpirun_binding

            ncpu = len(os.sched_getaffinity(0))
            cpus = [r % ncpu for r in range(nranks)] if ncpu > 1 else None
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", *_mpirun_binding(cpus)]
            cmd += ["-np", str(nranks), sys.executable, "-c", MPI_RANK, fifo, "-1"]
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            self.procs = [subprocess.Popen(cmd, env=env)]
        else:
            env = dict(os.environ, PYTHONPATH=str(tree), **extra_env)
            store = os.path.join(tmp, name + "-store")
            self.procs = [
                subprocess.Popen(
                    [sys.executable, "-c", PYCOLL_RANK, fifo, str(r), str(nranks), store],
                    env=env,
                    cwd=tree,  # `python -c` puts the working directory first on sys.path
                )
                for r in range(nranks)
            ]
        self.cmd, self.res = [], []
        for r in range(nranks):
            self.cmd.append(open(f"{fifo}-{r}.cmd", "w", buffering=1))  # noqa: SIM115
            self.res.append(open(f"{fifo}-{r}.res"))  # noqa: SIM115
        self.what = [self._line(r) for r in range(nranks)][0]
        if tree is not None and not self.what.startswith(f"pycollectives {tree.resolve()}/"):
            raise SystemExit(f"small_latency: {name} imported {self.what}, not {tree}'s")

    def _line(self, r: int) -> str:
        line = self.res[r].readline()
        if not line:
            raise SystemExit(f"small_latency: {self.name} rank {r} exited (see its output above)")
        return line.strip()

    def block(self, variant: str, nbytes: int, calls: int) -> float:
        """The slowest rank's mean microseconds per call over one block."""
        for f in self.cmd:
            f.write(f"{variant} {nbytes} {calls}\n")
        return max(float(self._line(r)) for r in range(self.nranks))

    def close(self) -> None:
        for f in self.cmd:
            f.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.res:
            f.close()


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def commit_of(tree: Path) -> str:
    """`git describe`-like: the tree's commit, with "+dirty" when it has uncommitted changes."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def orders(items: list, rnd: int) -> list:
    """Round `rnd`'s order: the items rotated by rnd, reversed every other cycle."""
    k = rnd % len(items)
    out = items[k:] + items[:k]
    return out[::-1] if (rnd // len(items)) % 2 else out


def quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values)}


def measure(args: argparse.Namespace, nranks: int, nbytes: int) -> dict:
    """One world size and message size: every side's blocks over the rounds, and the ratios."""
    from pycollectives.bench.meta import cpu_round_trip

    sides = {"new": ROOT, "mpi": None}
    if args.old_tree or args.old_env:  # the old side: another tree, or this one with --old-env
        sides = {"old": Path(args.old_tree or ROOT), **sides}
    variants = {"old": ["call"], "new": ["call"], "mpi": ["call"]}
    if args.stages:
        variants = {"old": ["call", "fast", "solo"], "new": ["call", "fast", "solo"]}
        variants["mpi"] = ["call", "solo"]
    items = [(s, v) for s in sides for v in variants[s]]
    out: dict = {"ranks": nranks, "bytes": nbytes, "calls_per_block": args.calls}
    out["load_before"] = list(os.getloadavg())
    out["cpu_round_trip_ns_before"] = (cpu_round_trip() or {}).get("ns")
    with tempfile.TemporaryDirectory() as tmp:
        running = {}
        try:
            for name, tree in sides.items():
                env = dict(kv.split("=", 1) for kv in getattr(args, f"{name}_env", None) or [])
                running[name] = Side(name, nranks, tmp, tree, env)
            out["software"] = {name: s.what for name, s in running.items()}
            for s, v in items:  # warm-up
                running[s].block(v, nbytes, args.calls)
            times: dict[str, list[float]] = {f"{s}:{v}": [] for s, v in items}
            for rnd in range(args.rounds):
                for s, v in orders(items, rnd):
                    times[f"{s}:{v}"].append(running[s].block(v, nbytes, args.calls))
        finally:
            for s in running.values():
                s.close()
    out["cpu_round_trip_ns_after"] = (cpu_round_trip() or {}).get("ns")
    out["load_after"] = list(os.getloadavg())
    out["us"] = {k: quartiles(v) for k, v in times.items()}
    pairs = [("new", "mpi"), ("old", "mpi"), ("new", "old")]
    out["ratios"] = {}
    for a, b in pairs:
        if f"{a}:call" in times and f"{b}:call" in times:
            r = [x / y for x, y in zip(times[f"{a}:call"], times[f"{b}:call"], strict=True)]
            out["ratios"][f"{a}/{b}"] = quartiles(r) | {"rounds_below_1": sum(x < 1 for x in r)}
    out["rounds"] = times
    return out


def fmt_ratio(q: dict | None) -> str:
    return "-" if q is None else f"{q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f})"


def tables(results: list[dict], stages: bool) -> list[str]:
    rows = [
        "| ranks | size | this tree us | old tree us | OpenMPI us | this / OpenMPI | old / OpenMPI "
        "| this / old | load before-after | round trip ns before/after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        us, ra = r["us"], r["ratios"]
        med = [f"{us[k]['median']:.2f}" if k in us else "-" for k in ("new:call", "old:call")]
        med.append(f"{us['mpi:call']['median']:.2f}")
        trip = [r[f"cpu_round_trip_ns_{w}"] for w in ("before", "after")]
        rows.append(
            f"| {r['ranks']} | {r['bytes']} B | {' | '.join(med)} | "
            f"{' | '.join(fmt_ratio(ra.get(k)) for k in ('new/mpi', 'old/mpi', 'new/old'))} | "
            f"{r['load_before'][0]:.1f}-{r['load_after'][0]:.1f} | "
            f"{'/'.join('-' if t is None else f'{t:.0f}' for t in trip)} |"
        )
    if not stages:
        return rows
    rows += [
        "",
        "| ranks | side | call us | FastPath directly us | one-rank communicator us "
        "| call - one rank (the peers: handshake, waiting) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for side in ("new", "old", "mpi"):
            us = r["us"]
            if f"{side}:call" not in us:
                continue
            get = [us[f"{side}:{v}"]["median"] if f"{side}:{v}" in us else None
                   for v in ("call", "fast", "solo")]  # fmt: skip
            cells = ["-" if x is None else f"{x:.2f}" for x in get]
            label = {"new": "this tree", "old": "old tree", "mpi": "OpenMPI"}[side]
            rows.append(f"| {r['ranks']} | {label} | {' | '.join(cells)} | {get[0] - get[2]:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", help="another source tree, its extension built in place")
    ap.add_argument("--old-env", action="append", help="NAME=VALUE for the old side's ranks")
    ap.add_argument("--new-env", action="append", help="NAME=VALUE for this tree's ranks")
    ap.add_argument("--ranks", default="2,3,4", help="world sizes, comma-separated")
    ap.add_argument("--bytes", action="append", type=size, help="message sizes (default 8)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=2000, help="calls per block")
    ap.add_argument("--stages", action="store_true", help="also the stage-skipping variants")
    ap.add_argument("--json", help="where to write the JSON (default docs/data/small_latency-DATE)")
    ap.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = ap.parse_args()
    import _doc
    import summary as summary_table

    from pycollectives.bench.meta import pycoll_version

    start = datetime.datetime.now(datetime.timezone.utc)
    results = [measure(args, int(n), b) for n in args.ranks.split(",") for b in (args.bytes or [8])]
    command = "python benchmarks/collectives/small_latency.py " + shlex.join(sys.argv[1:])
    parts = []
    for r in results:
        new, mpi = r["us"]["new:call"]["median"], r["us"]["mpi:call"]["median"]
        parts.append(
            f"{r['ranks']} ranks: {new:.2f} us vs OpenMPI {mpi:.2f} us "
            f"({r['ratios']['new/mpi']['median']:.2f}x)"
        )
    sizes = sorted({r["bytes"] for r in results})
    summary = f"{'/'.join(map(str, sizes))}-byte all-reduce, " + "; ".join(parts)
    doc = {
        "command": command,
        "summary": summary + " (median of per-round time ratios, same run)",
        "date": start.isoformat(timespec="seconds"),
        "machine": {"cpu": _doc.cpu_model(), "cpus": os.cpu_count(), "host": os.uname().nodename},
        "load": {"before": results[0]["load_before"], "after": results[-1]["load_after"]},
        "python": sys.version.split()[0],
        "pycollectives": pycoll_version(),
        "trees": {"new": commit_of(ROOT)}
        | ({"old": commit_of(Path(args.old_tree))} if args.old_tree else {}),  # fmt: skip
        "results": results,
    }
    path = Path(args.json or ROOT / "docs" / "data" / f"small_latency-{start:%Y-%m-%d}.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {path}\n# {doc['summary']}")
    notes = [
        f"Trees: this one {doc['trees']['new']}"
        + (f", old {args.old_tree} at {doc['trees']['old']}" if args.old_tree else ""),
        f"{args.rounds} rounds of one block of {args.calls} calls per side (and variant), order "
        "rotating and reversing per round; a block: the slowest rank's mean per call; ratios: "
        "median over rounds of the same round's ratio (interquartile range in brackets)",
        f"Machine shared with other jobs: load average (1 min) {doc['load']['before'][0]:.1f} "
        f"before, {doc['load']['after'][0]:.1f} after; only the paired ratios mean much",
        f"JSON: `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`",
        "Rank r runs on CPU r mod ncpus (OpenMPI bound alike, as `pycollectives-bench --bind "
        "auto` binds it); float32, sum, in place; OpenMPI: `Allreduce(IN_PLACE, array, SUM)` "
        "on a numpy array made once",
    ]
    if args.stages:
        notes.append(
            "Stages: `FastPath directly` calls `comm._fast.all_reduce(t, SUM)` through a lambda "
            "(no method, one Python frame still); `one-rank communicator`: the same call on a "
            "communicator of this rank alone (the call, checks and bookkeeping, no peer); "
            "call - one rank: what the peers add (the handshake, waiting for the later rank)"
        )
    _doc.emit_section(
        BEGIN, END, TITLE,
        f"`{command}`", notes, tables(results, args.stages), not args.no_write,
    )  # fmt: skip
    if not args.no_write:
        load = f"load {doc['load']['before'][0]:.1f}-{doc['load']['after'][0]:.1f}"
        summary_table.record(
            "cpu_small_messages", order=20, compared="CPU small-message all-reduce vs OpenMPI "
            "(mpi4py), Python call included", figures=summary, section="#" + ANCHOR,
            run=f"{_doc.cpu_model()} VM, {start:%Y-%m-%d %H:%M} UTC, {load}", command=command,
        )  # fmt: skip
        summary_table.main([])


if __name__ == "__main__":
    main()
