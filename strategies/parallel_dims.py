"""The process grid: one object that knows how the ranks divide into data-,
tensor- and pipeline-parallel groups, built once and passed explicitly to
whatever needs a group (no global state; layers receive a communicator).

Rank layout, outermost axis first: pp, dp, tp (torchtitan's order, picotron's
`arange(world).view(...)`). Tensor parallelism is innermost, so a tensor-
parallel group is a run of neighbouring ranks, which talk the most:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

A context-parallel axis goes between dp and tp (it talks less than tp, more
than dp): one more name in AXES and NAMES, one more keyword and its properties.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pycollectives import Communicator, PyCollectivesError, join
from pycollectives.launcher import took_place
from pycollectives.rendezvous.grow import refuse

from .autograd_threads import autograd_comm

__all__ = ["AXES", "NeedsReplacement", "ParallelDims"]

AXES: tuple[str, ...] = ("pp", "dp", "tp")  # the rank layout, outermost first
NAMES: tuple[str, ...] = ("dp", "tp", "pp")  # the order messages name them in


def _as_size(value: Any) -> int:
    """An axis size as requested: a positive int, or -1 (infer); anything else -> 0 (invalid)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == -1):
        return 0
    return value


class NeedsReplacement(RuntimeError):
    """ParallelDims.shrink(): a tensor- or pipeline-parallel group lost a member,
    so the grid cannot go on with fewer ranks: a replacement process must take
    the lost place (ParallelDims.replace on the survivors, ParallelDims.join in
    the newcomer). `failed`: the failed world ranks; `groups`: per axis with a
    size above 1, the world ranks of each group that lost a member."""

    def __init__(self, message: str, failed: tuple[int, ...], groups: dict[str, list[list[int]]]):
        super().__init__(message)
        self.failed, self.groups = failed, groups


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{a}={sizes[a]}" for a in NAMES)


