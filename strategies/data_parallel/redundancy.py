"""Redundancy for sharded state: an in-memory checkpoint of each rank's shard,
kept on the rank itself and on its buddy (docs/recovery.md, "Sharded state").

Under ZeRO the master parameters and the optimizer state of a shard live on one
rank only. `BuddyCopy` keeps, in host memory, a copy of this rank's shard state
(its master shards, frozen ones included, and the optimizer state of its
trainable shards) and a copy of one other rank's, which that rank sends it:
every shard is held twice, on its rank and on its buddy. Which rank is whose
buddy is a permutation of the ranks (buddies.py): rank r + 1 on one host;
across hosts a rank on another host, so that losing a whole host leaves every
lost shard's copy on a survivor. A refresh sends the state straight from its
tensors to the buddy and receives its predecessor's (`prev`, the rank whose
buddy this one is) into a staging buffer; it becomes the copy only when
`commit` is called, after every rank agreed that it succeeded (then each rank
also copies its own state into its own copy): a failure during a refresh
leaves the previous copy whole on every rank. Host memory: 3 S, S this rank's
shard state in bytes (its copy, the predecessor's and the staging buffer).
The own copy is what lets the survivors roll back alike: after a failure
every rank, not only the dead one's buddy, returns to the copy's step.

What is copied comes from a `ShardSource`: the packed layout of a rank's
shard state (entries end to end, alike on every rank: state_layout.py) and
where each of a rank's tensors goes in it. `ZeroShards` describes a
ZeroOptimizer's (one tensor per entry); elastic_fsdp.py's FSDPShards a
fully_shard model's, whose torch optimizer keeps its state per parameter
piece (pieces placed at their offset in the shard, so every rank's packed
state has the same entries). `TensorState` is any other state (a pipeline
stage's parameters and their optimizer state: parallel3d/replacement.py),
whose layout may differ from rank to rank: a refresh then first tells the
buddy this rank's layout where it changed since the last commit
(state_layout.LayoutExchange: checked on arrival, and bounded by the
capacity the sender declared at setup), and the buddy keeps it as
`remote_entries`.

After a failure, `gather_full_state` rebuilds, from the survivors' own copies
and the buddies' copies of the dead ranks' shards, the full (unsharded) flat
state of every flat parameter as of the copy's step; ElasticZero
(elastic_sharded.py) and ElasticFSDP (elastic_fsdp.py) re-shard it to the
survivors. A shard is lost only when a rank and its buddy both fail before the
next refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pycollectives import Communicator

from .buddies import buddy_ranks, check_placement, survives_host_loss
from .full_state import assemble, gather_full_state
from .state_layout import (
    Entry,
    FullState,
    LayoutExchange,
    StateTensor,
    decode_entries,
    encode_entries,
    layout_of,
    packed_size,
)

__all__ = [
    "BuddyCopy",
    "Entry",
    "FullState",
    "ShardSource",
    "StateTensor",
    "TensorState",
    "ZeroShards",
    "decode_entries",
    "encode_entries",
    "gather_from_replicas",
    "gather_full_state",
    "pack",
]


class ShardSource(Protocol):
    """What BuddyCopy copies: a rank's shard state, packed."""

    comm: Communicator

    def layout(self) -> tuple[list[Entry], list[torch.Tensor]]:
        """The packed entries (end to end, alike on every rank) and this
        rank's tensors, in the order `place` places them."""
        ...

    def place(self, entries: list[Entry], rank: int) -> list[tuple[int, int]]:
        """(byte offset, bytes) in the packed state of each of rank `rank`'s
        tensors, in the order layout() lists this rank's."""
        ...


def _shard_tensors(zero: Any) -> list[StateTensor]:
    """(flat index, key, tensor, sharded) of a ZeroOptimizer's shard state."""
    flats = [f for u in zero.engine.units for f in u.flats]
    out = [(i, "param", f.shard, True) for i, f in enumerate(flats)]
    index = {id(f): i for i, f in enumerate(flats)}
    for f in zero._flats:  # noqa: SLF001 - the trainable flats, as the optimizer steps them
        state = zero.optimizer.state.get(f.opt_param, {})
        for key in sorted(state):
            t = state[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"BuddyCopy: rank {zero.comm.rank}: optimizer state {key!r} is a "
                    f"{type(t).__name__}, not a tensor"
                )
            sharded = t.dim() == 1 and t.numel() == f.layout.shard_numel
            out.append((index[id(f)], key, t, sharded))
    return out


class ZeroShards:
    """A ZeroOptimizer's shard state as a ShardSource: its master shards
    (frozen ones included) and the optimizer state of its trainable shards,
    one tensor per entry, alike on every rank."""

    def __init__(self, zero: Any) -> None:
        self.zero, self.comm = zero, zero.comm

    def layout(self) -> tuple[list[Entry], list[torch.Tensor]]:
        tensors = _shard_tensors(self.zero)
        return layout_of(tensors)

    def place(self, entries: list[Entry], rank: int) -> list[tuple[int, int]]:
        return [(e.offset, e.nbytes) for e in entries]


