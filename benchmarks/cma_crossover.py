"""Where single copy (CMA) beats the slots on plain buffers: the evidence behind
the size bands in csrc/comm/communicator.cc (cma_wins) and docs/api.md.

For each world size, runs pycollectives-bench twice on plain buffers, rounds
interleaved: PYCOLL_ALGO=cma (single copy at every size) and PYCOLL_CMA=0 (the
slots), and writes the times and their ratio to docs/benchmarks.md between the
`cma_crossover` markers.

    python benchmarks/cma_crossover.py [--ranks 2,3,4] [--rounds 2] [--coll C1,C2] [--no-write]
"""

from __future__ import annotations

from _doc import emit_section, median_times, ratio_cells, rounds_args, size_label

BEGIN, END = "<!-- cma_crossover:begin -->", "<!-- cma_crossover:end -->"
COLLS = "all_reduce,reduce_scatter,all_gather,reduce,broadcast,all_to_all"
FLAGS = ["-b", "64K", "-e", "64M", "-f", "4", "-n", "20", "-w", "3", "--trials", "3", "-c", "1"]
MODES = {"cma": {"PYCOLL_ALGO": "cma"}, "slots": {"PYCOLL_CMA": "0"}}


def measure(nranks: int, colls: str, rounds: int) -> dict[tuple[str, int, str], float]:
    """Median time (us) per (collective, size, mode) over `rounds` rounds."""

    def check(mode: str, data: dict) -> None:
        if mode == "cma" and data["metadata"]["versions"].get("single_copy") != "yes":
            raise SystemExit("single copy (CMA) is not available between ranks here")

    return median_times(nranks, [*FLAGS, "--coll", colls], MODES, rounds, check)


def table(nranks: int, colls: list[str], t: dict[tuple[str, int, str], float]) -> list[str]:
    """One table per world size and three collectives."""
    sizes = sorted({size for (_, size, _) in t})
    lines = [f"### {nranks} ranks", ""]
    for group in (colls[i : i + 3] for i in range(0, len(colls), 3)):
        head = "| size |" + "".join(f" {c} slots us | {c} cma us | x |" for c in group)
        lines += [head, "|---:|" + "---:|---:|---:|" * len(group)]
        for size in sizes:
            cells = [ratio_cells(t.get((c, size, "slots")), t.get((c, size, "cma"))) for c in group]
            lines.append(f"| {size_label(size)} |" + "".join(cells))
        lines.append("")
    return lines


def main() -> None:
    args = rounds_args(__doc__, "2,3,4", COLLS)
    tables: list[str] = []
    for n in (int(x) for x in args.ranks.split(",")):
        tables += table(n, args.coll.split(","), measure(n, args.coll, args.rounds))
    emit_section(
        BEGIN,
        END,
        "Single copy (CMA) against the slots, plain buffers",
        f"`python benchmarks/cma_crossover.py --ranks {args.ranks} --rounds "
        f"{args.rounds}`: per world size, `pycollectives-bench {' '.join(FLAGS)} --coll "
        f"{args.coll}` with "
        "`PYCOLL_ALGO=cma` (single copy at every size) and with `PYCOLL_CMA=0` (the slots: "
        "ring, or one-shot where it fits), rounds interleaved; time = median over rounds of the "
        "bench's time (itself the median of 3 trials of the slowest rank's mean); x = slots time "
        "/ cma time (> 1: single copy faster). Sizes are nccl-tests' (the all-reduce, reduce and "
        "broadcast buffer, the reduce-scatter input, the all-gather and all-to-all output).",
        [
            "Every row was checked (`-c 1`), 0 wrong elements. The automatic choice "
            "(docs/api.md, 'Single copy') takes CMA where these runs and the runs before them "
            "showed it faster."
        ],
        tables,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
