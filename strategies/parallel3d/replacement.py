"""3D-parallel training that takes in a replacement process when a rank dies
(docs/recovery.md, "Tensor and pipeline parallel grids: a replacement joins").

A tensor- or pipeline-parallel group cannot go on short (ParallelDims.shrink
raises NeedsReplacement): the lost rank's stage, or its shard of the stage's
weights, exists nowhere else. `ElasticTrainer3D` trains Trainer3D's GPT on a
dp x tp x pp grid so that a new process can take the lost place:

- every `copy_every` (k) steps each rank's training state (the parameters of
  its stages' tensor shards and their AdamW state) is copied into its own and
  its buddy's host memory (BuddyCopy, data_parallel/redundancy.py: world rank
  r + 1 on one host, a rank on another host across hosts; the layouts differ
  between stages, so each refresh tells the buddy the layout where it
  changed); the copy counts only once the step's agreement says every rank
  succeeded;
- every step ends in world.agree(ok): a step that failed anywhere (a rank
  died in it) is dropped on every survivor alike;
- then the survivors replace the grid (ParallelDims.replace: shrink, grow by
  the lost ranks, each newcomer in a lost place, every survivor in its own),
  every rank builds a new Trainer3D on it, the survivors load their own
  copy, each newcomer receives its place's copy from the lost rank's buddy
  (or, where the buddy is lost too, from a surviving data-parallel
  replica's own copy) and loads it, and every rank rolls back to the copy's
  step (k = 1: the failed step is redone).

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

from pycollectives import PyCollectivesError

from ..data_parallel.redundancy import BuddyCopy
from ..data_parallel.state_layout import (
    MAX_LAYOUT,
    MAX_STATE,
    Entry,
    StateTensor,
    decode_entries,
    encode_entries,
)
from ..models.gpt import GPTConfig
from ..parallel_dims import ParallelDims
from ..pipeline import PipelineError
from .trainer import StepStats, Trainer3D, TrainOptions

__all__ = ["ElasticTrainer3D", "ReplacementFailed", "sources", "state_tensors"]


class ReplacementFailed(RuntimeError):
    """A recovery of ElasticTrainer3D failed (every survivor raises it, the
    cause chained): the newcomers did not come in time, one died while the
    grid was rebuilt or the state moved, or this rank was fenced out.
    `failed`: the world ranks being replaced."""

    def __init__(self, message: str, failed: tuple[int, ...]) -> None:
        super().__init__(message)
        self.failed = failed


def state_tensors(trainer: Trainer3D) -> list[StateTensor]:
    """(index in trainer.named_params, key, tensor, False) of this rank's
    training state: each parameter ("param"), then each one's AdamW state.
    Raises TypeError for optimizer state that is not a tensor."""
    params = [p for _, p in trainer.named_params]
    out: list[StateTensor] = [(i, "param", p, False) for i, p in enumerate(params)]
    for i, p in enumerate(params):
        state = trainer.optimizer.state.get(p, {})
        for key in sorted(state):
            if not isinstance(state[key], torch.Tensor):
                raise TypeError(
                    f"ElasticTrainer3D: rank {trainer.dims.world.rank}: optimizer state {key!r} "
                    f"of {trainer.named_params[i][0]} is a {type(state[key]).__name__}, not a tensor"
                )
            out.append((i, key, state[key], False))
    return out


def sources(dims: ParallelDims, buddies: list[int] | None = None) -> dict[int, tuple[int, str]]:
    """For each replaced world rank (dims.replaced), the rank that sends it
    its state and which copy: its buddy's ("remote", rank buddies[r], default
    r + 1), else a surviving data-parallel replica's own ("local"). The same
    on every rank.

    Raises RuntimeError when neither survived (the state is lost)."""
    n, gone = dims.world.world_size, set(dims.replaced)
    buddies = buddies or [(r + 1) % n for r in range(n)]
    out, lost = {}, []
    for r in dims.replaced:
        replicas = [q for q in dims.group_of(r, "dp") if q not in gone]
        if buddies[r] not in gone:
            out[r] = (buddies[r], "remote")
        elif replicas:
            out[r] = (replicas[0], "local")
        else:
            lost.append(r)
    if lost:
        raise RuntimeError(
            f"ElasticTrainer3D: rank {dims.world.rank}: the state of "
            + ", ".join(dims.where(r) for r in lost)
            + " is lost: its buddy and every data-parallel replica failed "
            "with it; restart from a checkpoint"
        )
    return out


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
    `recoveries` one dict per recovery. Raises ValueError for a copy_every that
    is not an int >= 1, for --zero or --fsdp (their state is sharded over dp:
    not covered), and what Trainer3D raises.
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
        if opts.zero or opts.fsdp:
            raise ValueError(
                f"{who}: --zero {opts.zero} / --fsdp {opts.fsdp}: the replacement's state is a "
                "stage's full AdamW state (zero=0); sharded dp state is not covered"
            )
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
        survivors rolled back to. Raises ParallelDims.join's errors, and
        RuntimeError for state that does not fit this trainer's model."""
        dims = ParallelDims.join(store, dp=dp, tp=tp, pp=pp, timeout=timeout, prefix=prefix)
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
        ReplacementFailed (or RuntimeError: the state is lost) when the
        recovery fails."""
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
        try:
            new = old.replace(self.store, timeout=self.timeout, prefix=self.prefix)
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
                "agree_s": agree_s,
                "replace_s": replace_s,
                "restore_s": time.monotonic() - start,
            }
        )

    def _restore(self, dims: ParallelDims, copy: BuddyCopy | None) -> None:
        """Collective over dims.world: a new Trainer3D on `dims`; its state
        from this rank's copy (a survivor), from its source (a newcomer) or
        as initialized (a new job, copy None); then a first copy of it."""
        trainer = Trainer3D(dims, self.config, self.opts)
        me, step, state = dims.world.rank, 0, None
        buddies = _placement(dims, copy)
        self._sources = sources(dims, buddies) if dims.replaced else {}
        received = _transfer(dims, copy, self._sources)
        if received is not None:
            step, state = received[0], received[1:]
        elif copy is not None:
            step, state = copy.step, (copy.entries, copy.local)
        _check_alike(dims, step, self.copy_every)
        if state is not None:
            _load(trainer, *state, f"ElasticTrainer3D: rank {me}")
        trainer.step_index = step
        self.trainer = trainer
        self.copy = BuddyCopy(comm=dims.world, tensors=lambda: state_tensors(trainer))
        self.copy.refresh()
        self.copy.commit(step)

    def close(self) -> None:
        """Closes the grid's communicators, its world included."""
        self.dims.close()
        self.dims.world.close()


