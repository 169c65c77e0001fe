"""strategies.DistributedDataParallel against torch's DistributedDataParallel
over gloo, same model and batch, in one run; plus the overlap report.

    python benchmarks/data_parallel/ddp_compare.py [--ranks 2] [--steps 12] [--batch 8] [--out docs/benchmarks.md]

Two models of about 50M float32 parameters: an MLP 2048-4096-4096-4096-2048
(memory-bound compute: its backward streams the weights three times) and an
embedding-heavy model (a 51M-parameter EmbeddingBag with dense gradients and a
small MLP: little compute per gradient byte, communication dominates). Every
rank runs, on each, in this order:
  compute    forward + backward with no communication (strategies.DDP no_sync)
  comm       the all-reduce of every bucket alone (what one step communicates)
  ours       strategies.DDP with gradient_as_bucket_view=False (gradients copied into
             their buckets and back), buckets launched as their gradients become ready
  ours-noov  the same with overlap=False (all-reduces after backward)
  ours-view  strategies.DDP with gradient_as_bucket_view=True (its default: no copies)
  ours-view-noov  the same with overlap=False
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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import cpu_model, free_port, write_section  # noqa: E402

BEGIN, END = "<!-- ddp:begin -->", "<!-- ddp:end -->"
WIDTHS = [2048, 4096, 4096, 4096, 2048]
EMB_ROWS = 400_000


class EmbeddingModel(nn.Module):
    """A recommender-style model: a 51M-parameter embedding table (dense
    gradients) and a small MLP. Little compute per gradient byte: the regime
    where communication dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(EMB_ROWS, 128, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "embedding":
        return EmbeddingModel()
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_input(kind: str, batch: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if kind == "embedding":
        return torch.randint(0, EMB_ROWS, (batch, 32), generator=g)
    return torch.randn(batch, WIDTHS[0], generator=g)


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


def worker(
    rank: int, world: int, port: int, kind: str, args: argparse.Namespace, q: object
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the cores
    import torch.distributed as dist

    import pycollectives as pc
    from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel as OurDDP

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    comm = pc.init(rank=rank, world_size=world, store=store, prefix="ddpbench")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world
    )
    x = make_input(kind, args.batch, rank)
    res: dict[str, list[float]] = {}

    def barrier() -> None:
        comm.barrier()

    ddp = OurDDP(make_model(kind), comm, gradient_as_bucket_view=False)
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
        OurDDP(make_model(kind), comm, gradient_as_bucket_view=False, overlap=False),
        x,
        args.steps,
        barrier,
    )
    res["ours-view"] = timed_steps(
        OurDDP(make_model(kind), comm, gradient_as_bucket_view=True), x, args.steps, barrier
    )
    res["ours-view-noov"] = timed_steps(
        OurDDP(make_model(kind), comm, gradient_as_bucket_view=True, overlap=False),
        x,
        args.steps,
        barrier,
    )
    tddp = nn.parallel.DistributedDataParallel(make_model(kind))
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


def run_model(kind: str, args: argparse.Namespace) -> tuple[int, dict[str, float]]:
    """Runs every configuration on `args.ranks` fresh ranks; returns the
    parameter count and the median step time (ms) of each."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.ranks, port, kind, args, q))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    runs = [r[2] for r in got]
    ms = {
        k: 1e3 * statistics.median(max(r[k][i] for r in runs) for i in range(len(runs[0][k])))
        for k in runs[0]
    }
    for k, v in ms.items():
        print(f"{kind} {k:>14}: {v:8.1f} ms")
    return got[0][1], ms


def table(kind: str, nparams: int, ms: dict[str, float], batch: int) -> list[str]:
    def exposed(k: str) -> str:
        return f"{(ms[k] - ms['compute']) / ms['comm']:.2f}"

    what = (
        f"MLP {'-'.join(map(str, WIDTHS))}, batch {batch} x {WIDTHS[0]} per rank"
        if kind == "mlp"
        else f"EmbeddingBag {EMB_ROWS} x 128 + MLP 128-256-128, batch {batch} bags of 32 ids"
    )
    rows = [
        f"### {kind}: {what}; {nparams / 1e6:.1f}M float32 parameters "
        f"({nparams * 4 / (1 << 20):.0f} MiB of gradients)",
        "",
        "| configuration | step (ms) | torch DDP step / this step | exposed comm |",
        "|---|---:|---:|---:|",
    ]
    for k, label in [
        ("ours", "strategies.DDP, gradient_as_bucket_view=False (overlap, 25 MiB buckets)"),
        ("ours-noov", "strategies.DDP, gradient_as_bucket_view=False, all-reduce after backward"),
        ("ours-view", "strategies.DDP, gradient_as_bucket_view"),
        ("ours-view-noov", "strategies.DDP, gradient_as_bucket_view, all-reduce after backward"),
        ("torch", "torch DDP over gloo (default options)"),
    ]:
        rows.append(f"| {label} | {ms[k]:.1f} | {ms['torch'] / ms[k]:.2f}x | {exposed(k)} |")
    rows += [
        f"| backward alone (no communication) | {ms['compute']:.1f} | | |",
        f"| all-reduce of every bucket alone, pycollectives | {ms['comm']:.1f} | | |",
        f"| all-reduce of the same bytes alone, gloo | {ms['torch-comm']:.1f} | | |",
        "",
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--models", default="mlp,embedding")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md")
    )
    args = ap.parse_args()
    cpu = cpu_model()
    body = [
        BEGIN,
        "## DDP: strategies.DistributedDataParallel vs torch DDP over gloo",
        "",
        f"- Command: `python benchmarks/data_parallel/ddp_compare.py --ranks {args.ranks} --steps {args.steps} "
        f"--batch {args.batch} --models {args.models}`",
        f"- Machine: {cpu}, {os.cpu_count()} cores, {args.ranks} ranks with one compute thread each",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}; torch {torch.__version__}",
        "- Step = zero_grad + forward + backward + waiting for the averaged gradients (the "
        f"optimizer step, identical for all, is left out); median over {args.steps} steps of the "
        "slowest rank. Exposed communication = (step - backward alone) / pycollectives' "
        "communication alone: 0 is perfect overlap, 1 none.",
        "",
    ]
    for kind in args.models.split(","):
        nparams, ms = run_model(kind, args)
        body += table(kind, nparams, ms, args.batch)
    body.append(END)
    out = Path(args.out)
    write_section("\n".join(body), BEGIN, END, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
