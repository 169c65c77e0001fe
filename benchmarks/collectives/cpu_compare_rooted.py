"""Broadcast, reduce, all-to-all and sendrecv: pycollectives against gloo and OpenMPI on local
ranks, in one run.

    python benchmarks/collectives/cpu_compare_rooted.py [--ranks 2,3,4] [--trials 3] [--no-write]

For each world size, runs `pycollectives-bench --compare mpi` and `--compare gloo` for the four
operations from 64 KiB to 64 MiB (as cpu_compare.py: 50 calls per trial up to 1 MiB, 10 from
4 MiB, pycollectives and one peer in the same ranks in rounds of one trial each at every size,
--interleave 1; each ratio against pycollectives from the peer's invocation), then rewrites the
section between
the `cpu_compare_rooted` markers in docs/benchmarks.md. The issue sets no target for these
collectives; the tables show where pycollectives stands against its peers on them. sendrecv is
nccl-tests' sendrecv_perf: every rank sends to the next and receives from the previous at once
(pycollectives' batch_p2p, torch's batch_isend_irecv, MPI_Sendrecv).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section, round_trips, run_bench
from cpu_compare import GLOO_RUN, renamed, table

COLLS = ["broadcast", "reduce", "all_to_all", "sendrecv"]
# At least 5 warmup calls a size: the single-copy tuner's (one untimed call, then two timed
# calls of each path) fall in them.
SIZE_RUNS = [
    ["-b", "64K", "-e", "1M", "-f", "4", "-n", "50", "-w", "10", "--interleave", "1"],
    ["-b", "4M", "-e", "64M", "-f", "4", "-n", "10", "-w", "5", "--interleave", "1"],
]
BEGIN, END = "<!-- cpu_compare_rooted:begin -->", "<!-- cpu_compare_rooted:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--trials", default="3")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    rows, meta, trips = [], None, []
    for n in ranks:
        for sizes, part in zip(SIZE_RUNS, ("small", "large"), strict=True):
            flags = [*sizes, "--coll", ",".join(COLLS), "--trials", args.trials, "-c", "1"]
            data = run_bench(n, ["--compare", "mpi", *flags])
            trips.append(round_trips(f"{n} ranks {part} mpi", data))
            rows += data["rows"]
            meta = meta or data["metadata"]
            data = run_bench(n, ["--compare", "gloo", *flags])
            trips.append(round_trips(f"{n} ranks {part} gloo", data))
            rows += renamed(data, GLOO_RUN)
    wrong = sum(r.get("wrong") or 0 for r in rows)
    v = meta["versions"] if meta else {}
    tables: list[str] = []
    for coll in COLLS:
        for n in ranks:
            tables += [f"### {coll}, {n} ranks", "", *table(rows, coll, n), ""]
    emit_section(
        BEGIN,
        END,
        "CPU: broadcast, reduce, all-to-all and sendrecv against gloo and OpenMPI",
        f"`python benchmarks/collectives/cpu_compare_rooted.py --ranks {args.ranks} --trials {args.trials}` "
        f"(each world size: `pycollectives-bench --nproc N {' '.join(SIZE_RUNS[0])} --coll "
        f"{','.join(COLLS)} --trials {args.trials} -c 1 --compare mpi` and the same with "
        f"`{' '.join(SIZE_RUNS[1])}`, each again with `--compare gloo`; root 0; plain buffers)",
        [
            f"Software: pycollectives {v.get('pycollectives')} ({v.get('simd_level')}), torch "
            f"{v.get('torch')} (gloo), {v.get('mpi', 'no MPI')}, mpi4py {v.get('mpi4py', '-')}; "
            f"single copy (CMA): {v.get('single_copy', '?')}",
            "float32, op sum (reduce); time = median over trials of the slowest rank's mean time "
            "per call; busbw in GB/s (nccl-tests factors); ratio = peer time / pycollectives time "
            "(> 1: pycollectives faster)",
            f"Correctness: every pycollectives row was checked (`-c 1`): {wrong} wrong elements",
            "Cache-line round trip between the two CPUs before/after each invocation, ns (see "
            "'Reading the CPU figures', 'Where the host runs the two vCPUs'): " + ", ".join(trips),
        ],
        tables,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