class ParallelDims:
    """A dp x tp x pp grid of the ranks of `comm`, with one sub-communicator
    per axis, built here with comm.split (collective over `comm`).

    `dp`, `tp`, `pp` are the sizes (one of them may be -1: whatever the world
    size leaves); `dp_rank`, `tp_rank`, `pp_rank` this rank's coordinates;
    `dp_comm`, `tp_comm`, `pp_comm` the communicators of the ranks that differ
    from this one only along that axis, ordered by coordinate (so
    `tp_comm.rank == tp_rank`). An axis of size 1 still has its (one-rank)
    communicator, so code never special-cases it.

    Every rank first gathers every rank's request, so bad input raises the
    same ValueError on every rank instead of a hang: ranks asking for
    different sizes, a size that is not a positive int (or -1), sizes whose
    product is not the world size (the message names each factor).

        dims = ParallelDims(comm, dp=2, tp=2, pp=1)
        dims.tp_comm.all_reduce(t)  # among ranks 2k, 2k+1
    """

    def __init__(self, comm: Communicator, *, dp: int = 1, tp: int = 1, pp: int = 1) -> None:
        requested = {"dp": dp, "tp": tp, "pp": pp}
        self.world = comm
        self.replaced: tuple[int, ...] = ()  # world ranks a replacement took (replace/join)
        self.sizes = _agree_on_sizes(comm, requested)
        self.coords = dict(zip(AXES, self._unravel(comm.rank), strict=True))
        self._comms: dict[str, Communicator] = {}
        for axis in AXES:  # the same order on every rank: each split is collective
            others = {a: c for a, c in self.coords.items() if a != axis}
            color = self.rank_of(**others, **{axis: 0})
            sub = comm.split(color, key=self.coords[axis])
            assert sub is not None and sub.rank == self.coords[axis], (axis, sub)
            self._comms[axis] = autograd_comm(sub)

    # -- sizes, coordinates, communicators ----------------------------------------
    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_comm(self) -> Communicator:
        return self._comms["dp"]

    @property
    def tp_comm(self) -> Communicator:
        return self._comms["tp"]

    @property
    def pp_comm(self) -> Communicator:
        return self._comms["pp"]

    def comm(self, axis: str) -> Communicator:
        """The communicator along `axis` (one of AXES). Raises KeyError for another name."""
        return self._comms[axis]

    def rank_of(self, **coords: int) -> int:
        """The rank (in `world`) at the given coordinates, e.g. rank_of(pp=1, dp=0, tp=0).

        Raises ValueError for a missing axis or a coordinate out of range."""
        if set(coords) != set(AXES) or any(not 0 <= coords[a] < self.sizes[a] for a in AXES):
            raise ValueError(f"ParallelDims.rank_of: {coords} is not a point of {self}")
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def where(self, rank: int | None = None) -> str:
        """World rank `rank` (this one by default) and its coordinates:
        "rank 3 (dp=1, tp=0, pp=1)"."""
        rank = self.world.rank if rank is None else rank
        coords = dict(zip(AXES, self._unravel(rank), strict=True))
        return f"rank {rank} (" + ", ".join(f"{a}={coords[a]}" for a in NAMES) + ")"

    def world_ranks(self, axis: str) -> list[int]:
        """The world rank of each rank of this rank's `axis` communicator, by its rank there."""
        return [self.rank_of(**{**self.coords, axis: c}) for c in range(self.sizes[axis])]

    def in_world_terms(self, message: str, axis: str | None = None) -> str:
        """`message`, an error of one of this rank's communicators, with the
        ranks it names (ranks of the communicator that failed: `axis`'s, else
        the one that is aborted) as world ranks with their coordinates, "rank 3
        (dp=1, tp=0, pp=1)". Where several are aborted (a failure spreads), the
        one in which the message names this rank ("pycollectives: rank N:",
        "raised on rank N") by its rank there; unchanged if that is ambiguous."""
        failed = (
            [axis] if axis else [a for a in AXES if self.sizes[a] > 1 and self._comms[a].aborted]
        )
        if len(failed) > 1:
            me = re.search(r"raised on rank (\d+)\]|pycollectives: rank (\d+)\b", message)
            if me is not None:
                failed = [a for a in failed if self.coords[a] == int(me[1] or me[2])]
            if len(failed) != 1:
                return message
        if failed:
            ranks, axis = self.world_ranks(failed[0]), failed[0]
        elif self.world.aborted:
            ranks, axis = list(range(self.world.world_size)), ""
        else:
            return message

        def world(m: re.Match) -> str:
            r = int(m[1])
            return self.where(ranks[r]) if 0 <= r < len(ranks) else m[0]

        out = re.sub(r"\brank (\d+)\b(?! \(dp=)", world, message)
        if axis:
            legend = ", ".join(f"{g} = rank {w}" for g, w in enumerate(ranks))
            out += f" [ranks of the {axis} communicator of {self.where()}: {legend}]"
        return out

    def _unravel(self, rank: int) -> list[int]:
        out = []
        for axis in reversed(AXES):
            rank, c = divmod(rank, self.sizes[axis])
            out.append(c)
        return out[::-1]

    # -- recovery -------------------------------------------------------------------------
    def shrink(self, *, timeout: float | None = None) -> ParallelDims:
        """Collective over the surviving ranks of `world`, after a rank failed:
        revokes the sub-communicators and `world` (a survivor waiting in one of
        them, on a live peer, raises at once and comes here too), shrinks
        `world` (Communicator.shrink: the survivors, renumbered in order) and
        rebuilds the grid on it with split: for a pure data-parallel grid
        (tp = pp = 1), dp becomes the number of survivors (a grid where
        nobody failed keeps its sizes). Returns the new
        ParallelDims (whose `world` is the shrunk communicator: the caller
        closes it and the old `world`); this one's sub-communicators are closed.

        Raises, on every survivor alike, NeedsReplacement where a tensor- or
        pipeline-parallel group lost a member (naming each such group by its
        world ranks): those cannot go on short, recovery needs a replacement
        process (grow); CommunicatorAborted on a rank fenced out."""
        new = self._revoke_and_shrink("ParallelDims.shrink", timeout)
        failed = new.failed
        lost = {
            axis: sorted({tuple(self.group_of(r, axis)) for r in failed})
            for axis in ("tp", "pp")
            if self.sizes[axis] > 1 and failed
        }
        if lost:
            new.close()
            groups = {a: [list(g) for g in gs] for a, gs in lost.items()}
            named = "; ".join(
                f"the {a} group of world ranks {list(g)}" for a, gs in lost.items() for g in gs
            )
            raise NeedsReplacement(
                f"ParallelDims.shrink: rank {self.world.rank}: "
                + ", ".join(self.where(r) for r in failed)
                + f" failed, in a {_describe(self.sizes)} grid: {named} lost a member; a tensor- "
                "or pipeline-parallel group cannot go on short: recovery needs a replacement "
                "process in the lost place (ParallelDims.replace on the survivors: shrink and "
                "grow; ParallelDims.join in the newcomer; parallel3d.ElasticTrainer3D does both "
                "and moves the state), else restart from a checkpoint",
                failed,
                groups,
            )
        tp, pp = self.sizes["tp"], self.sizes["pp"]  # failures here: only dp lost ranks
        return ParallelDims(new, dp=new.world_size // (tp * pp), tp=tp, pp=pp)

    def replace(
        self,
        store: Any,
        *,
        timeout: float | None = None,
        prefix: str = "pycoll-grow",
        check: Callable[[tuple[int, ...]], None] | None = None,
    ) -> ParallelDims:
        """Collective over the surviving ranks of `world` and one replacement
        process per failed rank (each calls ParallelDims.join with the same
        `store`, `prefix` and sizes): revokes and shrinks as shrink() does,
        grows the survivors' communicator by the failed ranks
        (Communicator.grow) and rebuilds the grid on it with each newcomer in
        a failed rank's place (the first to join takes the lowest) and every
        survivor in its own: the new world's ranks, coordinates and groups are
        this grid's. `replaced` on the result names the newcomers' ranks (empty
        where nobody failed: the same grid, rebuilt). The caller closes the
        new `world` and this one's; the communicators in between are closed.
        `timeout` bounds the shrink and the wait for the newcomers.
        `check(failed)`, called on every survivor once the failed world ranks
        are known, before anyone waits for a newcomer, may raise to refuse the
        replacement (a lost rank's state is lost too): the shrunk
        communicator is closed, the newcomers waiting under `prefix` are told
        why (rendezvous.grow.refuse: their join raises GrowRefused with its
        message and its `failed`, else these failed ranks) and the error
        propagates.

        Raises CommunicatorAborted on a rank fenced out, what `check` raises,
        and grow's errors (CollectiveTimeout when the newcomers do not come in
        time; init's when one dies while they meet)."""
        shrunk = self._revoke_and_shrink("ParallelDims.replace", timeout)
        failed = tuple(shrunk.failed)
        if not failed:
            return self._regrid(shrunk, self.world.rank, self.sizes, ())
        if check is not None:
            try:
                check(failed)
            except BaseException as e:
                if shrunk.rank == 0:  # one survivor tells the newcomers, before it leaves
                    with contextlib.suppress(Exception):
                        lost = tuple(getattr(e, "failed", failed))
                        refuse(store, f"{type(e).__name__}: {e}", failed=lost, prefix=prefix)
                shrunk.close()
                raise
        try:
            grown = shrunk.grow(store, len(failed), timeout=timeout, prefix=prefix)
        finally:
            shrunk.close()
        # The newcomers learn their places, and the survivors' timeout (theirs: join's bound).
        places = torch.tensor([grown._c.default_timeout, *failed], dtype=torch.float64)
        grown.broadcast(places, 0)
        return self._regrid(grown, self.world.rank, self.sizes, failed)

    @classmethod
    def join(
        cls,
        store: Any,
        *,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        timeout: float = 600.0,
        prefix: str = "pycoll-grow",
    ) -> ParallelDims:
        """A replacement process's side of replace(): waits (up to `timeout`)
        for the survivors' grow (pycollectives.join), learns which failed
        rank's place it takes, and builds the grid (the same sizes as the
        survivors': a ParallelDims ValueError on every rank otherwise). Its
        `replaced` names every newcomer's rank. In a process that
        launcher.spawn(replace=N) started, it tells the launcher the place it
        took (launcher.took_place).

        Raises join's errors, and PyCollectivesError for a place out of range."""
        grown = join(store, timeout=timeout, prefix=prefix)
        new = grown.parent_ranks.count(-1)
        places = torch.empty(1 + new, dtype=torch.float64)
        grown.broadcast(places, 0)
        sent = places[1:].tolist()  # from another process: NaN, inf or 2.5 are no rank
        whole = all(math.isfinite(r) and r == int(r) for r in sent)
        failed = tuple(int(r) for r in sent) if whole else ()
        if (
            not whole
            or sorted(set(failed)) != list(failed)
            or not 0 <= failed[0] <= failed[-1] < grown.world_size
        ):
            grown.close()
            raise PyCollectivesError(
                f"ParallelDims.join: rank {grown.rank}: the survivors sent the places "
                f"{failed if whole else tuple(sent)}, not distinct ranks of a world of "
                f"{grown.world_size}"
            )
        if places[0] > 0:
            grown._c.set_default_timeout(float(places[0]))
        mine = failed[grown.rank - (grown.world_size - new)]
        took_place(mine)  # started by spawn(replace=N): the launcher names it by this place
        return cls._regrid(grown, mine, {"dp": dp, "tp": tp, "pp": pp}, failed)

    @staticmethod
    def _regrid(
        comm: Communicator, rank: int, sizes: dict[str, int], replaced: tuple[int, ...]
    ) -> ParallelDims:
        """The grid of `sizes` on `comm` renumbered so that this process is
        world rank `rank` (a split keyed by it; `comm` is closed)."""
        try:
            world = comm.split(0, key=rank)
        finally:
            comm.close()
        assert world is not None and world.rank == rank, (world, rank)
        dims = ParallelDims(world, dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"])
        dims.replaced = replaced
        return dims

    def _revoke_and_shrink(self, what: str, timeout: float | None) -> Communicator:
        """Revokes the sub-communicators and `world` (a survivor waiting in one
        of them, on a live peer, raises at once and comes here too), closes
        the sub-communicators and returns `world` shrunk to the survivors."""
        for c in [*self._comms.values(), self.world]:
            with contextlib.suppress(PyCollectivesError):  # closed: nothing pending to wake
                c.revoke(what)
        new = self.world.shrink(timeout=timeout)
        with warnings.catch_warnings():  # their failed pending operations: reported already
            warnings.simplefilter("ignore", RuntimeWarning)
            self.close()
        return new

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The world ranks of world rank `rank`'s `axis` group, in order."""
        coords = dict(zip(AXES, self._unravel(rank), strict=True))
        return [self.rank_of(**{**coords, axis: c}) for c in range(self.sizes[axis])]

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the sub-communicators (not `world`)."""
        for c in self._comms.values():
            c.close()

    def __enter__(self) -> ParallelDims:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = ", ".join(f"{a}_rank={self.coords[a]}" for a in NAMES)
        return f"ParallelDims({_describe(self.sizes)}; rank {self.world.rank}: {where})"


def _agree_on_sizes(comm: Communicator, requested: dict[str, Any]) -> dict[str, int]:
    """Gathers every rank's requested sizes and checks them, on every rank alike;
    returns the sizes with -1 resolved, or raises ValueError."""
    names = NAMES
    mine = torch.tensor([_as_size(requested[a]) for a in names], dtype=torch.int64)
    every = torch.empty(comm.world_size * len(names), dtype=torch.int64)
    comm.all_gather(every, mine)
    every = every.view(comm.world_size, len(names))
    who = f"ParallelDims: rank {comm.rank}"
    differ = [r for r in range(comm.world_size) if not torch.equal(every[r], every[0])]
    if differ:
        asked = "; ".join(
            f"rank {r}: " + _describe(dict(zip(names, every[r].tolist(), strict=True)))
            for r in [0, *differ]
        )
        raise ValueError(f"{who}: the ranks ask for different grids ({asked}); 0 = invalid")
    sizes = dict(zip(names, every[0].tolist(), strict=True))
    bad = [a for a in names if sizes[a] == 0]
    if bad:
        shown = ", ".join(f"{a}={requested[a]!r}" for a in bad)
        raise ValueError(f"{who}: {shown}: each size must be a positive int or -1 (infer)")
    inferred = [a for a in names if sizes[a] == -1]
    known = math.prod(s for s in sizes.values() if s > 0)
    if len(inferred) > 1:
        raise ValueError(f"{who}: {_describe(sizes)}: at most one size may be -1")
    if inferred:
        if comm.world_size % known:
            raise ValueError(
                f"{who}: {inferred[0]}=-1: the world size {comm.world_size} is not divisible by "
                + " x ".join(f"{a}={sizes[a]}" for a in names if sizes[a] > 0)
                + f" = {known}"
            )
        sizes[inferred[0]] = comm.world_size // known
    product = math.prod(sizes.values())
    if product != comm.world_size:
        factors = " x ".join(f"{a}={sizes[a]}" for a in names)
        raise ValueError(f"{who}: {factors} = {product}, but the world size is {comm.world_size}")
    return {a: sizes[a] for a in AXES}
