"""Does torch FSDP2 clip as torch DDP does? torch's own fully_shard against
torch's DistributedDataParallel, both over gloo, with
torch.nn.utils.clip_grad_norm_: the same tiny GPT, data and AdamW as
tests/strategies/data_parallel/test_zero.py's clipping test (3 micro-batches, no_sync on the first 2).

    python benchmarks/data_parallel/torch_fsdp2_clip.py [--ranks 2] [--steps 10] [--clip 0.05]

Prints the clipping coefficients, the per-step difference of FSDP2's total
norm from DDP's, and whether the parameters are bitwise equal after training
(a --clip far above the norms, e.g. 1e9, shows the same without a biting clip).
strategies' ZeRO and fully_shard are asserted bitwise equal to DDP in that test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
from _doc import free_port  # noqa: E402


def train(mode: str, rank: int, world: int, args: argparse.Namespace) -> tuple[list, dict]:
    """(total norms per step, full parameters by name) of `mode` ("ddp" or "fsdp2")."""
    from torch.distributed.fsdp import fully_shard
    from zero_common import CFG, OPT, local_batch

    from pycollectives.strategies.models.gpt import GPT

    class Ranks:  # what local_batch reads of a communicator
        pass

    who = Ranks()
    who.rank, who.world_size = rank, world  # type: ignore[attr-defined]
    model = GPT(CFG)
    if mode == "ddp":
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(wrapped.parameters(), **OPT)
    norms, micro = [], 3
    for step in range(args.steps):
        opt.zero_grad()
        for k in range(micro):
            x, y = local_batch(who, step * micro + k)
            last = k == micro - 1
            if mode == "fsdp2":
                wrapped.set_requires_gradient_sync(last)
            sync = wrapped.no_sync() if mode == "ddp" and not last else contextlib.nullcontext()
            with sync:
                (wrapped(x, y) / micro).backward()
        total = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), args.clip)
        norms.append(total.full_tensor() if hasattr(total, "full_tensor") else total.clone())
        opt.step()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return norms, params


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    (dn, dp), (fn, fp) = (train(m, rank, world, args) for m in ("ddp", "fsdp2"))
    if rank == 0:
        print(f"torch {torch.__version__}, {world} ranks, gloo, clip {args.clip}")
        print("coefficients", [round(float(args.clip / (n + 1e-6)), 4) for n in dn])
        print("FSDP2 norm - DDP norm", [float(a) - float(b) for a, b in zip(fn, dn, strict=True)])
        worst = max(float((fp[k] - dp[k]).abs().max()) for k in dp)
        same = all(torch.equal(fp[k], dp[k]) for k in dp)
        print(f"parameters bitwise equal: {same} (max |diff| {worst:.3g})")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--clip", type=float, default=0.05)
    args = ap.parse_args()
    mp.start_processes(
        worker, args=(args.ranks, free_port(), args), nprocs=args.ranks, start_method="spawn"
    )


if __name__ == "__main__":
    main()
