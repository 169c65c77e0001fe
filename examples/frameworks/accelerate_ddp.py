"""Hugging Face accelerate with DDP on "pycoll".

accelerate refuses a backend name it does not know on CPU ("Your assigned backend pycoll is not
available, please use gloo"), but takes a process group that exists: initialize "pycoll" first,
then create Accelerator(cpu=True). Without cpu=True, on a machine without CUDA, accelerate
silently runs each rank alone (no DDP): the example checks that it did wrap the model.

python examples/frameworks/accelerate_ddp.py   # trains on 2 CPU ranks under gloo, then
                                               # pycoll, and checks both give the same bits
Needs `pip install accelerate`.
"""

import torch
import torch.distributed as dist
from _compare import main
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader, TensorDataset


def train(backend: str) -> torch.nn.Module:
    dist.init_process_group(backend)  # "pycoll"; env:// under torchrun
    accelerator = Accelerator(cpu=True)  # cpu=True: or DDP is skipped without CUDA
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert dist.get_backend() == backend and accelerator.num_processes == 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    torch.manual_seed(accelerator.process_index)  # DDP broadcasts rank 0's parameters
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(net, opt, DataLoader(data, batch_size=8))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for _ in range(2):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)  # gradients averaged over the ranks by pycoll
            opt.step()
            opt.zero_grad()
    with torch.inference_mode():
        losses = accelerator.gather(torch.nn.functional.mse_loss(model(x), data.tensors[1])[None])
    assert losses.shape == (2,) and torch.equal(losses[0], losses[1])
    return accelerator.unwrap_model(model)


if __name__ == "__main__":
    main(__file__, train)
