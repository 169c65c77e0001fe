"""Whether a collective's speed comes with its communicator or with the moment: the same
ranks time the same all-reduces on --rounds fresh communicators, one after the other, then on
one communicator kept for as many rounds, then (control, no pycollectives) pass 4 MiB between
two processes through a fresh shared mapping per round.

    python benchmarks/collectives/fresh_communicators.py [--ranks 2] [--rounds 12] [--no-write]

The same processes, pinned as `pycollectives-bench --bind auto` pins them (rank r on CPU
r mod the CPUs), the same input tensors, single copy off (PYCOLL_CMA=0: the slots path at
every size, so that no tuner's choice differs between communicators). A round: per size,
--trials trials of --calls in-place float32 all-reduces after a barrier, each trial the
slowest rank's mean per call; a round's figure per size is its least trial. "fresh": each
round on a new communicator (pycollectives.init; the previous one closed: new shared
segment, new slots); "kept": every round on the communicator made first. The control
(mapping_rounds): one process writes 4 MiB into a fresh shared mapping and raises a flag,
the other, pinned to the second CPU, copies them out and answers. Where all three move
alike from round to round, the machine, not the communicator, decides (on the VM measured,
docs/benchmarks.md: it switches between a fast and a 3-6x slower state for seconds at a
time; the cause, the host's placement of the guest's vCPUs or memory, is out of its sight).
Writes docs/data/fresh_communicators-DATE.json and, unless --no-write, its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import pycollectives as pc
from pycollectives.launcher import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import publish, run_note, size_label  # noqa: E402

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _round(comm: pc.Communicator, bufs: dict, trials: int, calls: int) -> dict[int, float]:
    """Per size: the least over `trials` of the slowest rank's mean time per call (us)."""
    out = {}
    for size, x in bufs.items():
        for _ in range(5):
            comm.all_reduce(x)
        per = []
        for _ in range(trials):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.all_reduce(x)
            per.append((time.perf_counter() - t0) / calls * 1e6)
        slowest = torch.tensor(per, dtype=torch.float64)
        comm.all_reduce(slowest, op=pc.ReduceOp.MAX)
        out[size] = min(slowest.tolist())
    return out


def _rank(rounds: int, trials: int, calls: int, out: str) -> None:
    rank = int(os.environ["RANK"])
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    bufs = {size: torch.ones(size // 4) for size in SIZES}
    got: dict[str, list[dict[int, float]]] = {"fresh": [], "kept": []}
    for _ in range(rounds):
        comm = pc.init()
        got["fresh"].append(_round(comm, bufs, trials, calls))
        comm.close()
    comm = pc.init()
    for _ in range(rounds):
        got["kept"].append(_round(comm, bufs, trials, calls))
    comm.close()
    if rank == 0:
        Path(out).write_text(json.dumps(got))


def mapping_rounds(rounds: int, size: int = 4 << 20, reps: int = 30) -> list[float]:
    """The control without pycollectives: per round a fresh shared mapping, two processes
    pinned to the first two CPUs; one writes `size` bytes into it and raises a flag, the
    other copies them out and answers, `reps` times; the round's figure is the least time
    (us) of a write and the peer's read."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    out = []
    for _ in range(rounds):
        m = mmap.mmap(-1, size + 4096, flags=mmap.MAP_SHARED)
        flag = np.frombuffer(m, dtype=np.int64, count=1)
        buf = np.frombuffer(m, dtype=np.uint8, count=size, offset=4096)
        buf[:] = 1
        pid = os.fork()
        if pid == 0:  # the reader
            try:
                os.sched_setaffinity(0, {cpus[-1]})
                mine = np.empty(size, np.uint8)
                for i in range(reps):
                    deadline = time.perf_counter() + 10  # a writer gone: no orphan spinning
                    while flag[0] != 2 * i + 1:
                        if time.perf_counter() > deadline:
                            os._exit(1)
                    np.copyto(mine, buf)
                    flag[0] = 2 * i + 2
            finally:
                os._exit(0)
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
        src, best = np.ones(size, np.uint8), float("inf")
        for i in range(reps):
            t0 = time.perf_counter()
            np.copyto(buf, src)
            flag[0] = 2 * i + 1
            deadline = t0 + 10
            while flag[0] != 2 * i + 2:
                if time.perf_counter() > deadline:
                    os.kill(pid, 9)
                    raise RuntimeError("fresh_communicators: the mapping's reader did not answer")
            best = min(best, time.perf_counter() - t0)
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, before)
        del flag, buf
        m.close()
        out.append(best * 1e6)
    return out


def spread(per_round: list[dict], size: int) -> tuple[list[float], float]:
    """(the rounds' figures at `size`, slowest / fastest); per_round as read back from the
    ranks' JSON (sizes as strings)."""
    vals = [r[str(size)] for r in per_round]
    return vals, max(vals) / min(vals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ["PYCOLL_CMA"] = "0"
    load0, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rounds.json")
        rc = spawn(_rank, args.ranks, (args.rounds, args.trials, args.calls, out),
                   prog="fresh_communicators")  # fmt: skip
        if rc != 0:
            return rc
        got = json.loads(Path(out).read_text())
    mapped = mapping_rounds(args.rounds)
    load1 = os.getloadavg()
    table = [
        "| size | fresh: each round's figure (us) | fresh: slowest / fastest | "
        "kept: each round's figure (us) | kept: slowest / fastest |",
        "|---:|---|---:|---|---:|",
    ]
    ratios = {}
    for size in SIZES:
        fv, fr = spread(got["fresh"], size)
        kv, kr = spread(got["kept"], size)
        ratios[size] = (fr, kr)
        table.append(f"| {size_label(size)} | {' '.join(f'{v:.0f}' for v in fv)} | {fr:.2f} | "
                     f"{' '.join(f'{v:.0f}' for v in kv)} | {kr:.2f} |")  # fmt: skip
    table += [
        "",
        "Control without pycollectives: 4 MiB written into a fresh shared mapping and read out by "
        "a second process (numpy copies, a flag in the mapping; the least of 30 per mapping):",
        "",
        "| mappings (us, in order) | slowest / fastest |",
        "|---|---:|",
        f"| {' '.join(f'{v:.0f}' for v in mapped)} | {max(mapped) / min(mapped):.2f} |",
    ]
    summary = (
        f"all-reduce at {args.ranks} ranks, slowest / fastest of {args.rounds} rounds: fresh "
        f"communicators median {statistics.median(f for f, _ in ratios.values()):.2f} over the "
        f"sizes, one kept communicator {statistics.median(k for _, k in ratios.values()):.2f}; "
        f"without pycollectives, 4 MiB through fresh shared mappings {max(mapped) / min(mapped):.2f}"
    )
    notes = [
        f"Result: {summary}.",
        f"A round: per size {args.trials} trials of {args.calls} calls after a barrier, each "
        "trial the slowest rank's mean per call; the round's figure its least trial. Single "
        "copy off (PYCOLL_CMA=0): the slots path at every size.",
        run_note(load0, load1, t0),
    ]
    record = {"summary": summary, "load_start": load0, "load_end": load1, "rounds": got,
              "mappings_us": mapped}  # fmt: skip
    publish("fresh_communicators",
            "Fresh communicators, one kept, and shared memory without pycollectives: the machine's states",
            notes, table, record, not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
