"""ZeRO training that goes on when a rank dies (one host; docs/recovery.md,
"Sharded state").

Each rank's shard state has a buddy copy (redundancy.py: an in-memory
checkpoint on the rank and on rank + 1), refreshed every `copy_every` steps.
Every step ends in a fault-tolerant agreement (Communicator.agree): where
every rank's forward, backward, optimizer step and refresh succeeded and no
rank failed, the step counts (and the refresh is committed). Otherwise the
survivors shrink the communicator, rebuild the full state as of the last
committed copy (their own copies, and the dead ranks' from their buddies),
re-shard it over the survivors in a new ZeroOptimizer, and roll back to that
copy's step: `steps` says which step the caller runs next. With copy_every=1
that is the step in which the rank died (it is dropped and retried, as
ElasticDataParallel does); with k > 1 up to k - 1 completed steps are redone
as well, on every survivor alike.

    model = ElasticZero(module, torch.optim.AdamW, comm, stage=3, lr=1e-3)
    while model.steps < total:
        s = model.steps
        model.step(lambda m, rank, size: loss_of(m, batch(s, rank, size)))
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator, PyCollectivesError

from .redundancy import BuddyCopy, Entry, gather_full_state
from .zero import ZeroOptimizer

__all__ = ["ElasticZero", "reshard"]


class ElasticZero:
    """A ZeroOptimizer over `comm` (built with `optimizer_class`, `stage` and
    `zero_kwargs`) whose shard state survives the loss of ranks.

    Args:
        copy_every: refresh the buddy copies every this many steps (k): the
            cost of a refresh (a copy of this rank's shard state into host
            memory and one exchange of it with each neighbour) against the
            steps redone after a failure (up to k - 1 besides the failed one).

    `recoveries` lists, per recovery, the failed ranks (of the communicator of
    the time), the new world size, the step rolled back to and the seconds
    the agreement, the shrink and the rebuild took. Raises ValueError for a
    copy_every that is not a positive int, and what ZeroOptimizer raises.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        comm: Communicator,
        stage: int = 3,
        *,
        copy_every: int = 1,
        **zero_kwargs: Any,
    ) -> None:
        if isinstance(copy_every, bool) or not isinstance(copy_every, int) or copy_every < 1:
            raise ValueError(
                f"ElasticZero: rank {comm.rank}: copy_every={copy_every!r} must be an int >= 1"
            )
        self.model, self.comm, self.copy_every = model, comm, copy_every
        self._build = (optimizer_class, stage, zero_kwargs)
        self.zero = ZeroOptimizer(model, optimizer_class, comm, stage, **zero_kwargs)
        self.steps = 0  # steps that counted: the next step to run
        self.recoveries: list[dict[str, Any]] = []
        self.copy = BuddyCopy(self.zero)
        self._first_copy()

    @property
    def rank(self) -> int:
        """This rank in the current communicator."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """The current data-parallel size."""
        return self.comm.world_size

    def _first_copy(self) -> None:
        """The copy of the starting state (collective; a failure here is not recovered)."""
        self.copy.refresh()
        self.copy.commit(self.steps)

    def step(self, loss_fn: Callable[[nn.Module, int, int], torch.Tensor]) -> bool:
        """One training step: zero_grad, loss_fn(model, rank, world_size) (the
        forward on this rank's share of the batch) and its backward, the
        optimizer step, every copy_every steps the buddy refresh; then agrees
        with the survivors whether all of it succeeded everywhere. Returns True
        when the step counted (`steps` advanced); False when a rank failed:
        the state was rebuilt on the survivors as of step `steps` (the last
        committed copy), from which the caller goes on.

        Raises what loss_fn raises other than a PyCollectivesError,
        CommunicatorAborted on a rank fenced out (it must leave), and
        RuntimeError when a rank and its buddy both failed (state lost)."""
        ok, refreshed = True, False
        try:
            self.zero.zero_grad()
            loss_fn(self.model, self.rank, self.world_size).backward()
            self.zero.step()
            if (self.steps + 1) % self.copy_every == 0:
                refreshed = True
                self.copy.refresh()
        except PyCollectivesError:
            ok = False
            # ULFM's revoke before agree: a survivor still waiting for this rank in a
            # collective raises at once and comes to the agreement, instead of waiting out
            # its timeout there while the agreement declares it unresponsive.
            with contextlib.suppress(PyCollectivesError):
                self.comm.revoke("ElasticZero: its step failed")
        start = time.monotonic()
        agreed = self.comm.agree(ok)
        if agreed.value and not agreed.failed:
            self.steps += 1
            if refreshed:
                self.copy.commit(self.steps)
            return True
        self._recover(agreed.failed, time.monotonic() - start)
        return False

    def _recover(self, failed: tuple[int, ...], agree_s: float) -> None:
        """Shrinks the communicator, rebuilds the full state of the last
        committed copy on the survivors, re-shards it in a new ZeroOptimizer
        and takes a new copy of it."""
        old, start = self.comm, time.monotonic()
        old_size = old.world_size
        self.comm = old.shrink()
        shrink_s, start = time.monotonic() - start, time.monotonic()
        self.copy.discard()
        full = gather_full_state(self.copy, self.comm, self.comm.parent_ranks)
        optimizer_class, stage, kwargs = self._build
        self.zero = reshard(self.zero, full, self.comm, optimizer_class, stage, **kwargs)
        with warnings.catch_warnings():  # its failed pending operations: reported above
            warnings.simplefilter("ignore", RuntimeWarning)
            old.close()
        self.steps = self.copy.step
        self.copy = BuddyCopy(self.zero)
        self._first_copy()
        self.recoveries.append(
            {
                "failed": tuple(sorted(set(range(old_size)) - set(self.comm.parent_ranks)))
                or failed,
                "world_size": self.comm.world_size,
                "rolled_back_to": self.steps,
                "agree_s": agree_s,
                "shrink_s": shrink_s,
                "rebuild_s": time.monotonic() - start,
            }
        )


def reshard(
    old: ZeroOptimizer,
    full: dict[tuple[int, str], tuple[torch.Tensor, Entry]],
    comm: Communicator,
    optimizer_class: type[torch.optim.Optimizer],
    stage: int,
    **zero_kwargs: Any,
) -> ZeroOptimizer:
    """Collective over `comm`: re-shards the full state `full` (as
    gather_full_state returns it, laid out as `old`'s flat parameters) over
    `comm`: gives the model the full values (old.detach), wraps it in a new
    ZeroOptimizer and loads each new shard's optimizer state (the learning
    rates and other hyperparameters from `old`'s parameter groups). Returns
    the new optimizer; `old` must not be used any more."""
    flats = [f for u in old.engine.units for f in u.flats]
    values = {}
    for u in old.engine.units:
        prefix = "" if u is old.engine.root else u.name + "."
        for f in u.flats:
            flat = full[(flats.index(f), "param")][0]
            for s in f.layout.slots:
                values[prefix + s.name] = flat[s.offset : s.end].view(s.shape)
    old.detach(values)
    new = ZeroOptimizer(old.model, optimizer_class, comm, stage, **zero_kwargs)
    for g_new, g_old in zip(new.optimizer.param_groups, old.optimizer.param_groups, strict=True):
        g_new.update({k: v for k, v in g_old.items() if k != "params"})  # e.g. a scheduled lr
    index = {id(f): i for i, f in enumerate(flats)}
    for f_old, f_new in zip(old._flats, new._flats, strict=True):  # noqa: SLF001
        i = index[id(f_old)]
        a, b = f_new.layout.shard_range(comm.rank)
        state = {}
        for (j, key), (t, e) in full.items():
            if j != i or key == "param":
                continue
            if e.sharded:  # this rank's block at the new size (zeros in new padding)
                block = torch.zeros(b - a, dtype=t.dtype)
                have = t[a : min(b, t.numel())]
                block[: have.numel()] = have
                t = block
            state[key] = t.to(e.device, copy=True)
        if state:
            new.optimizer.state[f_new.opt_param] = state
    return new
