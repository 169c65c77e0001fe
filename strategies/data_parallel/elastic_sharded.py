"""ZeRO training that goes on when a rank dies (on one host or across hosts;
docs/recovery.md, "Sharded state").

Each rank's shard state has a buddy copy (redundancy.py: an in-memory
checkpoint on the rank and on its buddy: rank + 1 on one host, a rank on
another host across hosts, buddies.py), refreshed every `copy_every` steps.
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

The step, the agreement and the recovery are ElasticDataParallel's loop
(elastic.py); ElasticBuddyCopy gives its hooks for any sharded state kept in
buddy copies (ElasticZero's ZeroOptimizer, ElasticFSDP's fully_shard model).
A rank that dies while the survivors rebuild makes them shrink again and
rebuild from the same copy (untested for sharded state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator

from ..data import ElasticSampler
from .buddies import buddy_ranks
from .elastic import ElasticDataParallel
from .redundancy import BuddyCopy, Entry, FullState, gather_full_state
from .sharding.flat_param import FlatLayout
from .zero import ZeroOptimizer

__all__ = ["ElasticBuddyCopy", "ElasticZero", "ZeroPlan", "reshard"]


class ElasticBuddyCopy(ElasticDataParallel):
    """ElasticDataParallel's step loop for sharded state kept in buddy copies
    (ElasticZero here, ElasticFSDP in elastic_fsdp.py): the optimizer step and
    every `copy_every` steps the refresh before the agreement, the refresh
    committed after it; on a failure the full state of the last committed copy
    gathered on the survivors (`_full`) and `steps` rolled back to its step.

    `sampler` (an ElasticSampler, optional) is committed with each step, as
    under ElasticDataParallel, and rolled back with the copy: its cursor and
    ledger as of the copy's step (the steps redone are taken again from the
    same samples, re-split over the survivors: none skipped or seen twice).

    A subclass gives wrap(comm) (build over `comm`, from `_full` when it is
    set, then `_stage` the first copy of what it built, which recovered()
    commits), `_zero_grad()` and `_optimizer_step()`. `placement` places the
    buddies (BuddyCopy's: "auto", "hosts" or "ring"; buddies.py), at start
    and again over the survivors after each recovery. Raises ValueError for a
    copy_every that is not a positive int, and for a placement that is not
    one of those or cannot be honoured on `comm`'s hosts ("hosts" on one
    host, or with a host holding more than half of the ranks)."""

    copy: BuddyCopy  # the committed copy: the recovery point

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        copy_every: int,
        placement: str = "auto",
        sampler: ElasticSampler | None = None,
    ) -> None:
        who = f"{type(self).__name__}: rank {comm.rank}"
        if isinstance(copy_every, bool) or not isinstance(copy_every, int) or copy_every < 1:
            raise ValueError(f"{who}: copy_every={copy_every!r} must be an int >= 1")
        buddy_ranks(comm.hosts, placement, who)  # refused here rather than in the first wrap
        self.copy_every, self.placement = copy_every, placement
        self._full: FullState | None = None
        self._next: BuddyCopy | None = None
        self._refreshed = False
        # The sampler's cursor as of the committed copy.
        self._cursor: dict[str, Any] | None = None
        super().__init__(module, comm, sampler=sampler)
        self.recovered()  # the copy of the starting state (a failure here is not recovered)

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> None:
        raise NotImplementedError

    def _mark(self) -> None:
        """The sampler's position as of the copy just committed (local)."""
        if self.sampler is not None:
            self._cursor = self.sampler.state_dict()

    def _stage(self, source: Any) -> None:
        """Stages the first copy of a newly built state (collective: a refresh)."""
        self._next = BuddyCopy(source, placement=self.placement)
        self._next.refresh()

    # -- ElasticDataParallel's hooks -------------------------------------------------
    def zero_grad(self, optimizer: Any) -> None:
        self._refreshed = False
        self._zero_grad()

    def prepare(self, optimizer: Any) -> None:
        """The optimizer step and, every copy_every steps, the buddy refresh."""
        self._optimizer_step()
        if (self.steps + 1) % self.copy_every == 0:
            self._refreshed = True
            self.copy.refresh()

    def apply(self, optimizer: Any) -> None:
        """The refresh, if any, becomes the copy of the step (local; the
        sampler has committed the step: its cursor goes with the copy)."""
        if self._refreshed:
            self.copy.commit(self.steps + 1)
            self._mark()

    def unwrap(self) -> None:
        """Nothing: rebuild() and wrap() replace the sharded state."""

    def rebuild(self, old: Communicator, new: Communicator, failed: tuple[int, ...]) -> None:
        """The full state of the last committed copy on every survivor
        (gather_full_state: RuntimeError when a rank and its buddy both
        failed), and `steps` and the sampler rolled back to its step. The
        copy's staging buffer is freed (the copy is only read from now on)."""
        self.copy.discard(keep_staging=False)
        self._full = gather_full_state(self.copy, new, self.survivors, self._keep(new))
        self.steps = self.copy.step
        if self.sampler is not None and self._cursor is not None:
            self.sampler.rewind(self._cursor)

    def _keep(self, comm: Communicator) -> Callable[[Entry], tuple[int, int] | None] | None:
        """What of each sharded entry of the full state this rank keeps
        (gather_full_state's `keep`); default None: all of it."""
        return None

    def recovered(self) -> None:
        """The copy wrap() staged becomes the copy of step `steps`."""
        if self._next is None:
            raise RuntimeError(f"{type(self).__name__}: rank {self.rank}: wrap() staged no copy")
        self.copy, self._next, self._full = self._next, None, None
        self.copy.commit(self.steps)
        self._mark()


