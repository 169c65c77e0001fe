"""Single copy against the slots, timed in turn on the same ranks, and what the tuner decides.

    python benchmarks/collectives/paths_in_turn.py [--ranks 2,4] [--sizes 1M,4M] [--no-write]

Per rank count, one launch: a communicator made with PYCOLL_CMA_TUNE=0 (single copy
wherever its bands allow it, csrc/comm/cma_choice.cc) and one split from it after PYCOLL_CMA=0
(the slots throughout), timed in turn round after round (the order alternating), so that both
see the machine in the same states (on this VM they switch between a fast and a 3-6x slower
one for seconds at a time: "Fresh communicators" below). A round: per collective (all-reduce,
reduce-scatter, all-gather) and size (nccl-tests' sizes: the buffer, the input, the output),
--calls calls after a barrier, the slowest rank's mean per call. Then a third communicator with
the tuner on (the default) runs --tuned calls of each and reports rank 0's tuner: its decision
and the best time per byte of each path's timed trials (Communicator.cma_tuning), against the
steady per-byte times of the two paths measured in turn. Writes
docs/data/paths_in_turn-DATE.json and, unless --no-write, its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
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

COLLS = ("all_reduce", "reduce_scatter", "all_gather")


def _rank(sizes: list[int], rounds: int, calls: int, tuned: int, out: str, session: bool) -> None:
    if session:  # a session of its own, as torchrun's workers: its own autogroup's CPU share
        os.setsid()
    os.environ["PYCOLL_CMA_TUNE"] = "0"
    cma = pc.init()
    os.environ["PYCOLL_CMA"] = "0"
    slots = cma.split(color=0)  # single copy is agreed per communicator
    n = cma.world_size
    comms = {"cma": cma, "slots": slots}
    bufs = {(c, s): buffers(c, s, n) for c in COLLS for s in sizes}
    for key, b in bufs.items():
        for comm in comms.values():
            for _ in range(3):
                call(comm, key[0], b)
    got: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for key, b in bufs.items():
            for name in ("cma", "slots") if rnd % 2 else ("slots", "cma"):
                cma.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call(comms[name], key[0], b)
                x = torch.tensor([(time.perf_counter() - t0) / calls * 1e6], dtype=torch.float64)
                cma.all_reduce(x, op=pc.ReduceOp.MAX)
                got.setdefault(f"{key[0]}:{key[1]}", {}).setdefault(name, []).append(x.item())
    taken = {name: {k: dict(v.get("paths", {})) for k, v in c.stats().items() if k in COLLS}
             for name, c in comms.items()}  # fmt: skip
    os.environ.pop("PYCOLL_CMA")
    os.environ.pop("PYCOLL_CMA_TUNE")
    auto = cma.split(color=0)  # the default: the tuner times both paths
    for key, b in bufs.items():
        for _ in range(tuned):
            call(auto, key[0], b)
    tuning = {
        op: {str(k): v for k, v in classes.items()} for op, classes in auto.cma_tuning().items()
    }
    for c in (auto, slots, cma):
        c.close()
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps({"rounds": got, "paths": taken, "tuning": tuning}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="1M,4M")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument(
        "--tuned", type=int, default=12, help="calls per case on the tuned communicator"
    )
    ap.add_argument(
        "--sessions",
        action="store_true",
        help="each rank in a session of its own (os.setsid), as torchrun starts its workers: "
        "with the kernel's autogroup scheduling each session gets its own share of the CPUs",
    )
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    busy0, load0, t0 = busy_cores(), os.getloadavg(), time.perf_counter()
    table = [
        "| ranks | case | single copy us | slots us | single copy / slots | tuner's trials, ns/B "
        "(single copy / slots) | steady, ns/B | tuner (rank 0) |",
        "|---:|---|---:|---:|---:|---|---|---|",
    ]
    record: dict[str, dict] = {}
    for n in (int(x) for x in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "got.json")
            rc = spawn(_rank, n, (sizes, args.rounds, args.calls, args.tuned, out, args.sessions),
                       prog="paths_in_turn")  # fmt: skip
            if rc != 0:
                return rc
            got = json.loads(Path(out).read_text())
        record[str(n)] = got
        for coll in COLLS:
            for size in sizes:
                med = {p: statistics.median(t) for p, t in got["rounds"][f"{coll}:{size}"].items()}
                tun = got["tuning"].get(coll, {}).get(str(1 << (size.bit_length() - 1)), {})
                trial = f"{tun.get('cma_ns_per_byte') or 0:.2f} / {tun.get('slots_ns_per_byte') or 0:.2f}"
                steady = f"{med['cma'] * 1e3 / size:.2f} / {med['slots'] * 1e3 / size:.2f}"
                table.append(
                    f"| {n} | {coll} {size_label(size)} | {med['cma']:.0f} | {med['slots']:.0f} | "
                    f"{med['cma'] / med['slots']:.2f} | {trial if tun else 'outside the bands'} | "
                    f"{steady} | {tun.get('decided') or '-'} |"
                )
    load1 = os.getloadavg()
    notes = [
        f"Per rank count one launch; per case the median over {args.rounds} rounds of the "
        f"slowest rank's mean per call ({args.calls} calls after a barrier), the two paths in "
        f"turn. The tuner: a default communicator after {args.tuned} calls of each case, rank 0's "
        "decision and the best per-byte time of each path's timed trials (one call each).",
        f"Paths taken: {json.dumps({n: r['paths'] for n, r in record.items()})}.",
        run_note(load0, load1, t0, busy0),
    ]
    publish("paths_in_turn", "Single copy against the slots in turn, and the tuner's trials",
            notes, table, {"load_start": load0, "load_end": load1, "busy_before": busy0,
                           "runs": record}, not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
