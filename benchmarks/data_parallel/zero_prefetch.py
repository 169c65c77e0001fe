"""Exposed communication per step of ZeRO-3 and FSDP with prefetch 0, 1 and 2,
and the number of unit all-gathers in flight, checked against the bound.

    python benchmarks/data_parallel/zero_prefetch.py               # the ~50M GPT of zero_step.py, 2 ranks
    python benchmarks/data_parallel/zero_prefetch.py --layers 2 --d-model 128 --no-write

The same machinery as zero_step.py (benchmarks/data_parallel/_zero_cells.py): each setup
built in turn per round, warm-up and timed steps, the order reversed every
other round. The engine's meter (strategies/data_parallel/sharding/meter.py) gives, per
step, the time this rank was blocked on the units' all-gathers (the exposed
part of the gathers: prefetch hides the rest behind the previous unit's
compute), the time blocked on reduce-scatters, the all-gathers started and
the most in flight at once. Bound: at most max(prefetch, 1) unit all-gathers
in flight (an on-demand gather is one; prefetch K issues the next K units).
Writes docs/benchmarks.md between <!-- zero_prefetch:begin --> and
<!-- zero_prefetch:end -->.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section
from zero_step import common_args, measure

BEGIN, END = "<!-- zero_prefetch:begin -->", "<!-- zero_prefetch:end -->"
CELLS = "compute,zero3-p0,zero3-p1,zero3-p2,fsdp-p0,fsdp-p1,fsdp-p2"


def render(m: dict) -> list[str]:
    """The table and the verdict on the bound."""
    comp, fb0 = m["compute"]["step"], m["compute"]["fb"]
    rows = [
        "| setup | prefetch | step ms | forward + backward ms | above one process ms "
        "| exposed all-gather ms "
        "| exposed reduce-scatter ms | collectives' own time ms | all-gathers per step "
        "| most in flight | bound max(prefetch, 1) | within |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| one process, no communication | | {comp * 1e3:.0f} | {fb0 * 1e3:.0f} |" + " |" * 8,
    ]
    ok = True
    for cell, r in m.items():
        if cell == "compute":
            continue
        mode, _, pf = cell.partition("-p")
        bound = max(int(pf), 1)
        within = r["max_in_flight"] <= bound
        ok &= within
        name = "ZeRO-3" if mode == "zero3" else "fully_shard (reshard)"
        rows.append(
            f"| {name} | {pf} | {r['step'] * 1e3:.0f} | {r['fb'] * 1e3:.0f} "
            f"| {(r['fb'] - fb0) * 1e3:.0f} "
            f"| {r['gather_wait_s'] * 1e3:.0f} | {r['reduce_wait_s'] * 1e3:.0f} "
            f"| {r['comm_s'] * 1e3:.0f} | {r['gathers']:.0f} | {r['max_in_flight']:.0f} "
            f"| {bound} | {'yes' if within else 'NO'} |"
        )
    saved = []
    for mode, name in (("zero3", "ZeRO-3"), ("fsdp", "fully_shard")):
        a, b = m.get(f"{mode}-p0"), m.get(f"{mode}-p2")
        if a and b:
            saved.append(
                f"{name}: exposed all-gather {a['gather_wait_s'] * 1e3:.0f} ms -> "
                f"{b['gather_wait_s'] * 1e3:.0f} ms, step {a['step'] * 1e3:.0f} ms -> "
                f"{b['step'] * 1e3:.0f} ms"
            )
    return [
        *rows,
        "",
        (f"Prefetch 0 -> 2: {'; '.join(saved)}. " if saved else "")
        + "All-gathers in flight within the bound in "
        + f"every step of every setup: {'yes' if ok else 'NO'} (the most over the timed steps "
        "of rank 0; tests/strategies/data_parallel/test_fsdp.py asserts the exact count). Step: median of the slowest "
        "rank; forward + backward (zero_grad, forward, backward and the communication it waits "
        "for): median of rank 0; above one process: that less the one-process forward + "
        "backward. collectives' own time: comm.stats() time_s, overlapped or not.",
    ]


def main() -> int:
    args = common_args(__doc__, CELLS).parse_args()
    cells = args.cells.split(",")
    cells = ["compute", *(c for c in cells if c != "compute")]  # the table's baseline row
    m, notes, _ = measure(args, cells)
    argv = " ".join(sys.argv[1:])
    emit_section(
        BEGIN,
        END,
        "ZeRO-3 and FSDP: exposed communication with and without prefetch",
        f"`python benchmarks/data_parallel/zero_prefetch.py{' ' + argv if argv else ''}`",
        notes,
        render(m),
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
