"""Hugging Face transformers' Trainer with DDP on "pycoll".

TrainingArguments(ddp_backend="pycoll") raises accelerate's "Your assigned backend pycoll is not
available, please use gloo" on CPU. What works: initialize the "pycoll" process group first, then
create TrainingArguments(use_cpu=True); the Trainer finds the group and wraps the model in DDP.
Without use_cpu=True, on a machine without CUDA, each rank trains alone (no DDP; one warning
line): the example checks that the Trainer did wrap the model.

python examples/frameworks/transformers_trainer.py   # trains on 2 CPU ranks under gloo, then
                                                     # pycoll, and checks both give the same bits
Needs `pip install transformers accelerate`.
"""

import tempfile

import torch
import torch.distributed as dist
from _compare import main
from transformers import Trainer, TrainerCallback, TrainingArguments


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.x[i].sum(0, keepdim=True).sin()}


class CheckDDP(TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kw):  # noqa: ANN001, ANN201
        assert dist.get_backend() == self.backend and dist.get_world_size() == 2
        assert isinstance(self.trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)


def train(backend: str) -> torch.nn.Module:
    dist.init_process_group(backend)  # "pycoll"; env:// under torchrun
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,  # or DDP is skipped without CUDA
            per_device_train_batch_size=8,
            num_train_epochs=2,
            learning_rate=0.1,
            optim="sgd",
            lr_scheduler_type="constant",
            seed=0,
            remove_unused_columns=False,
            ddp_find_unused_parameters=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        torch.manual_seed(dist.get_rank())  # DDP broadcasts rank 0's parameters
        model = Net()
        check = CheckDDP()
        check.backend = backend
        trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[check])
        check.trainer = trainer
        trainer.train()
    return model


if __name__ == "__main__":
    main(__file__, train)
