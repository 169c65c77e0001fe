"""Where streaming (non-temporal) stores into the caller's output pay: the evidence behind
PYCOLL_STREAM_BYTES' default (csrc/comm/dispatch.cc, output_store).

For each world size, runs pycollectives-bench on all-reduce and all-gather, on plain buffers and
on registered ones (-R 1), rounds interleaved: PYCOLL_STREAM_BYTES=0 (every copy into an output
streamed) and PYCOLL_STREAM_BYTES=1024G (none), and writes the times and their ratio to
docs/benchmarks.md between the `streaming_stores` markers.

    python benchmarks/collectives/streaming_stores.py [--ranks 1,2,3,4] [--rounds 2] [--no-write]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section, median_times, ratio_cells, rounds_args, size_label

BEGIN, END = "<!-- streaming_stores:begin -->", "<!-- streaming_stores:end -->"
COLLS = ("all_reduce", "all_gather")
FLAGS = ["-b", "1M", "-e", "64M", "-f", "4", "--coll", ",".join(COLLS),
         "-n", "10", "-w", "3", "--trials", "3", "-c", "1"]  # fmt: skip
MODES = {"cached": {"PYCOLL_STREAM_BYTES": "1024G"}, "streamed": {"PYCOLL_STREAM_BYTES": "0"}}
BUFFERS = {"plain": [], "registered": ["-R", "1"]}


def table(nranks: int, rounds: int) -> list[str]:
    """One world size: cached and streamed time and their ratio, per collective and buffer."""
    kinds = [b for b in BUFFERS if nranks > 1 or b == "plain"]  # one rank has no windows
    t = {kind: median_times(nranks, FLAGS + BUFFERS[kind], MODES, rounds) for kind in kinds}
    cols = [(c, k) for c in COLLS for k in kinds]
    head = "| size |" + "".join(f" {c} {k} cached us | streamed us | x |" for c, k in cols)
    lines = [f"### {nranks} rank{'s' if nranks > 1 else ''}", "", head]
    lines.append("|---:|" + "---:|---:|---:|" * len(cols))
    for size in sorted({s for times in t.values() for (_, s, _) in times}):
        pairs = [(t[k].get((c, size, "cached")), t[k].get((c, size, "streamed"))) for c, k in cols]
        cells = [ratio_cells(a, b) for a, b in pairs]
        lines.append(f"| {size_label(size)} |" + "".join(cells))
    return [*lines, ""]


def main() -> None:
    args = rounds_args(__doc__, "1,2,3,4")
    tables: list[str] = []
    for n in (int(x) for x in args.ranks.split(",")):
        tables += table(n, args.rounds)
    emit_section(
        BEGIN,
        END,
        "Streaming stores into the output",
        f"`python benchmarks/collectives/streaming_stores.py --ranks {args.ranks} --rounds "
        f"{args.rounds}`: per world size, `pycollectives-bench {' '.join(FLAGS)}` (and the same "
        "with `-R 1`) under `PYCOLL_STREAM_BYTES=1024G` (cached: no copy streamed) and "
        "`PYCOLL_STREAM_BYTES=0` (streamed: every copy into an output), rounds interleaved; "
        "time = median over rounds of the bench's time (the median of 3 trials of the slowest "
        "rank's mean); x = cached time / streamed time (> 1: streaming faster). Sizes are "
        "nccl-tests' (all-reduce buffer, all-gather output). Plain all-reduce takes single copy "
        "at all these sizes, which copies nothing into the output (it reduces in place and "
        "writes the peers through the kernel): its columns measure the same code twice, i.e. "
        "how far this shared machine drifts between runs.",
        ["Every row was checked (`-c 1`), 0 wrong elements."],
        tables,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
