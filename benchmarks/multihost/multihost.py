"""Across hosts: hosts made of network namespaces joined by veth pairs on a
bridge (tests/support/netns.py; root only), the ranks of a host sharing memory, TCP
between hosts.

1. 2 hosts x 1 rank: all-reduce, reduce-scatter and all-gather busbw of
   pycollectives against gloo (TCP, GLOO_SOCKET_IFNAME=eth0) and, where
   `mpirun` is installed, OpenMPI (`--mca btl tcp,self`, benchmarks/common/mpi_sweep.c),
   8 B to 256 MiB.
2. 2 hosts x 2 ranks: the hierarchical all-reduce against the flat ring
   (PYCOLL_ALGO=ring), with the bytes host 0 sends to the other host per
   all-reduce against the least any all-reduce sends, 2S(h-1)/h.
3. Both again with `tc netem` shaping every host's link to 10 Gbit/s and
   50 us each way (where the kernel has no netem: a 10 Gbit/s token bucket,
   no delay), where the network, not memory, is the limit.

busbw (as nccl-tests): all-reduce 2(n-1)/n S/t, reduce-scatter and all-gather
(n-1)/n S/t, S the whole buffer (the all-gather's output), t the median time
per call on rank 0 over 3 repetitions. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))

import _doc  # noqa: E402
import mpi_runner  # noqa: E402
import netns  # noqa: E402
from multihost_jobs import run_on_hosts  # noqa: E402

BEGIN, END = "<!-- multihost:begin -->", "<!-- multihost:end -->"
COLLS = ["all_reduce", "reduce_scatter", "all_gather"]
# 8 B, 64 B, ..., 128 MiB (x8 apart), with 64 KiB and 1 MiB between, and 256 MiB
SIZES = sorted({8 << (3 * k) for k in range(9)} | {64 << 10, 1 << 20, 256 << 20})


def iters_for(size: int) -> int:
    return max(3, min(200, (64 << 20) // max(size, 1)))


def busbw(coll: str, size: int, n: int, seconds: float) -> float:
    """GB/s."""
    factor = 2 * (n - 1) / n if coll == "all_reduce" else (n - 1) / n
    return factor * size / seconds / 1e9


def _calls(backend: str, coll: str, comm, full, part) -> tuple:
    """The call to time and the barrier, for one backend and collective."""
    import torch.distributed as dist

    if backend == "pycoll":
        return {
            "all_reduce": lambda: comm.all_reduce(full),
            "reduce_scatter": lambda: comm.reduce_scatter(part, full),
            "all_gather": lambda: comm.all_gather(full, part),
        }[coll], comm.barrier
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
        "all_gather": lambda: dist.all_gather_single(full, part),
    }[coll], dist.barrier


def job_sweep(comm, colls: list[str], sizes: list[int], gloo_port: int) -> list[tuple]:
    """(backend, collective, size, seconds per call) on this rank: pycollectives and,
    if gloo_port (its store on host 0 at that port), gloo, timed back to back at
    each size in alternating order, so that a shared machine's drift hits both
    alike (they used to run one whole sweep after the other)."""
    import torch
    import torch.distributed as dist

    n, r = comm.world_size, comm.rank
    backends = ["pycoll"]
    if gloo_port:
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        addr = os.environ["MASTER_ADDR"]
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{gloo_port}", rank=r, world_size=n
        )
        backends.append("gloo")
    out = []
    for coll in colls:
        for k, size in enumerate(sizes):
            count = max(1, size // 4 // n) * n if coll != "all_reduce" else max(1, size // 4)
            full = torch.ones(count)
            part = torch.ones(count // n)
            for backend in backends if k % 2 == 0 else backends[::-1]:
                call, sync = _calls(backend, coll, comm, full, part)
                it = iters_for(size)
                call()
                reps = []
                for _ in range(3):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(it):
                        call()
                    reps.append((time.perf_counter() - t0) / it)
                out.append((backend, coll, count * 4, statistics.median(reps)))
    if gloo_port:
        dist.destroy_process_group()
    return out


def job_crossing(comm, sizes: list[int]) -> list[tuple]:
    """(size, seconds per all-reduce, bytes this rank sent to other hosts per
    all-reduce, path) for each size."""
    import torch

    out = []
    for size in sizes:
        x = torch.ones(size // 4)
        comm.all_reduce(x)
        it = iters_for(size)
        reps = []
        sent0 = comm.net_info()["bytes_sent"]
        for _ in range(3):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(it):
                comm.all_reduce(x)
            reps.append((time.perf_counter() - t0) / it)
        sent = (comm.net_info()["bytes_sent"] - sent0) / (3 * it)
        paths = comm.stats()["all_reduce"]["paths"]
        path = max(paths, key=lambda k: paths[k])
        out.append((size, statistics.median(reps), sent, path))
    return out


def sweep_table(rows: dict, sizes: list[int], backends: list[str], colls: list[str]) -> list[str]:
    """Time per call (us) and busbw (GB/s) per backend, and pycollectives' ratios
    of busbw (the inverse ratio of times) to each other backend."""
    ratios = [b for b in backends if b != "pycoll"]
    head = "| collective | size | " + " | ".join(f"{b} us" for b in backends) + " | "
    head += " | ".join(f"{b} GB/s" for b in backends)
    head += "".join(f" | pycoll / {b}" for b in ratios) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(backends) + len(ratios))]
    for coll in colls:
        for size in sizes:
            got = {b: rows.get((b, coll, size)) for b in backends}
            us = [f"{v[1] * 1e6:.1f}" if v else "-" for v in got.values()]
            bw = [f"{v[0]:.3g}" if v else "-" for v in got.values()]
            rat = [
                f"{got[b][1] / got['pycoll'][1]:.2f}" if got["pycoll"] and got[b] else "-"
                for b in ratios
            ]
            label = _doc.size_label(size)
            lines.append(f"| {coll} | {label} | " + " | ".join(us + bw + rat) + " |")
    return lines


def run_sweep(fabric, sizes: list[int], colls: list[str], mpi: bool) -> tuple[dict, list[str]]:
    port = _doc.free_port()
    res = run_on_hosts(fabric, [0, 1], job_sweep, colls, sizes, port + 1, timeout=1800)[0]
    rows = {(b, c, s): (busbw(c, s, 2, t), t) for b, c, s, t in res}
    backends = ["pycoll", "gloo"]
    if mpi:
        for c, s, t in mpi_runner.sweep(fabric, colls, sizes, iters_for):
            rows[("openmpi", c, s)] = (busbw(c, s, 2, t), t)
        backends.append("openmpi")
    return rows, backends


def crossing_table(fabric, sizes: list[int]) -> list[str]:
    lines = [
        "| size | algorithm | time (ms) | busbw GB/s | host 0 sent per all-reduce | 2S(h-1)/h | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, env in (("hierarchical", {}), ("flat ring", {"PYCOLL_ALGO": "ring"})):
        res = run_on_hosts(fabric, [0, 0, 1, 1], job_crossing, sizes, env=env, timeout=1800)
        for i, size in enumerate(sizes):
            t = res[0][i][1]
            host0 = res[0][i][2] + res[1][i][2]  # ranks 0 and 1 are host 0
            least = 2 * size * (2 - 1) / 2
            lines.append(
                f"| {_doc.size_label(size)} | {name} ({res[0][i][3]}) | {t * 1e3:.2f} | "
                f"{busbw('all_reduce', size, 4, t):.3f} | {host0 / 2**20:.2f} MiB | "
                f"{least / 2**20:.2f} MiB | {host0 / least:.2f} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-mpi", action="store_true", help="leave OpenMPI out")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a trial run)")
    args = ap.parse_args()
    if why := netns.unavailable():
        raise SystemExit(f"multihost benchmark: {why}")
    mpi = not args.no_mpi and mpi_runner.available()
    sizes = SIZES[::3] if args.quick else SIZES
    big = [1 << 20, 16 << 20, 64 << 20]
    tables = []
    with netns.Fabric(2) as fabric:
        rows, backends = run_sweep(fabric, sizes, COLLS, mpi)
        tables += ["### 2 hosts x 1 rank over veth", ""]
        tables += [*sweep_table(rows, sizes, backends, COLLS), ""]
        tables += ["### 2 hosts x 2 ranks: hierarchical against the flat ring", ""]
        tables += [*crossing_table(fabric, big), ""]
        shaping = [fabric.shape(h, "10gbit", "50us") for h in range(2)][0]
        print("\n".join(tables), flush=True)
        shaped = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
        rows, backends = run_sweep(fabric, shaped, ["all_reduce"], mpi)
        tables += [f"### Shaped ({shaping}) on each host's link: 2 hosts x 1 rank", ""]
        tables += sweep_table(rows, shaped, backends, ["all_reduce"])
        tables += ["", f"### Shaped ({shaping}): 2 hosts x 2 ranks", ""]
        tables += [*crossing_table(fabric, big[1:])]
    notes = [
        "Hosts: network namespaces on one machine, one veth pair each to a bridge; the "
        "machine is shared with other jobs (figures are medians of 3 repetitions)",
        "pycollectives: default settings (one TCP connection per direction and peer, "
        "kernel-tuned buffers); gloo: torch " + __import__("torch").__version__,
    ]
    if mpi:
        notes.append(f"OpenMPI {mpi_runner.version()}: mpirun --mca btl tcp,self (mpi_runner.py)")
    else:
        notes.append("OpenMPI: not run (mpirun not found, or --no-mpi)")
    _doc.emit_section(
        BEGIN,
        END,
        "Across hosts (TCP over veth)",
        "`sudo python benchmarks/multihost/multihost.py`",
        notes,
        tables,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
