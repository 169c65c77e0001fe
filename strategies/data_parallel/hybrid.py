"""Hybrid sharded data parallel (HSDP) on ZeroOptimizer, and its recovery.

`HybridZero` shards a model within groups of `dp_shard` consecutive ranks (a
ZeroOptimizer on each group's communicator) and replicates it across the
`dp_replicate` groups: after backward, each gradient shard (averaged within
its group by the reduce-scatter) is averaged across the groups by one
all-reduce among the ranks that hold the same shard, so every replica steps
the same bits (torch FSDP2's HSDP, DeepSpeed's hpZ/MiCS).

`ElasticHSDP` survives a lost rank with no copy of its own: a shard's other
replicas hold it. Every step agrees (Communicator.agree) after backward and
the replica all-reduce, before the optimizer step, which is local (ZeRO-3) or
followed by its group's all-gather (ZeRO-1/2): once the agreement succeeded
the step counts on every survivor. On a failure the survivors shrink, take
each shard from a surviving replica and re-shard the state as plain ZeRO over
all the survivors (dp_replicate x dp_shard no longer divides them).

    model = ElasticHSDP(module, torch.optim.AdamW, comm, dp_replicate=2, dp_shard=2, lr=1e-3)
    while model.steps < total:
        s = model.steps
        model.step(lambda m, rank, size: loss_of(m, batch(s, rank, size)))
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator, PyCollectivesError, ReduceOp

from ..autograd_threads import autograd_comm
from .elastic import ElasticDataParallel
from .elastic_sharded import reshard
from .redundancy import FullState, gather_from_replicas
from .zero import ZeroOptimizer

__all__ = ["ElasticHSDP", "HybridZero"]


class HybridZero:
    """ZeroOptimizer within groups of `dp_shard` consecutive ranks of `comm`,
    replicated across `dp_replicate` groups (collective over `comm`).

    `shard_comm`: this rank's group (rank r is shard r % dp_shard of group
    r // dp_shard); `replica_comm`: the ranks holding the same shard.
    Raises ValueError on every rank when dp_replicate x dp_shard is not the
    world size, and what ZeroOptimizer raises."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        comm: Communicator,
        stage: int = 3,
        *,
        dp_replicate: int,
        dp_shard: int,
        **zero_kwargs: Any,
    ) -> None:
        sizes = (dp_replicate, dp_shard)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes) or (
            dp_replicate * dp_shard != comm.world_size
        ):
            raise ValueError(
                f"HybridZero: rank {comm.rank}: dp_replicate={dp_replicate!r} x "
                f"dp_shard={dp_shard!r} must be positive ints whose product is the world size "
                f"{comm.world_size}"
            )
        self.comm, self.dp_replicate, self.dp_shard = comm, dp_replicate, dp_shard
        group, shard = divmod(comm.rank, dp_shard)
        shard_comm = comm.split(group, key=shard)
        replica_comm = comm.split(shard, key=group)
        assert shard_comm is not None and replica_comm is not None
        self.shard_comm = autograd_comm(shard_comm)
        self.replica_comm = replica_comm
        self.zero = ZeroOptimizer(model, optimizer_class, self.shard_comm, stage, **zero_kwargs)

    def zero_grad(self) -> None:
        """Drops the reduced gradients."""
        self.zero.zero_grad()

    def reduce_replicas(self) -> None:
        """Collective over replica_comm: averages every gradient shard across
        the replicas (after backward, before step)."""
        if self.dp_replicate == 1:
            return
        for f in self.zero._flats:  # noqa: SLF001 - the trainable flats
            if f.grad_shard is not None:
                self.replica_comm.all_reduce(f.grad_shard, ReduceOp.AVG)

    def step(self) -> None:
        """reduce_replicas(), then the ZeroOptimizer's step."""
        self.reduce_replicas()
        self.zero.step()

    def close(self) -> None:
        """Closes the group communicators (not `comm`)."""
        with warnings.catch_warnings():  # a failed job's pending operations
            warnings.simplefilter("ignore", RuntimeWarning)
            self.shard_comm.close()
            self.replica_comm.close()


