"""What host staging costs: CUDA tensors across hosts go through pinned host
buffers (pycollectives/_staging.py). Two ranks on one GPU made two "hosts"
with PYCOLL_HOST_ID (TCP over loopback between them); for each size, every
rank measures (medians over --iters calls, after warm-up):

- copy: the copy to the pinned buffer and back (device-to-host, then
  host-to-device, on the current stream, CUDA events), as staging does;
- cpu: the same all-reduce on a CPU tensor across the two hosts;
- staged: all_reduce of the CUDA tensor (copy in, CPU all-reduce, copy back;
  timed to the end of the copy back, torch.cuda.synchronize);
and the share of the staged time the copies take. Rewrites its section of
docs/benchmarks.md (between the cuda_staging markers).

    python benchmarks/cuda/cuda_staging.py [--sizes-mib 1,16,128] [--iters 10] [--json FILE]

Without a CUDA device it says so and exits 0 (nothing measured, nothing written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import cpu_model, free_port, size_label, write_section

BEGIN, END = "<!-- cuda_staging:begin -->", "<!-- cuda_staging:end -->"
ROOT = Path(__file__).resolve().parents[2]


def _median_ms(fn, iters: int) -> float:
    import torch

    fn()
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rank(rank: int, port: int, sizes: list[int], iters: int, out: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        PYCOLL_HOST_ID=f"staging-bench-host-{rank}",
    )
    sys.path.insert(0, str(ROOT))
    import torch

    import pycollectives as pc

    torch.cuda.set_device(0)
    comm = pc.init(timeout=120)
    rows = []
    try:
        for nbytes in sizes:
            n = nbytes // 4
            dev = torch.ones(n, device="cuda")
            host = torch.empty(n, pin_memory=True)
            cpu = torch.ones(n)

            def copies(dev=dev, host=host):
                host.copy_(dev, non_blocking=True)
                dev.copy_(host, non_blocking=True)

            def cpu_all_reduce(cpu=cpu):
                comm.all_reduce(cpu)

            def staged(dev=dev):
                comm.all_reduce(dev)

            comm.barrier()
            copy_ms = _median_ms(copies, iters)
            comm.barrier()
            cpu_ms = _median_ms(cpu_all_reduce, iters)
            comm.barrier()
            staged_ms = _median_ms(staged, iters)
            rows.append(
                {"bytes": nbytes, "copy_ms": copy_ms, "cpu_ms": cpu_ms, "staged_ms": staged_ms}
            )
        pinned = comm._stager.cache.allocated if comm._stager else 0
        out.put((rank, rows, pinned))
    finally:
        comm.close()


def render(data: dict) -> str:
    lines = [
        BEGIN,
        "## Host staging of CUDA tensors across hosts",
        "",
        f"- Command: `{data['command']}`",
        f"- Machine: {data['gpu']}; {data['cpu']}; torch {data['torch']}; Python {data['python']}",
        f"- Date: {data['date']}",
        "- Two ranks on one GPU made two hosts with PYCOLL_HOST_ID (TCP over loopback); rank 0's "
        f"medians over {data['iters']} calls; pinned buffers allocated by the stager in all: "
        f"{data['pinned']}",
        "",
        "| size | copy in + back ms | CPU all-reduce ms | staged CUDA all-reduce ms | copies / staged |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        share = r["copy_ms"] / r["staged_ms"] if r["staged_ms"] else float("nan")
        lines.append(
            f"| {size_label(r['bytes'])} | {r['copy_ms']:.3f} | {r['cpu_ms']:.3f} | "
            f"{r['staged_ms']:.3f} | {share:.2f} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1,16,128")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cuda_staging: skipped: no CUDA device (nothing measured, nothing written)")
        return 0
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, args.iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (rows, pinned)) for r, rows, pinned in (out.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(60)
    if any(p.exitcode != 0 for p in procs):
        print(f"cuda_staging: a rank failed: exit codes {[p.exitcode for p in procs]}")
        return 1
    rows, pinned = results[0]
    data = {
        "command": "python benchmarks/cuda/cuda_staging.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0),
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "iters": args.iters,
        "pinned": pinned,
        "rows": rows,
    }
    section = render(data)
    print(section)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    if not args.no_write:
        write_section(section, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