def _placement(dims: ParallelDims, copy: BuddyCopy | None) -> list[int] | None:
    """Collective over dims.world where ranks were replaced (else None): each
    world rank's buddy in the copies the survivors hold (placed on the old
    world's hosts), sent by the lowest surviving rank to every rank. Checked:
    a newcomer has none of its own. Raises RuntimeError for anything but a
    placement of the world's ranks."""
    if not dims.replaced:
        return None
    world, n = dims.world, dims.world.world_size
    root = min(r for r in range(n) if r not in dims.replaced)
    mine = copy.buddies if copy is not None and world.rank == root else [0] * n
    got = torch.tensor(mine, dtype=torch.int64)
    world.broadcast(got, root)
    buddies = got.tolist()
    if copy is not None and buddies != copy.buddies:  # a survivor: its copies' placement
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: world rank {root} placed the copies on "
            f"{buddies[:16]}, this rank on {copy.buddies[:16]}"
        )
    if sorted(buddies) != list(range(n)) or any(b == r for r, b in enumerate(buddies)):
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: world rank {root} sent the buddies "
            f"{buddies[:16]}, not a placement of {n} ranks"
        )
    return buddies


def _transfer(
    dims: ParallelDims, copy: BuddyCopy | None, plan: dict[int, tuple[int, str]]
) -> tuple[int, list[Entry], torch.Tensor] | None:
    """Point to point over dims.world: each source (`plan`, as sources()
    gives it) sends its newcomer the copy's step, layout and bytes. Returns
    them on a newcomer (checked: they came from another process), None
    elsewhere."""
    world, me = dims.world, dims.world.rank
    header = torch.zeros(3, dtype=torch.int64)
    first: list[tuple[str, torch.Tensor, int]] = []
    second: list[tuple[str, torch.Tensor, int]] = []
    for r, (src, which) in plan.items():
        if me == src:
            assert copy is not None, "a source without a copy"
            buf, entries = (
                (copy.remote, copy.remote_entries)
                if which == "remote"
                else (copy.local, copy.entries)
            )
            meta = torch.frombuffer(bytearray(encode_entries(entries)), dtype=torch.uint8)
            first.append(("send", torch.tensor([copy.step, meta.numel(), buf.numel()]), r))
            second += [("send", meta, r)] + ([("send", buf, r)] if buf.numel() else [])
        elif me == r:
            first.append(("recv", header, src))
    if first:
        world.batch_p2p(first)
    if me not in plan:
        if second:
            world.batch_p2p(second)
        return None
    step, k, nbytes = (int(v) for v in header)
    who = f"ElasticTrainer3D: rank {me}: world rank {plan[me][0]}'s"
    if step < 0 or not 0 < k <= MAX_LAYOUT or not 0 <= nbytes <= MAX_STATE:
        raise RuntimeError(f"{who} header is malformed: step {step}, {k} + {nbytes} bytes")
    raw, data = torch.empty(k, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    world.batch_p2p(
        [("recv", raw, plan[me][0])] + ([("recv", data, plan[me][0])] if nbytes else [])
    )
    entries = decode_entries(bytes(raw.numpy()), who)
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    if end != nbytes:
        raise RuntimeError(f"{who} layout holds {end} bytes, its state {nbytes}")
    return step, entries, data


def _check_alike(dims: ParallelDims, step: int, copy_every: int) -> None:
    """Collective: every rank restores the same step with the same copy_every."""
    world = dims.world
    every = torch.empty(world.world_size * 2, dtype=torch.int64)
    world.all_gather(every, torch.tensor([step, copy_every]))
    rows = every.view(world.world_size, 2).tolist()
    if any(r[1] != rows[0][1] for r in rows):
        raise ValueError(
            f"ElasticTrainer3D: rank {world.rank}: the ranks' copy_every differ: "
            + ", ".join(f"rank {q}: {r[1]}" for q, r in enumerate(rows))
        )
    if any(r[0] != rows[0][0] for r in rows):
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: the ranks' copies hold different steps: "
            + ", ".join(f"rank {q}: {r[0]}" for q, r in enumerate(rows))
        )


