"""Time to recover from a lost rank, on one host or across hosts: detect, agree, shrink.

    python benchmarks/collectives/recovery.py [--ranks 4 8] [--repeats 3] [--size 1M]
                                              [--hosts 2] [--kill rank|host]

Per run: --ranks processes all-reduce --size bytes (float32) in a loop; the last rank
records the wall clock and SIGKILLs itself. Each survivor times from that instant to
the PeerFailure its all-reduce raises (detect), then comm.agree(True) (agree) and
comm.shrink() (shrink), and checks an all-reduce on the new communicator. Prints, per
world size, the medians over --repeats runs of the slowest survivor's times, and the
median time of an agree() on a healthy communicator (what ElasticDataParallel adds to
every step). Writes nothing.

With --hosts H (root only: network namespaces, tests/support/netns.py), the ranks sit
on H namespaced hosts, ranks/H each (shared memory within a host, TCP between), the
communicator made by pc.init on a TCPStore that rank 0 serves on host 0, through
which agree and shrink go (docs/recovery.md); --kill host kills every rank of the
last host at once instead of the last rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
sys.path.insert(0, str(ROOT / "tests" / "support"))
import netns  # noqa: E402
from _doc import free_port  # noqa: E402


def rank_main(
    rank: int, n: int, port: int, nbytes: int, killed_at, out, hosts: list[str], victims: list[int]
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    if hosts:  # rank r on host r * H // n; rank 0 serves the store on host 0
        netns.enter(hosts[rank * len(hosts) // n])
        os.environ["MASTER_ADDR"] = netns.addr(0)
    import pycollectives as pc

    if hosts:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore(netns.addr(0), port, n, rank == 0, datetime.timedelta(seconds=60))
        comm = pc.init(rank, n, store=store, timeout=60)
    else:
        comm = pc.init(timeout=60)
    healthy = []
    for _ in range(50):
        start = time.perf_counter()
        comm.agree(True)
        healthy.append(time.perf_counter() - start)
    comm.barrier()
    if rank in victims:

        def die() -> None:
            killed_at.value = time.time()
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.3, die).start()
    t = torch.ones(nbytes // 4)
    try:
        while True:
            comm.all_reduce(t)
    except pc.PyCollectivesError:  # PeerFailure, or the abort another host passed on
        detected = time.time()
    t0 = time.perf_counter()
    comm.agree(True)
    t1 = time.perf_counter()
    new = comm.shrink()
    t2 = time.perf_counter()
    check = torch.ones(4)
    new.all_reduce(check)
    assert new.world_size == n - len(victims) and check[0].item() == n - len(victims)
    comm.close()
    new.close()
    out.put((rank, detected, t1 - t0, t2 - t1, statistics.median(healthy)))


def run(n: int, nbytes: int, hosts: list[str], victims: list[int]) -> tuple[float, ...]:
    """One run: the slowest survivor's (detect, agree, shrink, healthy agree) in seconds."""
    ctx = mp.get_context("spawn")
    out, port, killed_at = ctx.Queue(), free_port(), ctx.Value("d", 0.0)
    args = (port, nbytes, killed_at, out, hosts, victims)
    procs = [ctx.Process(target=rank_main, args=(r, n, *args)) for r in range(n)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in range(n - len(victims))]
    for p in procs:
        p.join(timeout=60)
    return (
        max(g[1] for g in got) - killed_at.value,
        max(g[2] for g in got),
        max(g[3] for g in got),
        max(g[4] for g in got),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="1M", help="bytes per all-reduce (K/M suffixes)")
    ap.add_argument("--hosts", type=int, default=1, help="namespaced hosts (root only)")
    ap.add_argument("--kill", choices=["rank", "host"], default="rank")
    args = ap.parse_args()
    from pycollectives.bench.specs import parse_size

    nbytes = parse_size(args.size)
    if args.hosts > 1 and netns.unavailable():
        sys.exit(f"recovery: --hosts: {netns.unavailable()}")
    print(f"load before: {os.getloadavg()[0]:.1f}")
    print(
        "| ranks | hosts | killed | detect (ms) | agree (ms) | shrink (ms) | agree, healthy (us) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.ranks:
        per_host = n // args.hosts
        victims = list(range(n - per_host, n)) if args.kill == "host" else [n - 1]
        runs = []
        for _ in range(args.repeats):
            if args.hosts > 1:
                with netns.Fabric(args.hosts) as fabric:
                    runs.append(run(n, nbytes, fabric.hosts, victims))
            else:
                runs.append(run(n, nbytes, [], victims))
        med = [statistics.median(r[i] for r in runs) for i in range(4)]
        print(
            f"| {n} | {args.hosts} | {len(victims)} | {1e3 * med[0]:.0f} | {1e3 * med[1]:.1f} "
            f"| {1e3 * med[2]:.1f} | {1e6 * med[3]:.0f} |"
        )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