class ElasticZero(ElasticBuddyCopy):
    """A ZeroOptimizer over `comm` (built with `optimizer_class`, `stage` and
    `zero_kwargs`) whose shard state survives the loss of ranks.

    Args:
        copy_every: refresh the buddy copies every this many steps (k): the
            cost of a refresh (a copy of this rank's shard state into host
            memory and one exchange of it with each neighbour) against the
            steps redone after a failure (up to k - 1 besides the failed one).
        placement: where the buddies are (BuddyCopy's; default "auto": on
            another host whenever the ranks span hosts).
        sampler: an ElasticSampler the loss function takes its ids from
            (committed with each step, rolled back with the copy).

    `zero` is the current ZeroOptimizer (a new one after each recovery);
    `recoveries` lists, per recovery, the failed ranks (of the communicator of
    the time), the new world size, the step rolled back to and the seconds
    (ElasticDataParallel's). Raises ValueError for a copy_every that is not a
    positive int or a placement that cannot be honoured, and what
    ZeroOptimizer raises.
    """

    zero: ZeroOptimizer

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        comm: Communicator,
        stage: int = 3,
        *,
        copy_every: int = 1,
        placement: str = "auto",
        sampler: ElasticSampler | None = None,
        **zero_kwargs: Any,
    ) -> None:
        self.model = model
        self._build = (optimizer_class, stage, zero_kwargs)
        self._plan: ZeroPlan | None = None  # the released optimizer's, during a recovery
        super().__init__(model, comm, copy_every, placement, sampler)

    def step(self, loss_fn: Callable[[nn.Module, int, int], torch.Tensor]) -> bool:  # type: ignore[override]
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
        return super().step(loss_fn, self.zero)

    def wrap(self, comm: Communicator) -> nn.Module:
        """A ZeroOptimizer over `comm`: new, or (after a failure) holding the
        rebuilt state re-sharded (reshard); stages its first copy."""
        optimizer_class, stage, kwargs = self._build
        if self._full is None:
            self.zero = ZeroOptimizer(self.model, optimizer_class, comm, stage, **kwargs)
        else:
            assert self._plan is not None  # rebuild() set it
            self.zero = reshard(
                self._plan, self._full, comm, optimizer_class, stage, kept=True, **kwargs
            )
        self._stage(self.zero)
        return self.model

    def rebuild(self, old: Communicator, new: Communicator, failed: tuple[int, ...]) -> None:
        """ElasticBuddyCopy's, the ZeroOptimizer released first (its layout
        kept, `_plan`): its flat parameters, gradients and optimizer state are
        the failed step's, freed before the copy's state is gathered. (If the
        rebuild then fails with no rank lost, the model is left empty: restore
        it from a checkpoint.)"""
        if not self.zero.released:  # (a second try: the optimizer wrap() built, if any)
            self._plan = ZeroPlan(self.zero)
            self.zero.release()
        super().rebuild(old, new, failed)

    def recovered(self) -> None:
        super().recovered()
        self._plan = None

    def _keep(self, comm: Communicator) -> Callable[[Entry], tuple[int, int] | None]:
        """The full parameters (every rank holds them under ZeRO-1/2, and
        reshard hands them to the model), of the optimizer state only this
        rank's block at `comm`'s size: what reshard reads."""
        assert self._plan is not None  # rebuild() set it
        layouts = [f[1] for f in self._plan.flats]

        def keep(e: Entry) -> tuple[int, int] | None:
            if e.key == "param":
                return None
            return resized(layouts[e.flat], comm.world_size).shard_range(comm.rank)

        return keep

    def _zero_grad(self) -> None:
        self.zero.zero_grad()

    def _optimizer_step(self) -> None:
        self.zero.step()  # ZeRO-1/2: its all-gather, before the agreement


