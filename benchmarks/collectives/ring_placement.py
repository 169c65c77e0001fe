"""The ring all-reduce against where its ranks run, with the host's state beside each figure.

    python benchmarks/collectives/ring_placement.py [--ranks 4] [--size 64M] [--calls 30] [--rounds 4]

With more ranks than CPUs, pins rank r to CPU r mod ncpus ("round robin": every ring neighbour on
another CPU), to CPU r * ncpus // nranks ("blocks": consecutive ranks together), or not at all
("unpinned"), and times an all-reduce of --size bytes (float32, median of --calls calls, each after
a barrier, slowest rank), in --rounds rounds over the three placements. Before and after each run it
prints the round trip of a cache line between the first two CPUs (`_C.cpu_round_trip_ns`): on a
VM that moves as the host moves the vCPUs, and the ring's time with it (docs/benchmarks.md,
"Reading the CPU figures"). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import free_port


def rank_main(rank: int, n: int, port: int, cpu: int | None, nbytes: int, calls: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    import pycollectives

    with pycollectives.init() as comm:
        t = torch.ones(nbytes // 4)
        for _ in range(3):
            comm.all_reduce(t)
        times = []
        for _ in range(calls):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        out.put((rank, times))


def run(n: int, cpus: list[int | None], nbytes: int, calls: int) -> float:
    """Median over calls of the slowest rank's time (ms) with rank r on cpus[r]."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, n, port, cpus[r], nbytes, calls, out))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with status {p.exitcode}")
    return 1e3 * statistics.median(max(got[r][i] for r in got) for i in range(calls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size", default="64M", help="bytes per rank (K/M suffixes)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    from pycollectives import _C
    from pycollectives.bench.specs import parse_size

    nbytes, n = parse_size(args.size), args.ranks
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("needs at least two CPUs")
    placements = {
        "round robin": [allowed[r % len(allowed)] for r in range(n)],
        "blocks": [allowed[r * len(allowed) // n] for r in range(n)],
        "unpinned": [None] * n,
    }
    trip = lambda: _C.cpu_round_trip_ns(allowed[0], allowed[1])  # noqa: E731
    print(f"# {n} ranks, all-reduce of {nbytes} bytes, CPUs {allowed}")
    print("| round | placement | CPUs | round trip before (ns) | ms | round trip after (ns) |")
    print("|---:|---|---|---:|---:|---:|")
    for rnd in range(args.rounds):
        for name, cpus in placements.items():
            before = trip()
            ms = run(n, cpus, nbytes, args.calls)
            where = ",".join("-" if c is None else str(c) for c in cpus)
            print(
                f"| {rnd} | {name} | {where} | {before:.0f} | {ms:.2f} | {trip():.0f} |", flush=True
            )


if __name__ == "__main__":
    main()
