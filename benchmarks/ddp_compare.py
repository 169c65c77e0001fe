"""strategies.DistributedDataParallel against torch's DistributedDataParallel
over gloo, same model and batch, in one run; plus the overlap report.

    python benchmarks/ddp_compare.py [--ranks 2] [--steps 12] [--batch 8] [--out docs/benchmarks.md]

Every rank runs, on one model of about 50M float32 parameters (an MLP
2048-4096-4096-4096-2048), in this order:
  compute    forward + backward with no communication (strategies.DDP no_sync)
  comm       the all-reduce of every bucket alone (what one step communicates)
  ours       strategies.DDP, buckets launched as their gradients become ready
  ours-noov  strategies.DDP with overlap=False (all-reduces after backward)
  ours-view  strategies.DDP with gradient_as_bucket_view=True (no copies)
  torch      torch.nn.parallel.DistributedDataParallel over gloo
each step = zero_grad + forward + backward (+ the wait for the gradients);
the optimizer step is left out (identical for all). Times are medians over
steps of the slowest rank. Exposed communication = (step - compute) / comm.
Rewrites the section of docs/benchmarks.md between the ddp markers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BEGIN, END = "<!-- ddp:begin -->", "<!-- ddp:end -->"
WIDTHS = [2048, 4096, 4096, 4096, 2048]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def timed_steps(model: nn.Module, x: torch.Tensor, steps: int, sync: object) -> list[float]:
    """Per-step seconds (after 2 warm-up steps); `sync` is a barrier callable."""
    out = []
    for i in range(steps + 2):
        sync()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        dt = time.perf_counter() - t0
        if i >= 2:
            out.append(dt)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the cores
    import torch.distributed as dist

    import pycollectives as pc
    from strategies.ddp import DistributedDataParallel as OurDDP

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    comm = pc.init(rank=rank, world_size=world, store=store, prefix="ddpbench")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world
    )
    x = torch.randn(args.batch, WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    res: dict[str, list[float]] = {}

    def barrier() -> None:
        comm.barrier()

    ddp = OurDDP(make_model(), comm)
    nparams = sum(p.numel() for p in ddp.parameters())
    with ddp.no_sync():
        res["compute"] = timed_steps(ddp, x, args.steps, barrier)
    ts = []
    for i in range(args.steps + 2):
        barrier()
        t0 = time.perf_counter()
        works = [ddp.buckets.all_reduce(b) for b in range(len(ddp.buckets))]
        for w in works:
            w.wait()
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    res["comm"] = ts
    res["ours"] = timed_steps(ddp, x, args.steps, barrier)
    del ddp
    res["ours-noov"] = timed_steps(
        OurDDP(make_model(), comm, overlap=False), x, args.steps, barrier
    )
    res["ours-view"] = timed_steps(
        OurDDP(make_model(), comm, gradient_as_bucket_view=True), x, args.steps, barrier
    )
    tddp = nn.parallel.DistributedDataParallel(make_model())
    res["torch"] = timed_steps(tddp, x, args.steps, barrier)
    ts = []  # gloo's all-reduce of the same bytes, in torch DDP's 25 MiB buckets
    flat = [torch.zeros(25 << 18) for _ in range((nparams * 4 + (25 << 20) - 1) // (25 << 20))]
    for i in range(args.steps + 2):
        barrier()
        t0 = time.perf_counter()
        for w in [dist.all_reduce(f, async_op=True) for f in flat]:
            w.wait()
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    res["torch-comm"] = ts
    q.put((rank, nparams, res))
    dist.destroy_process_group()
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md")
    )
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    nparams = got[0][1]
    runs = [r[2] for r in got]
    med = {
        k: statistics.median(max(r[k][i] for r in runs) for i in range(len(runs[0][k])))
        for k in runs[0]
    }
    ms = {k: v * 1e3 for k, v in med.items()}
    for k, v in ms.items():
        print(f"{k:>11}: {v:8.1f} ms")

    def exposed(k: str) -> str:
        return f"{(ms[k] - ms['compute']) / ms['comm']:.2f}"

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")),
        platform.processor(),
    )
    mib = nparams * 4 / (1 << 20)
    body = [
        BEGIN,
        "## DDP: strategies.DistributedDataParallel vs torch DDP over gloo",
        "",
        f"- Command: `python benchmarks/ddp_compare.py --ranks {args.ranks} --steps {args.steps} "
        f"--batch {args.batch}`",
        f"- Machine: {cpu}, {os.cpu_count()} cores, {args.ranks} ranks with one compute thread each",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- Model: MLP {'-'.join(map(str, WIDTHS))}, {nparams / 1e6:.1f}M float32 parameters "
        f"({mib:.0f} MiB of gradients), batch {args.batch} per rank; torch {torch.__version__}",
        "- Step = zero_grad + forward + backward + waiting for averaged gradients; median over "
        f"{args.steps} steps of the slowest rank",
        "",
        "| configuration | step (ms) | vs torch DDP/gloo | exposed comm |",
        "|---|---:|---:|---:|",
    ]
    for k, label in [
        ("ours", "strategies.DDP (overlap, 25 MiB buckets)"),
        ("ours-view", "strategies.DDP, gradient_as_bucket_view"),
        ("ours-noov", "strategies.DDP, all-reduce after backward"),
        ("torch", "torch DDP over gloo"),
    ]:
        body.append(f"| {label} | {ms[k]:.1f} | {ms['torch'] / ms[k]:.2f}x | {exposed(k)} |")
    body += [
        f"| backward alone (no communication) | {ms['compute']:.1f} | | |",
        f"| all-reduce of every bucket alone, pycollectives | {ms['comm']:.1f} | | |",
        f"| all-reduce of the same bytes alone, gloo | {ms['torch-comm']:.1f} | | |",
        "",
        "Exposed communication = (step - backward alone) / pycollectives' communication alone: "
        "0 is perfect overlap, 1 none.",
        END,
    ]
    out = Path(args.out)
    text = out.read_text() if out.exists() else "# Benchmarks\n\n"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + "\n".join(body) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + "\n".join(body) + "\n"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
