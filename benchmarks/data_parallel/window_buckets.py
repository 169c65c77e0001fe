"""A DDP bucket's all-reduce in place across symmetric windows against the same
all-reduce through the ring's slots: paired, in the same ranks.

    python benchmarks/data_parallel/window_buckets.py [--ranks 2] [--sizes 1M,25M,64M] [--trials 15]

Each rank opens two communicators: one as DDP's buckets get it (PYCOLL_ALGO
unset: an all-reduce of a `comm.alloc_shared` window runs in place across the
ranks' windows), one with PYCOLL_ALGO=ring (the same window all-reduced through
the ring's shared slots). For each size (float32, ReduceOp.AVG, as a bucket is
averaged) the trials alternate between the two, the order swapped every trial;
a trial is 5 all-reduces after a barrier. Reports the median trial of the
slowest rank, the median of the paired ratios, and what comm.stats() says each
path copied on this rank (bytes_out + bytes_in per call) and which path it took.
Prints the rows; no file is written.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import cpu_model, free_port  # noqa: E402

PATHS = ("window", "ring")
REPS = 5


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q: object) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import pycollectives as pc

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    comms = {}
    for path in PATHS:
        if path == "ring":
            os.environ["PYCOLL_ALGO"] = "ring"
        else:
            os.environ.pop("PYCOLL_ALGO", None)
        comms[path] = pc.init(rank=rank, world_size=world, store=store, prefix=f"wb-{path}")
    out = {}
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        bufs = {p: comms[p].alloc_shared(size // 4, torch.float32) for p in PATHS}
        for p in PATHS:
            bufs[p].fill_(rank + 1.0)
            comms[p].all_reduce(bufs[p], pc.ReduceOp.AVG)  # warm-up
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        copied: dict[str, float] = {}
        seen: dict[str, dict] = {}
        for t in range(args.trials):
            for p in PATHS if t % 2 == 0 else reversed(PATHS):
                comm = comms[p]
                before = comm.stats().get("all_reduce", {})
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(REPS):
                    comm.all_reduce(bufs[p], pc.ReduceOp.AVG)
                times[p].append((time.perf_counter() - t0) / REPS)
                after = comm.stats()["all_reduce"]
                moved = sum(after[k] - before.get(k, 0) for k in ("bytes_out", "bytes_in"))
                copied[p] = moved / REPS
                seen[p] = after.get("paths", {})
        out[size] = (times, copied, seen)
        del bufs
    q.put((rank, out))
    for c in comms.values():
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="1M,25M,64M")
    ap.add_argument("--trials", type=int, default=15)
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}, "
        f"{cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}; {args.ranks} ranks, {args.trials} paired trials of {REPS}"
    )
    for size in got[0]:
        slow = {
            p: [max(got[r][size][0][p][i] for r in got) for i in range(args.trials)] for p in PATHS
        }
        ratio = statistics.median(a / b for a, b in zip(slow["ring"], slow["window"], strict=True))
        cells = []
        for p in PATHS:
            copied = max(got[r][size][1][p] for r in got)
            cells.append(
                f"{p} {1e3 * statistics.median(slow[p]):.2f} ms, copied {copied / size:.2f}x "
                f"the bucket, path {'/'.join(got[0][size][2][p])}"
            )
        print(f"{size >> 20} MiB: " + "; ".join(cells) + f"; ring / window {ratio:.2f}x")


if __name__ == "__main__":
    main()