class ElasticHSDP(ElasticDataParallel):
    """HybridZero over `comm` that survives the loss of ranks as long as every
    shard keeps one replica (see the module docstring), on
    ElasticDataParallel's step loop through its hooks. After a recovery it
    trains as a plain ZeroOptimizer over the survivors (`zero`), with no
    redundancy left: a further loss raises. `recoveries` as
    ElasticDataParallel's (the failed ranks, the new world size, the seconds
    of agreement, shrink and rebuild)."""

    zero: ZeroOptimizer

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        comm: Communicator,
        stage: int = 3,
        *,
        dp_replicate: int,
        dp_shard: int,
        **zero_kwargs: Any,
    ) -> None:
        self.model = model
        self._build = (optimizer_class, stage, zero_kwargs)
        self._sizes = (dp_replicate, dp_shard)
        self.hsdp: HybridZero | None = None
        self._full: FullState | None = None
        super().__init__(model, comm)

    def step(self, loss_fn: Callable[[nn.Module, int, int], torch.Tensor]) -> bool:  # type: ignore[override]
        """One step: zero_grad, loss_fn(model, rank, world_size) and its
        backward, the replica all-reduce; an agreement; then the optimizer
        step. Returns True when the step counted. A failure before the
        agreement drops the step (False, retry it), one after it (in ZeRO-1/2's
        all-gather) keeps it (True): either way the state is then rebuilt on
        the survivors and `steps` is the next step to run.

        Raises what loss_fn raises other than a PyCollectivesError,
        CommunicatorAborted on a rank fenced out, and RuntimeError when every
        replica of a shard failed (or a rank fails after a recovery)."""
        return super().step(loss_fn, self.zero)

    # -- ElasticDataParallel's hooks -------------------------------------------------
    def wrap(self, comm: Communicator) -> nn.Module:
        """HybridZero over `comm` at start; after a failure the state taken
        from the replicas (`_full`) re-sharded as plain ZeRO over `comm`."""
        optimizer_class, stage, kwargs = self._build
        if self._full is None:
            r, s = self._sizes
            self.hsdp = HybridZero(
                self.model, optimizer_class, comm, stage, dp_replicate=r, dp_shard=s, **kwargs
            )
            self.zero = self.hsdp.zero
        else:
            self.zero = reshard(self.zero, self._full, comm, optimizer_class, stage, **kwargs)
        return self.model

    def zero_grad(self, optimizer: Any) -> None:
        self.zero.zero_grad()

    def prepare(self, optimizer: Any) -> None:
        """The replica all-reduce (before the agreement)."""
        if self.hsdp is not None:
            self.hsdp.reduce_replicas()

    def apply(self, optimizer: Any) -> None:
        """The optimizer step (ZeRO-1/2: its group's all-gather, after the agreement)."""
        self.zero.step()

    def revoke(self, why: str) -> None:
        """Also fails the group communicators' operations on every member: a
        rank waiting there on this one (which goes to the agreement) raises and
        joins the agreement too, instead of waiting out its timeout."""
        if self.hsdp is not None:
            for c in (self.hsdp.shard_comm, self.hsdp.replica_comm):
                with contextlib.suppress(PyCollectivesError):  # aborted already
                    c.revoke(f"ElasticHSDP: {why}")
        super().revoke(why)

    def unwrap(self) -> None:
        """Nothing: rebuild() and wrap() replace the sharded state."""

    def rebuild(self, old: Communicator, new: Communicator, failed: tuple[int, ...]) -> None:
        """Each shard from its first surviving replica (gather_from_replicas)."""
        if self.hsdp is None:
            raise RuntimeError(
                f"ElasticHSDP: rank {new.rank}: a rank failed after a recovery: no replica "
                "is left; restore the job from a checkpoint"
            )
        h = self.hsdp
        self._full = gather_from_replicas(
            h.zero, new, self.survivors, h.dp_shard, h.dp_replicate * h.dp_shard
        )

    def recovered(self) -> None:
        """Closes the group communicators: plain ZeRO from here on."""
        if self.hsdp is not None:
            self.hsdp.close()
        self.hsdp, self._full = None, None
