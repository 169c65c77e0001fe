"""Where single copy (CMA) beats the slots on plain buffers on this machine, and
whether the automatic choice finds it: the evidence behind the size bands in
csrc/comm/cma_choice.cc (cma_band) and the tuner inside them.

For each world size, runs pycollectives-bench three times on plain buffers,
rounds interleaved: PYCOLL_ALGO=cma (single copy at every size), PYCOLL_CMA=0
(the slots) and the default (auto: single copy inside the bands where the
tuner timed it faster), and writes the times and the ratio of the first two to
docs/benchmarks.md between the `cma_crossover` markers.

    python benchmarks/collectives/cma_crossover.py [--ranks 2,3,4] [--rounds 2] [--coll C1,C2] [--no-write]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section, median_times, ratio_cells, rounds_args, size_label

BEGIN, END = "<!-- cma_crossover:begin -->", "<!-- cma_crossover:end -->"
COLLS = "all_reduce,reduce_scatter,all_gather,reduce,broadcast,all_to_all"
# -w 5: the tuner's five calls per size (one untimed, two of each path) come before the timing.
FLAGS = ["-b", "64K", "-e", "64M", "-f", "4", "-n", "20", "-w", "5", "--trials", "3", "-c", "1"]
MODES = {"cma": {"PYCOLL_ALGO": "cma"}, "slots": {"PYCOLL_CMA": "0"}, "auto": {}}


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

    def cells(c: str, size: int) -> str:
        auto = t.get((c, size, "auto"))
        return ratio_cells(t.get((c, size, "slots")), t.get((c, size, "cma"))) + (
            " - |" if auto is None else f" {auto:.1f} |"
        )

    for group in (colls[i : i + 3] for i in range(0, len(colls), 3)):
        head = "| size |" + "".join(f" {c} slots us | {c} cma us | x | auto us |" for c in group)
        lines += [head, "|---:|" + "---:|---:|---:|---:|" * len(group)]
        for size in sizes:
            lines.append(f"| {size_label(size)} |" + "".join(cells(c, size) for c in group))
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
        f"`python benchmarks/collectives/cma_crossover.py --ranks {args.ranks} --rounds "
        f"{args.rounds}`: per world size, `pycollectives-bench {' '.join(FLAGS)} --coll "
        f"{args.coll}` with "
        "`PYCOLL_ALGO=cma` (single copy at every size), with `PYCOLL_CMA=0` (the slots: "
        "ring, or one-shot where it fits) and with neither (auto: single copy inside the size "
        "bands where the tuner timed it faster, docs/api.md 'Single copy'), rounds interleaved; "
        "time = median over rounds of the bench's time (itself the median of 3 trials of the "
        "slowest rank's mean); x = slots time / cma time (> 1: single copy faster). Sizes are nccl-tests' (the all-reduce, reduce and "
        "broadcast buffer, the reduce-scatter input, the all-gather and all-to-all output).",
        ["Every row was checked (`-c 1`), 0 wrong elements."],
        tables,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
