"""Data-parallel training that goes on when a rank dies (on one host or across hosts; docs/recovery.md).

Every step ends in a fault-tolerant agreement (Communicator.agree, as torchft's
should_commit): the optimizer steps only where every rank's backward (its
bucket all-reduces) succeeded and no rank failed, so the step in which a rank
died is dropped on every survivor alike. The survivors then shrink the
communicator and wrap the model again on it: the next steps average the
gradients over the new size. The dropped step is retried, its samples re-split
over the survivors: with an ElasticSampler (data.py) the epoch's remaining
sample order is, and its ledger shows every sample of the epoch consumed
exactly once; the run equals one that had the surviving layout from the
dropped step on.

    sampler = ElasticSampler(len(data), global_batch_size=48)
    model = ElasticDataParallel(module, comm, sampler=sampler)
    while sampler.epoch < epochs:  # step() is False when the step was dropped
        model.step(lambda ddp, rank, size: loss_of(ddp, sampler.ids(rank, size)), optimizer)

A rank that dies after the agreement (in the optimizer step) leaves a step
that every survivor committed: its samples count as consumed (its gradients
were in every survivor's average), and the loss shows in the next step, which
is dropped.

The other data-parallel wrappers (ElasticZero, ElasticHSDP, ElasticFSDP:
sharded state kept redundant) run this same loop through its hooks: wrap(comm)
builds the wrapper, zero_grad / prepare / apply start, finish (before the
agreement) and commit (after it) a step, revoke(why) fails the collectives of
a step given up, unwrap() drops a failed step's wrapper, rebuild(old, new,
failed) restores lost state between the shrink and the new wrap, recovered()
ends a recovery every survivor agreed on.
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

from ..data import ElasticSampler
from .ddp import DistributedDataParallel, ranks_that_differ

__all__ = ["ElasticDataParallel"]


class ElasticDataParallel:
    """DistributedDataParallel over `comm` that survives the loss of ranks.

    `sampler` (optional): the ElasticSampler whose ids the loss function
    takes; each committed step is committed in it (its cursor and ledger),
    so a dropped step's samples are retried, re-split over the survivors (the
    buddy-copy wrappers roll it back with their copy: elastic_sharded.py).
    `ddp_kwargs` go to every DistributedDataParallel it builds (at start and
    after each recovery). `steps` counts the committed steps; `recoveries`
    lists, per recovery, the step that was dropped (`step`), the failed ranks
    (of the communicator of the time, those lost during the recovery
    included), each new rank's rank in that communicator (`survivors`), the
    new world size, the step the survivors go on from
    (`rolled_back_to`: `step` for DDP, the buddy copy's step for sharded
    state) and the seconds the agreement, the whole recovery (`shrink_s`:
    shrink, rebuild, wrap) and its rebuild and wrap alone (`rebuild_s`) took."""

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        sampler: ElasticSampler | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.module = module
        self.sampler = sampler
        self._kwargs = ddp_kwargs
        self.comm = comm
        self.steps = 0
        self.recoveries: list[dict[str, Any]] = []
        self.survivors = tuple(range(comm.world_size))  # set by each recovery (see rebuild)
        self.ddp = self.wrap(comm)

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
        loss_fn: Callable[[Any, int, int], torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> bool:
        """One training step: zeroes the gradients, runs loss_fn(ddp, rank,
        world_size) (the forward on this rank's share of the batch), its
        backward and prepare(), then agrees with the survivors whether every rank's step
        succeeded. Returns True once the optimizer stepped (and the sampler,
        if any, committed the step); False when the step was dropped (on
        every survivor alike): the communicator was shrunk to the survivors,
        and the caller retries the step (the sampler's next ids are the same
        samples, re-split).

        Raises what loss_fn raises other than a PyCollectivesError,
        CommunicatorAborted on a rank fenced out (it must leave),
        PyCollectivesError on every survivor when they could not rebuild with
        no rank lost (e.g. a hook's error), and RuntimeError if the survivors
        found they had not committed the same steps (which the agreement
        rules out)."""
        self.zero_grad(optimizer)
        ok = True
        try:
            loss_fn(self.ddp, self.rank, self.world_size).backward()
            self.prepare(optimizer)
        except PyCollectivesError:
            ok = False
            self.revoke("its step failed")
        start = time.monotonic()
        agreed = self.comm.agree(ok)
        if not agreed.value or agreed.failed:
            self._recover(time.monotonic() - start)
            return False
        if self.sampler is not None:  # before apply: a copy apply commits holds its cursor
            self.sampler.commit(self.world_size)
        failed = False
        try:
            self.apply(optimizer)
        except PyCollectivesError:  # after the agreement: the step counts on every survivor
            failed = True
        self.steps += 1
        if failed:  # the others meet this agreement in their next step, which fails too
            self.revoke("its optimizer step failed")
            start = time.monotonic()
            self.comm.agree(False)
            self._recover(time.monotonic() - start)
        return True

    # -- hooks: what a subclass for another data-parallel wrapper overrides ----
    def wrap(self, comm: Communicator) -> Any:
        """Builds the data-parallel wrapper over `comm` (collective), at start
        and after each shrink; loss_fn receives it. Default: DistributedDataParallel;
        after a shrink with init_sync="verify" (unless ddp_kwargs say otherwise):
        the survivors hold the same parameters after a dropped step, so a
        fingerprint of them replaces the broadcast (which took 14.6 s of a
        52 s recovery at 200M parameters, docs/benchmarks.md)."""
        kwargs = self._kwargs
        if hasattr(self, "ddp"):  # not the first wrap: after a shrink
            kwargs = {"init_sync": "verify", **kwargs}
        return DistributedDataParallel(self.module, comm, **kwargs)

    def zero_grad(self, optimizer: Any) -> None:
        """Clears the gradients before a step (try)."""
        optimizer.zero_grad(set_to_none=True)

    def prepare(self, optimizer: Any) -> None:
        """Finishes a step after its backward, before the agreement (a
        PyCollectivesError here drops the step, as one in backward does).
        Default: nothing. ElasticZero and ElasticFSDP step the optimizer and
        refresh the buddy copies here; ElasticHSDP all-reduces across replicas."""

    def apply(self, optimizer: Any) -> None:
        """Commits the step once every survivor agreed: the optimizer step.
        It runs where the step is decided alike on every survivor; one that
        communicates must leave the survivors alike if a rank dies in it: a
        PyCollectivesError here counts the step, then recovers (the others
        recover at their next step's agreement)."""
        optimizer.step()

    def revoke(self, why: str) -> None:
        """Fails the collectives of a step this rank gives up (ULFM's revoke
        before agree): a survivor still waiting for it in one raises at once
        and comes to the agreement, instead of waiting out its timeout there
        while the agreement declares it unresponsive. Default: revokes `comm`;
        a wrapper with communicators of its own revokes those too."""
        _revoke(self.comm, why)

    def unwrap(self) -> None:
        """Drops the wrapper of the failed step and its gradients (before the shrink)."""
        self.ddp.detach()

    def rebuild(self, old: Communicator, new: Communicator, failed: tuple[int, ...]) -> None:
        """After the shrink, before wrap(new): restores state that lived on the
        `failed` ranks of `old` (nothing for DDP: every rank holds all of it).
        `new.parent_ranks` maps the new ranks to the old; `self.survivors` the
        new ranks to those of the communicator of the failed step (they differ
        when a rank died during the recovery). A PyCollectivesError here (another
        rank died) makes the survivors shrink `new` in turn and call it again,
        with `new` as `old`."""

    def recovered(self) -> None:
        """Ends a recovery, once every survivor agreed that it rebuilt and
        wrapped (local). Default: nothing; the sharded wrappers commit here the
        buddy copy of the rebuilt state that wrap() took."""

    # -- recovery ----------------------------------------------------------------
    def _recover(self, agree_s: float) -> None:
        """Drops the step's gradients, shrinks the communicator, checks that
        every survivor committed the same steps, rebuilds and wraps the model
        again on the survivors' (DDP's fingerprint check finds the parameters
        alike: every survivor holds the same), then agrees that every survivor did: a
        rank that died meanwhile makes every survivor shrink again, without it.
        Raises PyCollectivesError on every survivor alike if a rebuild failed
        with no rank lost (retrying would fail the same way)."""
        self.unwrap()
        old = comm = self.comm
        ranks = list(range(old.world_size))  # the rank in `old` of each rank of `comm`
        dropped = self.steps
        start, rebuild_s = time.monotonic(), 0.0
        while True:
            new = comm.shrink()
            t0 = time.monotonic()
            self.survivors = tuple(ranks[p] for p in new.parent_ranks)
            error: PyCollectivesError | None = None
            try:
                self._check_alike(new)
                self.rebuild(comm, new, new.failed)
                self.ddp = self.wrap(new)
            except PyCollectivesError as e:  # another rank died while we rebuilt?
                error = e
                _revoke(new, "its rebuild failed")
            rebuild_s += time.monotonic() - t0
            agreed = new.agree(error is None)
            if comm is not old:
                _close(comm)
            comm, ranks = new, list(self.survivors)
            self.comm = comm
            if agreed.value and not agreed.failed:
                break
            self.unwrap()
            if not agreed.failed:
                _close(old)
                raise PyCollectivesError(
                    f"{type(self).__name__}: rank {comm.rank}: the survivors could not rebuild "
                    f"on the shrunk communicator, and no rank failed meanwhile (here: "
                    f"{error or 'rebuilt'}): not a lost rank, recovery stops"
                ) from error
        self.recovered()
        shrink_s = time.monotonic() - start
        _close(old)
        self.recoveries.append(
            {
                "step": dropped,
                "failed": tuple(r for r in range(old.world_size) if r not in ranks),
                "survivors": tuple(ranks),
                "world_size": comm.world_size,
                "rolled_back_to": self.steps,
                "agree_s": agree_s,
                "shrink_s": shrink_s,
                "rebuild_s": rebuild_s,
            }
        )

    def _check_alike(self, comm: Communicator) -> None:
        """Every survivor committed the same steps and holds the same sampler
        cursor (collective over `comm`); RuntimeError naming the ranks that differ."""
        cursor = self.sampler.state_dict() if self.sampler is not None else {}
        mine = hash((cursor.get("epoch", -1), cursor.get("position", -1))) & ((1 << 62) - 1)
        differ, steps = ranks_that_differ(comm, self.steps, mine)
        if differ:
            raise RuntimeError(
                f"ElasticDataParallel: rank {comm.rank}: after the shrink, ranks {differ} "
                f"committed other steps than rank 0 (committed steps per rank: {steps}) or hold "
                "another sampler cursor: the survivors are no longer alike"
            )


def _revoke(comm: Communicator, why: str) -> None:
    """Revokes `comm` (ULFM's revoke before agree): a survivor still waiting in
    one of its collectives for this rank raises at once and comes to the
    agreement, instead of waiting out its timeout there while the agreement
    declares it unresponsive. Nothing to do if `comm` is closed."""
    with contextlib.suppress(PyCollectivesError):
        comm.revoke(f"ElasticDataParallel: {why}")


def _close(comm: Communicator) -> None:
    """Closes a communicator the survivors left (its failed pending operations
    were reported where they failed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        comm.close()
