"""The cost of the authenticated TCP handshake (csrc/transport/tcp/tcp_auth.h: one
more round trip than the unauthenticated one, and two HMAC-SHA256 per side)
at set-up, as a paired A/B against another source tree built in place
(--old-tree: e.g. main before it, `git archive main | tar -x -C /tmp/main`
then `python setup.py build_ext --inplace` there), 2 hosts x 1 rank over veth
(tests/support/netns.py; root only):

- init: `pc.init` with a store the job keeps (rank 0 serves it), from a
  barrier to the slower rank's return (a control connection, the store's
  exchanges);
- split: `comm.split(0)` across both hosts (five all-gathers over the parent
  and the child's control connection), the slower rank's time;
- connect: the new child's first 4-byte all-reduce (which makes its data
  connections, one each way) less its second;
- MAC: one HMAC-SHA256 over a handshake's transcript (about 200 bytes),
  in-process through `_C.hmac_sha256` (the Python call included).

Each round runs both trees back to back in alternating order (a round's
figure: the median of --reps inits and splits); the table gives the medians
over rounds, their ratio and the median of the rounds' new - old. Writes its
section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))

import netns  # noqa: E402
from multihost_jobs import run_on_hosts  # noqa: E402

# (_doc imports pycollectives: main() imports it, so that the ranks, which
# import this script first, can take pycollectives from --old-tree.)
BEGIN, END = "<!-- handshake_cost:begin -->", "<!-- handshake_cost:end -->"


def job_costs(comm, port: int, reps: int) -> dict[str, list[float]]:
    """On every rank: `reps` inits (each under its own prefix of one store)
    and `reps` splits with their first two all-reduces; the slower rank's
    seconds for each."""
    import datetime

    import torch
    import torch.distributed as dist

    import pycollectives as pc

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        comm.all_reduce(t, pc.ReduceOp.MAX)
        return float(t[0])

    r, n = comm.rank, comm.world_size
    store = dist.TCPStore(netns.addr(0), port, n, r == 0, datetime.timedelta(seconds=60))
    out: dict[str, list[float]] = {"init": [], "split": [], "connect": []}
    for i in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        c2 = pc.init(rank=r, world_size=n, store=store, timeout=60, prefix=f"hs{i}")
        out["init"].append(slowest(time.perf_counter() - t0))
        c2.close()
    x = torch.ones(1)
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        sub = comm.split(0)
        t1 = time.perf_counter()
        sub.all_reduce(x)
        t2 = time.perf_counter()
        sub.all_reduce(x)
        t3 = time.perf_counter()
        out["split"].append(slowest(t1 - t0))
        out["connect"].append(slowest((t2 - t1) - (t3 - t2)))
        sub.close()
    comm.barrier()
    return out


def mac_us() -> float:
    """Microseconds per HMAC-SHA256 of 200 bytes with a 32-byte key, through
    the Python binding (this tree's)."""
    from pycollectives import _C

    key, data = bytes(range(32)), bytes(200)
    n = 20000
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            _C.hmac_sha256(key, data)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", required=True, help="the baseline source tree, built in place")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="inits and splits per rank per round")
    ap.add_argument("--what", default="", help="what the new side changes (for the notes)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import _doc

    if netns.unavailable():
        sys.exit(f"handshake_cost: {netns.unavailable()}")
    res: dict[tuple[str, str], list[float]] = {}
    with netns.Fabric(2) as fabric:
        for rnd in range(args.rounds):
            for side in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                tree = args.old_tree if side == "old" else None
                got = run_on_hosts(fabric, [0, 1], job_costs, _doc.free_port(), args.reps,
                                   timeout=300, tree=tree)[0]  # fmt: skip
                for what, values in got.items():
                    res.setdefault((what, side), []).append(statistics.median(values))
                print(
                    rnd, side, {k: f"{statistics.median(v) * 1e3:.2f} ms" for k, v in got.items()}
                )
    rows = [
        "| step | old ms | new ms | new / old | new - old ms (median over rounds) |",
        "|---|---|---|---|---|",
    ]
    for what in ("init", "split", "connect"):
        old, new = res[(what, "old")], res[(what, "new")]
        o, n = statistics.median(old), statistics.median(new)
        diff = statistics.median(b - a for a, b in zip(old, new, strict=True))
        rows.append(f"| {what} | {o * 1e3:.2f} | {n * 1e3:.2f} | {n / o:.2f} | {diff * 1e3:+.2f} |")
    notes = [
        "Hosts: network namespaces on one machine, one veth pair each to a bridge; the machine is "
        "shared with other jobs",
        f"{args.rounds} rounds, each running both trees back to back (order alternating); a "
        f"round's figure is the median of {args.reps} inits and {args.reps} splits, each the "
        "slower rank's time",
        f"Old: {args.old_tree}; new: this tree" + (f" ({args.what})" if args.what else ""),
        f"One HMAC-SHA256 of 200 bytes (this tree's, through the Python call): {mac_us():.2f} us",
    ]
    _doc.emit_section(
        BEGIN,
        END,
        "Across hosts: the cost of the authenticated handshake (2 hosts x 1 rank)",
        "`sudo python benchmarks/multihost/handshake_cost.py " + shlex.join(sys.argv[1:]) + "`",
        notes,
        rows,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