def _load(trainer: Trainer3D, entries: list[Entry], data: torch.Tensor, who: str) -> None:
    """Loads a copy (state_tensors' layout) into the trainer's parameters and
    AdamW state. Raises RuntimeError where it does not fit the model."""
    named = trainer.named_params
    state: dict[int, dict[str, torch.Tensor]] = {}
    loaded = set()
    for e in entries:
        if not 0 <= e.flat < len(named):
            raise RuntimeError(f"{who}: the copy names parameter {e.flat} of {len(named)}")
        name, p = named[e.flat]
        # A copy of the bytes: the offsets need not suit the dtype's alignment.
        t = data[e.offset : e.offset + e.nbytes].clone().view(e.dtype).view(e.shape)
        if e.key != "param":
            # AdamW's step count stays on the host; the moments go where the parameter is.
            state.setdefault(e.flat, {})[e.key] = t if e.device.type == "cpu" else t.to(p.device)
            continue
        if e.shape != tuple(p.shape) or e.dtype != p.dtype:
            raise RuntimeError(
                f"{who}: the copy's {name} is {e.dtype} {list(e.shape)}, the model's "
                f"{p.dtype} {list(p.shape)}: the copy is of another model or layout"
            )
        with torch.no_grad():
            p.copy_(t)
        loaded.add(e.flat)
    if len(loaded) != len(named):
        missing = [named[i][0] for i in range(len(named)) if i not in loaded]
        raise RuntimeError(f"{who}: the copy lacks {missing[:4]}")
    trainer.optimizer.state.clear()
    for i, st in state.items():
        trainer.optimizer.state[named[i][1]] = st
