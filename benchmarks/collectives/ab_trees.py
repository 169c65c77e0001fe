"""A/B of two builds of pycollectives on one machine, interleaved finely.

    python benchmarks/collectives/ab_trees.py OLD_TREE NEW_TREE [--bytes 8 --bytes 16M] [--blocks 200]

Each tree (a source checkout with its _C built in place) gets its own pair of
ranks, alive for the whole run, each rank pinned to its own CPU as
pycollectives-bench pins them. The driver then alternates short blocks of
synchronous all-reduces (the fast path, as the bench calls it) between the
two pairs, one pair idle (blocked on a pipe) while the other runs, so that a
machine whose speed drifts within seconds (a shared VM) weighs on both alike.
Prints, per size, the median time per call of each tree over the blocks
(rank 0's clock, each block's mean), the median of the per-round ratios
new / old, and their interquartile range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

RANK = r"""
import os, sys, time
import torch, torch.distributed as dist
import pycollectives as pc
rank, store, cpus = int(sys.argv[1]), sys.argv[2], os.sched_getaffinity(0)
os.sched_setaffinity(0, {sorted(cpus)[rank % len(cpus)]})
torch.set_num_threads(1)
comm = pc.init(rank, 2, store=dist.FileStore(store, 2), timeout=600)
bufs = {}
for line in sys.stdin:
    nbytes, iters = map(int, line.split())
    t = bufs.setdefault(nbytes, torch.ones(max(nbytes // 4, 1)))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(t)
    print((time.perf_counter() - t0) / iters * 1e6, flush=True)
comm.close()
"""


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


class Pair:
    """Two ranks of one tree, fed blocks on stdin, answering per-call microseconds."""

    def __init__(self, tree: str, tmp: str) -> None:
        store = os.path.join(tmp, os.path.basename(tree.rstrip("/")) + "-store")
        env = dict(os.environ, PYTHONPATH=tree)
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), store],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                # `python -c` puts the working directory first on sys.path: run in
                # the tree, or a driver started in another tree imports that one
                cwd=tree,
            )
            for r in range(2)
        ]

    def block(self, nbytes: int, iters: int) -> float:
        for p in self.procs:
            p.stdin.write(f"{nbytes} {iters}\n")
            p.stdin.flush()
        times = [float(p.stdout.readline()) for p in self.procs]
        return times[0]

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--bytes", action="append", type=size, help="sizes (default 8 and 16M)")
    ap.add_argument("--blocks", type=int, default=200, help="blocks per tree and size")
    a = ap.parse_args()
    sizes = a.bytes or [8, 16 << 20]
    with tempfile.TemporaryDirectory() as tmp:
        pairs = {"old": Pair(a.old, tmp), "new": Pair(a.new, tmp)}
        try:
            for nbytes in sizes:
                iters = max(2, min(2000, (20 << 20) // max(nbytes, 1)))  # ~20 ms at the small end
                for p in pairs.values():  # warm-up: single-copy tuning, caches, page faults
                    p.block(nbytes, max(iters, 10))
                got: dict[str, list[float]] = {"old": [], "new": []}
                for b in range(a.blocks):
                    order = ("old", "new") if b % 2 == 0 else ("new", "old")
                    for which in order:
                        got[which].append(pairs[which].block(nbytes, iters))
                ratios = sorted(n / o for o, n in zip(got["old"], got["new"], strict=True))
                q = statistics.quantiles(ratios, n=4)
                print(
                    f"{nbytes} bytes: old median {statistics.median(got['old']):.2f} us, "
                    f"new median {statistics.median(got['new']):.2f} us; new/old per round: "
                    f"median {statistics.median(ratios):.3f}, IQR {q[0]:.3f}-{q[2]:.3f} "
                    f"({a.blocks} rounds of {iters} calls)",
                    flush=True,
                )
        finally:
            for p in pairs.values():
                p.close()


if __name__ == "__main__":
    main()
