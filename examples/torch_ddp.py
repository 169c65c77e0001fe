"""torch DDP on pycollectives: the only change from gloo is the backend string.

torchrun --nproc-per-node 2 examples/torch_ddp.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import pycollectives  # noqa: F401 - registers the "pycoll" backend


def main() -> None:
    dist.init_process_group("pycoll")  # or "cpu:pycoll,cuda:pycoll"
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(rank)  # DDP broadcasts rank 0's parameters at construction
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(20):
        x = torch.randn(32, 16, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()  # gradients are averaged over the ranks by pycollectives
        opt.step()
        opt.zero_grad()

    # Every rank holds the same parameters, bit for bit.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "parameters diverged"
    if rank == 0:
        print(f"pycoll: {world} ranks, final loss {loss.item():.4f}, parameters in sync")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
