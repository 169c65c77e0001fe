"""Data-parallel training that goes on when a rank dies (one host; docs/recovery.md).

Every step ends in a fault-tolerant agreement (Communicator.agree, as torchft's
should_commit): the optimizer steps only where every rank's backward (its
bucket all-reduces) succeeded and no rank failed, so the step in which a rank
died is dropped on every survivor alike. The survivors then shrink the
communicator and wrap the model again on it: the next steps average the
gradients over the new size. The caller retries the dropped step's batch,
re-split over the survivors (its batch function takes the current rank and
world size), so the run equals one that had the surviving layout from that
step on.

    model = ElasticDataParallel(module, comm)
    step = 0
    while step < steps:
        if model.step(lambda ddp, rank, size: loss_of(ddp, batch(step, rank, size)), optimizer):
            step += 1
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator, PyCollectivesError

from .ddp import DistributedDataParallel

__all__ = ["ElasticDataParallel"]


class ElasticDataParallel:
    """DistributedDataParallel over `comm` that survives the loss of ranks.

    `ddp_kwargs` go to every DistributedDataParallel it builds (at start and
    after each recovery). `recoveries` lists, per recovery, the failed ranks
    (of the communicator of the time), the new world size and the seconds the
    agreement and the shrink took."""

    def __init__(self, module: nn.Module, comm: Communicator, **ddp_kwargs: Any) -> None:
        self.module = module
        self._kwargs = ddp_kwargs
        self.comm = comm
        self.ddp = DistributedDataParallel(module, comm, **ddp_kwargs)
        self.recoveries: list[dict[str, Any]] = []

    @property
    def rank(self) -> int:
        """This rank in the current communicator."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """The current data-parallel size."""
        return self.comm.world_size

    def step(
        self,
        loss_fn: Callable[[DistributedDataParallel, int, int], torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> bool:
        """One training step: zeroes the gradients, runs loss_fn(ddp, rank,
        world_size) (the forward on this rank's share of the batch) and its
        backward, then agrees with the survivors whether every rank's step
        succeeded. Returns True once the optimizer stepped; False when the
        step was dropped (on every survivor alike): the communicator was
        shrunk to the survivors, and the caller retries the same batch.

        Raises what loss_fn raises other than a PyCollectivesError, and
        CommunicatorAborted on a rank fenced out (it must leave)."""
        optimizer.zero_grad(set_to_none=True)
        ok = True
        try:
            loss_fn(self.ddp, self.rank, self.world_size).backward()
        except PyCollectivesError:
            ok = False
        start = time.monotonic()
        agreed = self.comm.agree(ok)
        if agreed.value and not agreed.failed:
            optimizer.step()
            return True
        self._recover(agreed.failed, time.monotonic() - start)
        return False

    def _recover(self, failed: tuple[int, ...], agree_s: float) -> None:
        """Drops the step's gradients, shrinks the communicator and wraps the
        model again on the survivors' (which broadcasts its new rank 0's
        parameters: every survivor holds the same)."""
        self.ddp.detach()
        old = self.comm
        start = time.monotonic()
        self.comm = old.shrink()
        shrink_s = time.monotonic() - start
        with warnings.catch_warnings():  # its failed pending operations: reported above
            warnings.simplefilter("ignore", RuntimeWarning)
            old.close()
        self.ddp = DistributedDataParallel(self.module, self.comm, **self._kwargs)
        self.recoveries.append(
            {
                "failed": failed or self.comm.failed,
                "world_size": self.comm.world_size,
                "agree_s": agree_s,
                "shrink_s": shrink_s,
            }
        )
