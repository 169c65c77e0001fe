"""Data-parallel training with strategies.DistributedDataParallel on pycollectives.

torchrun --nproc-per-node 2 examples/ddp_train.py

Each rank trains on its own slice of every batch; gradients are averaged in
shared-memory buckets whose all-reduces overlap backward. The script checks
that every rank ends with the same parameters.
"""

import sys

import torch
from torch import nn

import pycollectives as pc
from pycollectives.launcher import run_rank
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel


def main() -> None:
    comm = pc.init()
    torch.manual_seed(comm.rank)  # different initial weights: DDP broadcasts rank 0's
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.01)  # several small buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x = torch.randn(8 * comm.world_size, 32, generator=g)
        y = x.sum(dim=1, keepdim=True)
        mine = slice(comm.rank * 8, (comm.rank + 1) * 8)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[mine]), y[mine])
        loss.backward()  # returns with the gradients averaged over the ranks
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(comm.world_size * flat.numel())
    comm.all_gather(every, flat)
    same = all(torch.equal(c, flat) for c in every.view(comm.world_size, -1))
    # One write of the whole line, flushed: the ranks share the terminal.
    sys.stdout.write(
        f"rank {comm.rank}: loss {loss.item():.4f}, parameters identical on all ranks: {same}\n"
    )
    sys.stdout.flush()
    assert same
    comm.close()


if __name__ == "__main__":
    sys.exit(run_rank(main, "ddp_train.py"))
