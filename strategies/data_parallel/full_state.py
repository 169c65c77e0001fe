"""The full state of sharded state kept in buddy copies (redundancy.py),
rebuilt on the survivors of a failure from their own copies and the dead
ranks' buddies' (gather_full_state), or from the shards' replicas
(redundancy.gather_from_replicas: both lay it out with `assemble`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pycollectives import Communicator

from .state_layout import Entry, FullState

__all__ = ["CommittedCopy", "assemble", "gather_full_state"]


class CommittedCopy(Protocol):
    """What gather_full_state reads of a BuddyCopy (redundancy.py)."""

    world_size: int  # of the communicator it was made on
    step: int  # the committed copy's step (-1: none)
    buddies: list[int]  # buddies[r]: the rank holding rank r's copy
    entries: list[Entry]  # the packed layout, alike on every rank
    local: torch.Tensor  # this rank's state (uint8)
    remote: torch.Tensor  # its predecessor's


def _view(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def gather_full_state(
    copy: CommittedCopy,
    comm: Communicator,
    survivors: tuple[int, ...],
    keep: Callable[[Entry], tuple[int, int] | None] | None = None,
) -> FullState:
    """Collective over `comm` (the survivors; `survivors[i]` is new rank i's
    rank in copy.comm, as Communicator.shrink's parent_ranks): the full state
    of every flat parameter as of copy.step, by (flat index, key, slot), with its
    Entry: each sharded entry the concatenation of every old rank's block (the
    flat parameter's padded length at the old size), each scalar this rank's
    own, in host memory. A dead rank's block comes from its buddy's copy.

    `keep` (optional, alike on every survivor): for each sharded entry, the
    [start, end) of its full tensor this rank keeps (None: all of it); the
    entries are then gathered one at a time, so that a survivor holds at once
    only what it keeps and one entry's full tensor, not every survivor's copy
    and the whole full state (24 bytes a parameter under fp32 AdamW).

    Raises RuntimeError on every survivor alike when a rank and its buddy both
    failed (that shard is lost), or no copy was ever committed; and the
    communicator's errors."""
    old_n, me = copy.world_size, comm.rank
    where = {old: new for new, old in enumerate(survivors)}
    dead = [r for r in range(old_n) if r not in where]
    lost = [r for r in dead if copy.buddies[r] not in where]
    if lost or copy.step < 0:
        buddies = ", ".join(f"rank {copy.buddies[r]}" for r in lost)
        why = (
            f"the shards of ranks {lost} are lost: each and its buddy ({buddies}) failed"
            if lost
            else "no copy was committed"
        )
        raise RuntimeError(
            f"gather_full_state: rank {me}: {why}; restore the job from a checkpoint"
        )
    size = torch.tensor([copy.local.numel()], dtype=torch.int64)
    sizes = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(sizes, size)
    if len(set(sizes.tolist())) != 1:  # committed copies always agree; a guard against misuse
        raise RuntimeError(
            f"gather_full_state: rank {me}: the survivors' copies differ in size "
            f"({sizes.tolist()} bytes): they were committed at different steps"
        )
    if keep is not None:
        return _gather_kept(copy, comm, survivors, keep)
    nb = int(sizes[0])
    own = torch.empty(comm.world_size * nb, dtype=torch.uint8)
    comm.all_gather(own, copy.local)
    blocks: dict[int, torch.Tensor] = {
        old: own[new * nb : (new + 1) * nb] for new, old in enumerate(survivors)
    }
    for r in dead:  # from its buddy, which received it at the last refresh
        root = where[copy.buddies[r]]
        buf = copy.remote if me == root else torch.empty(nb, dtype=torch.uint8)
        comm.broadcast(buf, root)
        blocks[r] = buf
    return assemble(copy.entries, [blocks[r] for r in range(old_n)], copy.local)


def _gather_kept(
    copy: CommittedCopy,
    comm: Communicator,
    survivors: tuple[int, ...],
    keep: Callable[[Entry], tuple[int, int] | None],
) -> FullState:
    """gather_full_state entry by entry: of each sharded entry, the range
    keep(entry) of its full tensor (one all-gather of the survivors' blocks,
    one broadcast from each dead rank's buddy)."""
    out: FullState = {}
    for e in copy.entries:
        key = (e.flat, e.key, e.slot)
        if not e.sharded:
            out[key] = (_view(copy.local, e).clone(), e)
            continue
        span = keep(e)
        whole = span is None
        got = _whole(copy, comm, survivors, e) if whole else _range(copy, comm, survivors, e, span)
        out[key] = (got, e)
    return out


def _block(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes]


def _dead(copy: CommittedCopy, survivors: tuple[int, ...]) -> list[tuple[int, int]]:
    """(old rank, new rank of its buddy) of every dead rank."""
    where = {old: new for new, old in enumerate(survivors)}
    return [(r, where[copy.buddies[r]]) for r in range(copy.world_size) if r not in where]


def _whole(
    copy: CommittedCopy, comm: Communicator, survivors: tuple[int, ...], e: Entry
) -> torch.Tensor:
    """Entry e's full tensor, gathered in place: the survivors' blocks
    all-gathered into its start, each moved to its old rank's place, the dead
    ranks' broadcast into theirs (no buffer besides the result)."""
    nb, n = e.nbytes, comm.world_size
    whole = torch.empty(copy.world_size * nb, dtype=torch.uint8)
    comm.all_gather(whole[: n * nb], _block(copy.local, e))
    # New rank i's block to old rank survivors[i] >= i's place, from the last:
    # no block is overwritten before it moved.
    for i in reversed(range(n)):
        if survivors[i] != i:
            r = survivors[i]
            whole[r * nb : (r + 1) * nb].copy_(whole[i * nb : (i + 1) * nb])
    for r, root in _dead(copy, survivors):  # from its buddy's copy
        place = whole[r * nb : (r + 1) * nb]
        if comm.rank == root:
            place.copy_(_block(copy.remote, e))
        comm.broadcast(place, root)
    return whole.view(e.dtype)


def _range(
    copy: CommittedCopy,
    comm: Communicator,
    survivors: tuple[int, ...],
    e: Entry,
    span: tuple[int, int],
) -> torch.Tensor:
    """Elements [span) of entry e's full tensor (clipped to its length): every
    rank's span all-gathered, then, in one batch of sends and receives, each
    old block's holder (the survivor itself, a dead rank's buddy) sends each
    rank only the part of the block its span overlaps: a rank receives about
    its span, not every block (8/N' bytes a parameter of AdamW's moments
    instead of 8)."""
    n, size = comm.world_size, e.dtype.itemsize
    per = e.nbytes // size
    length = copy.world_size * per
    spans = torch.empty(2 * n, dtype=torch.int64)
    lo, hi = span[0], min(span[1], length)
    comm.all_gather(spans, torch.tensor([lo, hi], dtype=torch.int64))
    ranges = [(int(spans[2 * j]), int(spans[2 * j + 1])) for j in range(n)]
    holder = {old: new for new, old in enumerate(survivors)}
    block = {survivors[comm.rank]: _block(copy.local, e)}
    for r, root in _dead(copy, survivors):  # from its buddy's copy
        holder[r] = root
        if root == comm.rank:
            block[r] = _block(copy.remote, e)
    kept = torch.empty(max(hi - lo, 0), dtype=e.dtype)
    into = kept.view(torch.uint8)
    ops: list[tuple[str, torch.Tensor, int]] = []
    for r in range(copy.world_size):  # alike on both sides of each pair: by old block
        for j, (jlo, jhi) in enumerate(ranges):
            a, b = max(jlo, r * per), min(jhi, (r + 1) * per)
            if a >= b:
                continue
            if holder[r] == comm.rank:
                ops.append(("send", block[r][(a - r * per) * size : (b - r * per) * size], j))
            if j == comm.rank:
                ops.append(("recv", into[(a - lo) * size : (b - lo) * size], holder[r]))
    if ops:
        comm.batch_p2p(ops)
    return kept


def assemble(entries: list[Entry], blocks: list[torch.Tensor], own: torch.Tensor) -> FullState:
    """The full state from every shard's packed bytes (`blocks`, by shard
    index) and this rank's (`own`, for the scalars)."""
    out = {}
    for e in entries:
        if e.sharded:
            out[(e.flat, e.key, e.slot)] = (torch.cat([_view(b, e) for b in blocks]), e)
        else:
            out[(e.flat, e.key, e.slot)] = (_view(own, e).clone(), e)
    return out
