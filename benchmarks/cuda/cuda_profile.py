"""Where the time of a CUDA collective goes, ranks sharing one GPU: kernels,
or the host around them.

    python benchmarks/cuda/cuda_profile.py [--ranks 2] [--sizes 8,64M,256M] [--iters 20]
                                      [--trace-dir DIR] [--json FILE]

For each collective (all-reduce, reduce-scatter, all-gather) and size S (the
all-reduce's buffer, the reduce-scatter's input, the all-gather's output;
float32), every rank makes, after warm-up:

- `sync`: --iters synchronous calls, each timed alone on the host (the call
  returns once every kernel of it has completed on every rank);
- `async+wait`: the same calls with async_op=True, each waited for at once:
  the progress engine's thread runs the operation and the caller waits for it
  (two thread hand-offs per call; every CUDA call went this way before
  synchronous ones ran on the caller's thread);
- `profile`: --iters synchronous calls under torch.profiler on rank 0 (the rank
  that launches every kernel when the ranks share one GPU): the kernels' GPU
  time per call (CUPTI) and the host time of each CUDA API call.

It prints per row the median wall time of a call (slowest rank), the kernels'
time, the rest (wall - kernels: launch, flags between the ranks, the host
polling the kernels' completion, Python), the roofline (the fewest bytes each
rank must read and write, times the ranks, over the device-to-device copy
bandwidth measured in the same run: cuda_collectives.py's traffic() and
copy_bandwidth()) and
rank 0's costliest CUDA API calls. Without a CUDA device it says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
import _ranks  # noqa: E402
from cuda_collectives import copy_bandwidth, traffic  # noqa: E402

COLLS = ("all_reduce", "reduce_scatter", "all_gather")


def parse_size(s: str) -> int:
    """'8' -> 8, '64K' -> 65536, '256M' -> 268435456, '1G' -> 1 << 30 (bytes)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def _trace_summary(path: str, calls: int) -> dict:
    """Kernel time per call and the host time of each CUDA API call (per call),
    read from a torch.profiler chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernel_us, api = 0.0, {}
    for e in events:
        cat, dur = e.get("cat", ""), float(e.get("dur", 0) or 0)
        if cat == "kernel":
            kernel_us += dur
        elif cat in ("cuda_runtime", "cuda_driver"):
            name = e.get("name", "?")
            api[name] = api.get(name, 0.0) + dur
    top = sorted(api.items(), key=lambda kv: -kv[1])[:6]
    return {
        "kernel_us": kernel_us / calls,
        "api_us": {k: round(v / calls, 2) for k, v in top},
    }


def _measure(comm, coll: str, size: int, rank: int, world: int, args: argparse.Namespace) -> dict:
    """One row: this rank's sync and async+wait times, and rank 0's profile."""
    import torch

    numel = max(world, size // 4)
    numel -= numel % world
    big = torch.randn(numel, device="cuda")
    small = torch.empty(numel // world, device="cuda")

    def call(async_op: bool = False):
        if coll == "all_reduce":
            return comm.all_reduce(big, async_op=async_op)
        if coll == "reduce_scatter":
            return comm.reduce_scatter(small, big, async_op=async_op)
        return comm.all_gather(big, small, async_op=async_op)

    def timed(fn) -> list[float]:
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        comm.barrier()
        out = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    sync = timed(call)
    async_wait = timed(lambda: call(True).wait())
    trace = None
    comm.barrier()
    if rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                call()
            torch.cuda.synchronize()
        trace = os.path.join(args.trace_dir, f"trace_{coll}_{size}.json")
        prof.export_chrome_trace(trace)
    else:
        for _ in range(args.iters):
            call()
    comm.barrier()
    return {
        "coll": coll,
        "size": size,
        "sync_s": sync,
        "async_wait_s": async_wait,
        "profile": _trace_summary(trace, args.iters) if trace else None,
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    import pycollectives as pc

    torch.cuda.set_device(0)
    store = dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    comm = pc.init(rank=rank, world_size=world, store=store, timeout=120)
    rows = []
    for coll in args.colls:
        for size in args.sizes:
            rows.append(_measure(comm, coll, size, rank, world, args))
            torch.cuda.empty_cache()
    comm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="8,64M,256M")
    ap.add_argument("--colls", default=",".join(COLLS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trace-dir", default="/tmp", help="where rank 0's profiler traces go")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.colls = args.colls.split(",")
    import torch

    if not torch.cuda.is_available():
        print("cuda_profile.py: no CUDA device", file=sys.stderr)
        return 2
    import pycollectives

    bw = copy_bandwidth()
    per_rank = _ranks.run(_rank, args.ranks, args, timeout=args.timeout)
    print(
        f"# {torch.cuda.get_device_name(0)}, {args.ranks} ranks on one GPU, pycollectives from "
        f"{Path(pycollectives.__file__).parent}, copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    print(
        "| coll | size | sync us | async+wait us | kernels us | rest us | roofline us | % roofline | rank 0 CUDA API us per call |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    out = []
    for i, row in enumerate(per_rank[0]):
        # a call's time: the slowest rank's, per call; then the median over calls
        sync = statistics.median(
            max(r[i]["sync_s"][k] for r in per_rank) for k in range(args.iters)
        )
        aw = statistics.median(
            max(r[i]["async_wait_s"][k] for r in per_rank) for k in range(args.iters)
        )
        prof = row["profile"] or {}
        kern = prof.get("kernel_us", float("nan"))
        roof = args.ranks * traffic(row["coll"], row["size"], args.ranks) / bw
        api = ", ".join(f"{k} {v}" for k, v in prof.get("api_us", {}).items())
        print(
            f"| {row['coll']} | {row['size']} | {sync * 1e6:.1f} | {aw * 1e6:.1f} | {kern:.1f} | "
            f"{sync * 1e6 - kern:.1f} | {roof * 1e6:.1f} | {100 * roof / sync:.0f} | {api} |"
        )
        out.append(
            {
                **{k: row[k] for k in ("coll", "size")},
                "sync_us": sync * 1e6,
                "async_wait_us": aw * 1e6,
                "kernel_us": kern,
                "roofline_us": roof * 1e6,
                "api_us": prof.get("api_us"),
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
