"""strategies.DDP with gradient_as_bucket_view=False (a bucket copy of the
gradients beside .grad) against True (.grad are views of the buckets): a
paired A/B of whole training steps, and the bytes each holds per rank.

    python benchmarks/data_parallel/ddp_bucket_view.py [--ranks 2] [--steps 20] [--batch 8] [--width 2048]

Each rank builds both wrappers over the same MLP (width-width-width-width-width,
float32) with AdamW, then runs the steps of the two interleaved (each round one
step of each, the order alternating), a step being optimizer.zero_grad() +
forward + backward (+ the averaged gradients) + optimizer.step(). Reports the
median step of the slowest rank for each, the median of the per-round ratios,
and the storage per rank by role after a step (each storage once), in bytes
per parameter. Prints the rows; no file is written.
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
from _doc import cpu_model, free_port  # noqa: E402

MODES = ("copy", "view")


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def storage(ddp: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes per role on this rank (each storage once), AdamW's step counters apart."""
    from pycollectives.strategies.data_parallel.sharding.engine import count_storage

    params = list(ddp.module.parameters())
    return count_storage(
        {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "buckets": [b.buffer for b in ddp.buckets.buckets],
            "optimizer": [t for st in opt.state.values() for k, t in st.items() if k != "step"],
        }
    )


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q: object) -> None:
    torch.set_num_threads(1)  # the ranks share the cores
    import torch.distributed as dist

    import pycollectives as pc
    from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    comm = pc.init(rank=rank, world_size=world, store=store, prefix="viewab")
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    runs = {}
    for mode in MODES:
        ddp = DistributedDataParallel(
            make_model(args.width), comm, gradient_as_bucket_view=mode == "view"
        )
        runs[mode] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.steps + 2):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            ddp, opt = runs[mode]
            comm.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            if i >= 2:
                times[mode].append(time.perf_counter() - t0)
    nparams = sum(p.numel() for p in runs["copy"][0].parameters())
    q.put((rank, nparams, times, {m: storage(*runs[m]) for m in MODES}))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()
    port = free_port()
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
    slow = {m: [max(g[2][m][i] for g in got) for i in range(args.steps)] for m in MODES}
    ratio = statistics.median(c / v for c, v in zip(slow["copy"], slow["view"], strict=True))
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}, "
        f"{cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}; {args.ranks} ranks, MLP {args.width} x 4 layers, "
        f"{nparams / 1e6:.1f}M parameters, batch {args.batch}, {args.steps} steps"
    )
    for m in MODES:
        st = max((g[3][m] for g in got), key=lambda s: sum(s.values()))
        per = {k: v / nparams for k, v in st.items()}
        roles = ", ".join(f"{k} {v:.1f}P" for k, v in per.items())
        print(
            f"gradient_as_bucket_view={m == 'view'}: step {1e3 * statistics.median(slow[m]):.1f} ms"
            f" (median), storage {sum(st.values()) / (1 << 20):.1f} MiB = "
            f"{sum(per.values()):.1f}P ({roles})"
        )
    print(f"step False / True, median of the paired ratios: {ratio:.2f}x")


if __name__ == "__main__":
    main()
