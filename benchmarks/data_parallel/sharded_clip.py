"""What the bitwise sharded clip_grad_norm_ costs: its time against the
per-shard partial sums it replaced (not bitwise), paired in the same ranks.

    python benchmarks/data_parallel/sharded_clip.py [--ranks 2] [--layers 8] [--d-model 512] [--vocab 8192]

A GPT under ZeroOptimizer stages 2 and 3 (AdamW), one backward, then rounds
of three clips (max_norm far above the norm: nothing is scaled), the order
rotating each round: the clip as it is (straddling parameters assembled on one
rank by batch_p2p), the same with the all-reduce route that device tensors
take (strategies/data_parallel/sharding/clip.py ASSEMBLE_ON_OWNER=False), and the former
clip (each shard's float32 norm, raised to p, summed, one all-reduce). Median
of rounds 3-12 of the slowest rank. Prints the rows; no file is written.
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

WAYS = ("bitwise, p2p", "bitwise, all-reduce", "partial sums")


def partial_sums(reducer: object, max_norm: float, p: float = 2.0) -> torch.Tensor:
    """The former clip: sum over shards of norm(shard)**p, all-reduced, **(1/p)."""
    from pycollectives import ReduceOp

    grads = reducer.grad_shards()
    local = sum(float(torch.linalg.vector_norm(g, p, dtype=torch.float32)) ** p for g in grads)
    t = torch.tensor([local], dtype=torch.float32)
    reducer.comm.all_reduce(t, ReduceOp.SUM)
    total = t[0] ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q: object) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import pycollectives as pc
    from pycollectives.strategies.data_parallel.sharding import clip
    from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
    from pycollectives.strategies.models.gpt import GPT, GPTConfig

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    comm = pc.init(rank=rank, world_size=world, store=store, prefix="clipcost")
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=64, n_layer=args.layers, n_head=8, d_model=args.d_model
    )
    out = {}
    for stage in (2, 3):
        model = GPT(cfg)
        nparams = sum(p.numel() for p in GPT(cfg).parameters())
        zero = ZeroOptimizer(model, torch.optim.AdamW, comm, stage=stage, lr=1e-4)
        x = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(rank))
        model(x, x).backward()
        g = zero.engine.grads
        flats = [f for u in zero.engine.units for f in u.trainable]
        straddling = sum(
            f.layout.slots[k].numel
            for f in flats
            for k in range(len(f.params))
            if len(f.layout.holders(k)) > 1
        )
        ts: dict[str, list[float]] = {w: [] for w in WAYS}
        for i in range(12):
            for way in WAYS[i % 3 :] + WAYS[: i % 3]:
                clip.ASSEMBLE_ON_OWNER = way != "bitwise, all-reduce"
                comm.barrier()
                t0 = time.perf_counter()
                if way == "partial sums":
                    partial_sums(g, 1e9)
                else:
                    g.clip_grad_norm_(1e9)
                ts[way].append(time.perf_counter() - t0)
        clip.ASSEMBLE_ON_OWNER = True
        out[stage] = (nparams, straddling, {w: v[2:] for w, v in ts.items()})
    q.put((rank, out))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
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
        f"torch {torch.__version__}; {args.ranks} ranks"
    )
    for stage, (nparams, straddling, _) in got[0].items():
        cells = []
        for w in WAYS:
            n = len(got[0][stage][2][w])
            slow = [max(got[r][stage][2][w][i] for r in got) for i in range(n)]
            cells.append(f"{w} {1e3 * statistics.median(slow):.1f} ms")
        print(
            f"ZeRO-{stage}, GPT {nparams / 1e6:.1f}M parameters, {straddling / 1e6:.2f}M in "
            "parameters that straddle shards: " + ", ".join(cells)
        )


if __name__ == "__main__":
    main()
