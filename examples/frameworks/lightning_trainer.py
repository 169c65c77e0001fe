"""PyTorch Lightning's Trainer with DDP on "pycoll": DDPStrategy(process_group_backend="pycoll").

python examples/frameworks/lightning_trainer.py   # trains on 2 CPU ranks under gloo, then
                                                  # pycoll, and checks both give the same bits
train() is what a user writes; _compare.py runs it under torchrun once per backend. Validation
runs under torch.inference_mode(), with a synced log and an all_gather. Needs
`pip install lightning`.
"""

import os

import torch
import torch.distributed as dist
from _compare import main
from lightning import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Net(LightningModule):
    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: list, _: int) -> torch.Tensor:
        assert dist.get_backend() == self.backend and dist.get_world_size() == 2
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: list, _: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)  # an all_reduce under inference mode
        losses = self.all_gather(loss)  # and an all_gather
        assert losses.shape == (2,)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(backend: str) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    torch.manual_seed(int(os.environ["RANK"]))  # DDP broadcasts rank 0's parameters
    model = Net(backend)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend=backend),  # "pycoll" instead of "gloo"
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
    return model.net


if __name__ == "__main__":
    main(__file__, train)
