"""Lightning Fabric with DDP on "pycoll": Fabric(strategy=DDPStrategy(process_group_backend="pycoll")).

python examples/frameworks/lightning_fabric.py   # trains on 2 CPU ranks under gloo, then
                                                 # pycoll, and checks both give the same bits
Needs `pip install lightning`.
"""

import torch
import torch.distributed as dist
from _compare import main
from lightning import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


def train(backend: str) -> torch.nn.Module:
    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend)
    )
    fabric.launch()
    assert dist.get_backend() == backend and fabric.world_size == 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    torch.manual_seed(fabric.global_rank)  # DDP broadcasts rank 0's parameters
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))  # a DistributedSampler
    for _ in range(2):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            fabric.backward(loss)  # gradients averaged over the ranks by pycoll
            opt.step()
            opt.zero_grad()
    with torch.inference_mode():  # evaluation: collectives on inference tensors
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        mean = fabric.all_reduce(loss, reduce_op="mean")
        both = fabric.all_gather(loss)
    assert torch.equal(mean, loss) and torch.equal(both, loss.expand(2))  # same model, same data
    return net


if __name__ == "__main__":
    main(__file__, train)