def resized(layout: FlatLayout, world_size: int) -> FlatLayout:
    """`layout`'s parameters laid out for `world_size` ranks (as a new ZeroOptimizer lays them)."""
    slots = [(s.name, s.aliases, s.shape) for s in layout.slots]
    return FlatLayout.build(slots, layout.dtype, layout.requires_grad, world_size)


class ZeroPlan:
    """What reshard reads of a ZeroOptimizer, which it can outlive (release):
    the model; its flat parameters in the engine's order (the buddy copy's
    flat indices) as (name prefix, layout, parameters, device); the indices
    of the trainable ones in the inner optimizer's order; and the
    hyperparameters of its parameter groups (a scheduled learning rate among
    them)."""

    def __init__(self, zero: ZeroOptimizer) -> None:
        self.model = zero.model
        self.flats: list[tuple[str, FlatLayout, list[nn.Parameter], torch.device]] = []
        index = {}
        for u in zero.engine.units:
            prefix = "" if u is zero.engine.root else u.name + "."
            for f in u.flats:
                index[id(f)] = len(self.flats)
                self.flats.append((prefix, f.layout, list(f.params), f.device))
        self.trainable = [index[id(f)] for f in zero._flats]  # noqa: SLF001
        self.groups = [
            {k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups
        ]


def reshard(
    old: ZeroOptimizer | ZeroPlan,
    full: FullState,
    comm: Communicator,
    optimizer_class: type[torch.optim.Optimizer],
    stage: int,
    *,
    kept: bool = False,
    **zero_kwargs: Any,
) -> ZeroOptimizer:
    """Collective over `comm`: re-shards the full state `full` (as
    gather_full_state returns it, laid out as `old`'s flat parameters) over
    `comm`: gives the model the full values (old.detach without copies, or,
    for a ZeroPlan of a released optimizer, as the parameters' data), wraps
    it in a new ZeroOptimizer and loads each new shard's optimizer state (the
    learning rates and other hyperparameters from `old`'s parameter groups).
    `kept`: `full` holds of the sharded optimizer state only this rank's
    block at the new size (gather_full_state with ElasticZero._keep).

    Takes out of `full` what it hands on (the model's values, and the kept
    blocks that become the new optimizer state as they are), so that each
    unit's gathered values are freed once the new ZeroOptimizer copied them
    into its flat parameter. Returns the new optimizer; `old` must not be
    used any more."""
    plan = old if isinstance(old, ZeroPlan) else ZeroPlan(old)
    _hand_values(old, plan, full)
    new = ZeroOptimizer(plan.model, optimizer_class, comm, stage, **zero_kwargs)
    for g_new, g_old in zip(new.optimizer.param_groups, plan.groups, strict=True):
        g_new.update(g_old)  # e.g. a scheduled lr
    for i, f_new in zip(plan.trainable, new._flats, strict=True):  # noqa: SLF001
        a, b = f_new.layout.shard_range(comm.rank)
        state = {}
        for k in [k for k in full if k[0] == i and k[1] != "param"]:
            t, e = full[k]
            if e.sharded and kept and t.numel() == b - a:  # this rank's block as it is
                state[k[1]] = full.pop(k)[0].to(e.device)
                continue
            if e.sharded:  # this rank's block at the new size (zeros in new padding)
                block = torch.zeros(b - a, dtype=t.dtype)
                have = t if kept else t[a : min(b, t.numel())]
                block[: have.numel()] = have
                t = block
            state[k[1]] = t.to(e.device, copy=True)
        if state:
            new.optimizer.state[f_new.opt_param] = state
    return new


def _hand_values(old: ZeroOptimizer | ZeroPlan, plan: ZeroPlan, full: FullState) -> None:
    """Gives the model's parameters the full values in `full`, taken out of
    it (views, no copies: old.detach(copy=False), or set as their data)."""
    values = {}
    for i, (prefix, layout, _, _) in enumerate(plan.flats):
        flat = full.pop((i, "param", -1))[0]
        for s in layout.slots:
            values[prefix + s.name] = flat[s.offset : s.end].view(s.shape)
    if isinstance(old, ZeroOptimizer):
        old.detach(values, copy=False)
        return
    for prefix, layout, params, device in plan.flats:
        for s, p in zip(layout.slots, params, strict=True):
            p.data = values[prefix + s.name].to(device)
