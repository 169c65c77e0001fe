"""3D-parallel training that takes in a replacement process when a rank dies
(docs/recovery.md, "Tensor and pipeline parallel grids: a replacement joins").

A tensor- or pipeline-parallel group cannot go on short (ParallelDims.shrink
raises NeedsReplacement): the lost rank's stage, or its shard of the stage's
weights, exists nowhere else. `ElasticTrainer3D` trains Trainer3D's GPT on a
dp x tp x pp grid, in any of its dp modes (zero 0-3, fsdp), so that a new
process can take the lost place:

- every `copy_every` (k) steps each rank's training state is copied into
  its own and its buddy's host memory (BuddyCopy, data_parallel/redundancy.py:
  world rank r + 1 on one host, a rank on another host across hosts; the
  layouts differ between stages, so each refresh tells the buddy the layout
  where it changed): what only this rank holds, as its dp mode keeps it
  (Trainer3D.dp.masters()): with zero=0 its stages' tensor-parallel shard of
  the parameters and their AdamW state; with --zero N or --fsdp its flat
  parameters' master shards (1/dp of that tensor-parallel shard) and the
  AdamW state of those shards. The copy counts only once the step's
  agreement says every rank succeeded;
- every step ends in world.agree(ok): a step that failed anywhere (a rank
  died in it) is dropped on every survivor alike;
- then the survivors replace the grid (ParallelDims.replace: shrink, grow by
  the lost ranks, each newcomer in a lost place, every survivor in its own),
  every rank builds a new Trainer3D on it (the same grid: every shard keeps
  its layout), the survivors load their own copy, each newcomer receives its
  place's copy from the lost rank's buddy and loads it (ZeRO-1/2 then
  all-gather the full parameters from the shards), and every rank rolls back
  to the copy's step (k = 1: the failed step is redone). Where the buddy is
  lost too, zero=0's state comes from a surviving data-parallel replica's
  own copy (the replicas hold the same); sharded state (--zero N, --fsdp)
  has no replica: every survivor raises ReplacementFailed naming both ranks,
  before it waits for a newcomer (ParallelDims.replace's check), and the
  newcomers waiting to join raise it too (the survivors refuse them:
  pycollectives.join raises GrowRefused).

    et = ElasticTrainer3D(dims, config, opts, store)  # every rank at the start
    et = ElasticTrainer3D.join(store, config, opts, dp=1, tp=2, pp=2)  # a newcomer
    while et.steps < total:
        et.step()  # False: a recovery; `steps` rolled back
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch

from pycollectives import GrowRefused, PyCollectivesError

from ..data_parallel.redundancy import BuddyCopy
from ..models.gpt import GPTConfig
from ..parallel_dims import ParallelDims
from ..pipeline import PipelineError
from ..pipeline.communications import agree
from .replacement_state import (
    ReplacementFailed,
    check_alike,
    load,
    placement,
    recovered,
    sources,
    state_tensors,
    transfer,
)
from .trainer import StepStats, Trainer3D, TrainOptions

__all__ = ["ElasticTrainer3D", "ReplacementFailed", "recovered", "sources", "state_tensors"]


def _from_communication(e: BaseException) -> bool:
    """Whether `e` is, or was caused by, a communicator's error."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, PyCollectivesError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class ElasticTrainer3D:
    """Trainer3D on `dims` (see the module docstring) whose lost ranks are
    replaced by new processes (each ElasticTrainer3D.join with the same
    `store`, `prefix`, sizes, config and options).

    Args:
        store: the job's torch.distributed Store (where the survivors and the
            newcomers meet: Communicator.grow / pycollectives.join).
        copy_every: refresh the buddy copies every k steps: up to k - 1
            completed steps are redone after a failure, besides the failed one.
        timeout: bounds the shrink and the wait for the newcomers (default:
            the world communicator's).

    `trainer` is the current Trainer3D (a new one after each recovery),
    `steps` the next step to run, `last` the last committed step's StepStats,
    `recoveries` one dict per recovery (failed, step, rolled_back_to,
    sources, state: what the newcomers received, and the times). Any of
    Trainer3D's dp modes (opts.zero 0-3, opts.fsdp). Raises ValueError for a
    copy_every that is not an int >= 1, and what Trainer3D raises.
    """

    def __init__(
        self,
        dims: ParallelDims,
        config: GPTConfig,
        opts: TrainOptions,
        store: Any,
        *,
        copy_every: int = 1,
        timeout: float | None = None,
        prefix: str = "pycoll-grow",
    ) -> None:
        who = f"ElasticTrainer3D: rank {dims.world.rank}"
        if isinstance(copy_every, bool) or not isinstance(copy_every, int) or copy_every < 1:
            raise ValueError(f"{who}: copy_every={copy_every!r} must be an int >= 1")
        if dims.replaced and dims.world.rank not in dims.replaced:
            raise ValueError(f"{who}: a survivor recovers in step(), not with a new trainer")
        self.config, self.opts, self.store = config, opts, store
        self.copy_every, self.timeout, self.prefix = copy_every, timeout, prefix
        self.recoveries: list[dict[str, Any]] = []
        self.last: StepStats | None = None
        self._restore(dims, None)

    @classmethod
    def join(
        cls,
        store: Any,
        config: GPTConfig,
        opts: TrainOptions,
        *,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        copy_every: int = 1,
        timeout: float = 600.0,
        prefix: str = "pycoll-grow",
    ) -> ElasticTrainer3D:
        """A replacement process: waits (up to `timeout`) for the survivors'
        recovery, takes a lost rank's place in the grid (ParallelDims.join),
        receives that place's state and returns the trainer at the step the
        survivors rolled back to. Before it waits it builds a throwaway
        AdamW: torch's first optimizer in a process imports torch._dynamo
        (3.4 s on the 2-core test machine), which would otherwise hold up
        the survivors' recovery where the newcomer was started beforehand.
        Raises ParallelDims.join's errors, ReplacementFailed (the
        survivors' message and failed ranks) where they refused it: a lost
        rank's state is lost; and RuntimeError for state that does not fit
        this trainer's model."""
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        try:
            dims = ParallelDims.join(store, dp=dp, tp=tp, pp=pp, timeout=timeout, prefix=prefix)
        except GrowRefused as e:  # the survivors found the lost state lost: so is this place's
            why = f"ElasticTrainer3D: a newcomer: the survivors refused it: {e.reason}"
            raise ReplacementFailed(why, e.failed) from e
        return cls(dims, config, opts, store, copy_every=copy_every, prefix=prefix)

    @property
    def dims(self) -> ParallelDims:
        """The current grid (a new one after each recovery)."""
        return self.trainer.dims

    @property
    def steps(self) -> int:
        """The next step to run (the copy's step after a recovery)."""
        return self.trainer.step_index

    def step(self) -> bool:
        """Collective over the grid: runs step `steps` (Trainer3D.step),
        refreshes the buddy copies every copy_every steps, then agrees with
        every rank whether all of it succeeded. Returns True when the step
        counted; False when a rank failed: the grid was replaced and every
        rank rolled back to the last committed copy (`steps`).

        Raises what Trainer3D.step raises other than a communication error,
        CommunicatorAborted on a rank fenced out (it must leave), and
        ReplacementFailed when the recovery fails (on every survivor, before
        it waits for newcomers, where a lost rank's state is lost with its
        buddy: sources(); the newcomers' join then raises it too)."""
        ok, refreshed, stats, k = True, False, None, self.steps
        try:
            stats = self.trainer.step()
            if self.trainer.step_index % self.copy_every == 0:
                refreshed = True
                self.copy.refresh()
        except (PyCollectivesError, PipelineError) as e:
            if not _from_communication(e):
                raise
            ok = False
            # A survivor waiting on a live peer in another group joins the agreement at once.
            for c in [self.dims.tp_comm, self.dims.pp_comm, self.dims.dp_comm, self.dims.world]:
                with contextlib.suppress(PyCollectivesError):
                    c.revoke("ElasticTrainer3D: its step failed")
        start = time.monotonic()
        agreed = self.dims.world.agree(ok)
        if agreed.value and not agreed.failed:
            if refreshed:
                self.copy.commit(self.trainer.step_index)
            self.last = stats
            return True
        self._recover(k, agreed.failed, time.monotonic() - start)
        return False

    def _recover(self, k: int, failed: tuple[int, ...], agree_s: float) -> None:
        """Replaces the grid, rebuilds the trainer and rolls back to the copy."""
        old, me, start = self.dims, self.dims.world.rank, time.monotonic()
        self.copy.discard()
        sharded, buddies = bool(self.opts.zero or self.opts.fsdp), self.copy.buddies

        def recoverable(lost: tuple[int, ...]) -> None:  # before anyone waits for a newcomer
            sources(old, buddies, sharded, lost)

        try:
            new = old.replace(
                self.store, timeout=self.timeout, prefix=self.prefix, check=recoverable
            )
            replace_s, start = time.monotonic() - start, time.monotonic()
            with warnings.catch_warnings():  # its failed pending operations: reported already
                warnings.simplefilter("ignore", RuntimeWarning)
                old.world.close()
            self._restore(new, self.copy)
        except (PyCollectivesError, PipelineError) as e:
            raise ReplacementFailed(
                f"ElasticTrainer3D: rank {me}: the recovery from the loss of "
                + (", ".join(old.where(r) for r in failed) or "a failed step")
                + f" in step {k} failed: {type(e).__name__}: {e}",
                failed,
            ) from e
        self.recoveries.append(
            {
                "failed": new.replaced,
                "step": k,
                "rolled_back_to": self.steps,
                "sources": self._sources,
                "state": recovered(self.opts),
                "agree_s": agree_s,
                "replace_s": replace_s,
                "restore_s": time.monotonic() - start,
            }
        )

    def _restore(self, dims: ParallelDims, copy: BuddyCopy | None) -> None:
        """Collective over dims.world: a new Trainer3D on `dims`; its state
        from this rank's copy (a survivor), from its source (a newcomer) or
        as initialized (a new job, copy None); then a first copy of it.
        Raises ReplacementFailed on every rank where a lost rank's state is
        lost (sources), RuntimeError on every rank where a copy does not
        fit its trainer."""
        me, step, state = dims.world.rank, 0, None
        buddies = placement(dims, copy)
        sharded = bool(self.opts.zero or self.opts.fsdp)
        self._sources = sources(dims, buddies, sharded) if dims.replaced else {}
        trainer = Trainer3D(dims, self.config, self.opts)
        received = transfer(dims, copy, self._sources)
        if received is not None:
            step, state = received[0], received[1:]
        elif copy is not None:
            step, state = copy.step, (copy.entries, copy.local)
        check_alike(dims, step, self.copy_every)
        if state is not None:  # on every rank or on none (a new job)
            error = None
            try:
                load(trainer, *state, f"ElasticTrainer3D: rank {me}")
            except RuntimeError as e:
                error = e
            agree(dims.world, "ElasticTrainer3D: loading the copies", error, timeout=self.timeout)
            trainer.dp.restored()  # ZeRO-1/2: the full parameters from the shards
        trainer.step_index = step
        self.trainer = trainer
        self.copy = BuddyCopy(comm=dims.world, tensors=lambda: state_tensors(trainer))
        self.copy.refresh()
        self.copy.commit(step)

    def close(self) -> None:
        """Closes the grid's communicators, its world included."""
        self.dims.close()
        self.dims.world.close()