class TensorState:
    """Any tensors as a ShardSource (`tensors()`: their (index, key, tensor,
    sharded), packed end to end in that order) whose layout may differ from
    rank to rank: BuddyCopy then exchanges the layouts too
    (state_layout.LayoutExchange, bounded by `capacity`)."""

    uniform = False

    def __init__(
        self,
        comm: Communicator,
        tensors: Callable[[], list[StateTensor]],
        capacity: int | None = None,
    ) -> None:
        self.comm, self._tensors, self.capacity = comm, tensors, capacity

    def layout(self) -> tuple[list[Entry], list[torch.Tensor]]:
        tensors = self._tensors()
        return layout_of(tensors)

    def place(self, entries: list[Entry], rank: int) -> list[tuple[int, int]]:
        return [(e.offset, e.nbytes) for e in entries]


class BuddyCopy:
    """This rank's shard state (`source`: a ShardSource, or a ZeroOptimizer
    for its ZeroShards), copied into host memory here and on its buddy rank
    (`buddy`), which in turn keeps the copy of one rank (`prev`).

    `placement` (buddies.py): "auto" (the default: rank + 1 on one host;
    across hosts every buddy on another host where no host holds more than
    half of the ranks, else as many as can be), "hosts" (every buddy on
    another host, or ValueError naming this rank and the operation) or "ring"
    (rank + 1). Every rank must pass the same: the first refresh checks it.

    Any other state: BuddyCopy(comm=comm, tensors=fn), fn() returning the
    (index, key, tensor, sharded) of the tensors to copy (a TensorState:
    the layout may differ from rank to rank, and a refresh first tells the
    buddy this rank's where it changed since the last commit: one more small
    exchange; the buddy keeps it as `remote_entries`). `capacity` bounds the
    bytes that state may grow to (default: state_layout.default_capacity of
    its layout at the first refresh); a peer announcing more is refused.

    `step` is the training step the committed copy holds (set by commit);
    `nbytes` the host bytes held (the copies and the staging buffers).
    """

    def __init__(
        self,
        source: Any = None,
        *,
        comm: Communicator | None = None,
        tensors: Callable[[], list[StateTensor]] | None = None,
        capacity: int | None = None,
        placement: str = "auto",
    ) -> None:
        if (source is None) == (tensors is None) or (tensors is not None and comm is None):
            raise ValueError(
                "BuddyCopy: pass a ShardSource or a ZeroOptimizer, or comm= and tensors="
            )
        if tensors is not None:
            source = TensorState(comm, tensors, capacity)  # type: ignore[arg-type]
        self.source: ShardSource = source if hasattr(source, "place") else ZeroShards(source)
        self._uniform = getattr(self.source, "uniform", True)  # every rank's layout is this one's
        self.comm: Communicator = source.comm
        self.rank, self.world_size = self.comm.rank, self.comm.world_size  # (outlive the comm)
        hosts = self.comm.hosts
        # buddies[r]: the rank holding rank r's copy, the same on every rank
        self.buddies = buddy_ranks(hosts, placement, f"BuddyCopy: rank {self.rank}")
        self.prev = self.buddies.index(self.rank)  # the rank whose copy this one holds
        self.survives_host_loss = survives_host_loss(hosts, self.buddies)
        self._checked = self.world_size == 1  # the ranks' placements compared (first refresh)
        self._layouts = (
            None
            if self._uniform or self.world_size == 1
            else LayoutExchange(
                self.comm, self.buddy, self.prev, getattr(self.source, "capacity", None),
                "BuddyCopy.refresh",
            )
        )  # fmt: skip
        self.step = -1  # nothing committed yet
        self.entries: list[Entry] = []
        self.remote_entries: list[Entry] = []  # the layout of `remote`
        self.local = torch.empty(0, dtype=torch.uint8)  # this rank's state at `step`
        self.remote = torch.empty(0, dtype=torch.uint8)  # prev's state at `step`
        self._staging = torch.empty(0, dtype=torch.uint8)  # what the next refresh receives into
        # a refresh not yet committed: (staging, entries, tensors, the predecessor's entries)
        self._staged: tuple[torch.Tensor, list[Entry], list[torch.Tensor], list[Entry]] | None
        self._staged = None
        self._placed: list[tuple[int, int]] = []  # this rank's tensors in the staged layout

    @property
    def buddy(self) -> int:
        """The rank that holds this rank's copy."""
        return self.buddies[self.rank]

    @property
    def nbytes(self) -> int:
        """Host bytes held: this rank's copy, the predecessor's and the staging buffer."""
        staged = self._staged[0] if self._staged else self._staging
        return self.local.numel() + self.remote.numel() + staged.numel()

    def refresh(self) -> None:
        """Collective (point to point with the buddy and prev; the first one
        also checks the ranks' placements, an all-gather): sends this rank's
        state as it is now to the buddy, straight from its tensors, and
        receives prev's into a staging buffer; the committed copy is untouched
        until commit(). Raises the communicator's errors (a failed rank),
        ValueError where the ranks' placements differ, and, for a TensorState,
        LayoutExchange's errors (a peer's layout refused, the communicator
        revoked first)."""
        if not self._checked:
            check_placement(self.comm, self.buddies, "BuddyCopy.refresh")
            self._checked = True
        entries, tensors = self.source.layout()
        theirs = entries
        if self._layouts is not None:
            theirs = self._layouts.swap(entries, entries != self.entries, self.remote_entries)
        off = packed_size(theirs)
        staging = self._staging if self._staging.numel() == off else None
        if staging is None:  # zeros: bytes no tensor is placed in (gaps between pieces)
            staging = torch.zeros(off, dtype=torch.uint8)
        self._staged = (staging, entries, tensors, theirs)
        self._placed = self.source.place(entries, self.rank)
        if self.world_size == 1:  # no buddy: the local copy only
            return
        placed = self.source.place(theirs, self.prev)
        ops = [("send", _bytes(t), self.buddy) for t in tensors if t.numel()]
        ops += [("recv", staging[o : o + nb], self.prev) for o, nb in placed if nb]
        self.comm.batch_p2p(ops)

    def commit(self, step: int) -> None:
        """The refresh becomes the copy of training step `step` (call on every
        rank once all agreed that the refresh succeeded, before the state
        changes): the received staging buffer becomes the predecessor's copy
        (the old one the next staging buffer), and this rank's state is
        copied into its own copy."""
        if self._staged is None:
            raise RuntimeError(f"BuddyCopy: rank {self.rank}: commit without a refresh")
        staging, entries, tensors, theirs = self._staged
        self._staged = None
        nbytes = packed_size(entries)
        if self.local.numel() != nbytes:
            self.local = torch.zeros(nbytes, dtype=torch.uint8)
        for (o, nb), t in zip(self._placed, tensors, strict=True):
            if nb:
                self.local[o : o + nb].copy_(_bytes(t))
        if self.world_size > 1:
            self._staging, self.remote = self.remote, staging
            self.remote_entries = theirs
        self.entries, self.step = entries, step

    def discard(self, keep_staging: bool = True) -> None:
        """Forgets a refresh that did not commit; its staging buffer is kept
        for the next refresh, or freed with keep_staging=False (after a
        failure: the survivors only read the committed copy, then replace it)."""
        if self._staged is not None:
            self._staging = self._staged[0]
        self._staged = None
        if not keep_staging:
            self._staging = torch.empty(0, dtype=torch.uint8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8 (for CUDA tensors: a host copy)."""
    flat = t.detach().reshape(-1)
    return (flat if flat.device.type == "cpu" else flat.cpu()).view(torch.uint8)


def pack(source: Any) -> tuple[torch.Tensor, list[Entry]]:
    """A shard state now (a ShardSource, or a ZeroOptimizer), packed into
    host bytes, and its entries."""
    src: ShardSource = source if hasattr(source, "place") else ZeroShards(source)
    entries, tensors = src.layout()
    buf = torch.zeros(packed_size(entries), dtype=torch.uint8)
    for (o, nb), t in zip(src.place(entries, src.comm.rank), tensors, strict=True):
        if nb:
            buf[o : o + nb].copy_(_bytes(t))
    return buf, entries


def gather_from_replicas(
    zero: Any, comm: Communicator, survivors: tuple[int, ...], dp_shard: int, world_size: int
) -> FullState:
    """Collective over `comm` (the survivors of a job of `world_size` ranks
    that sharded `zero`'s state over groups of `dp_shard` consecutive ranks
    and replicated it across the groups, as HSDP): the full state of every
    flat parameter as it is now, as gather_full_state returns it. Shard s
    comes from the first survivor holding it (old rank g * dp_shard + s).

    Raises RuntimeError on every survivor alike when every replica of a
    shard failed; and the communicator's errors."""
    where = {old: new for new, old in enumerate(survivors)}
    holders = [
        [where[r] for r in range(s, world_size, dp_shard) if r in where] for s in range(dp_shard)
    ]
    lost = [s for s, h in enumerate(holders) if not h]
    if lost:
        raise RuntimeError(
            f"gather_from_replicas: rank {comm.rank}: every replica of shards {lost} failed; "
            "restore the job from a checkpoint"
        )
    own, entries = pack(zero)
    nb = own.numel()
    every = torch.empty(comm.world_size * nb, dtype=torch.uint8)
    comm.all_gather(every, own)
    blocks = [every[h[0] * nb : (h[0] + 1) * nb] for h in holders]
    return assemble(entries, blocks, own)
