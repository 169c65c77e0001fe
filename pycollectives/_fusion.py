"""Fusing tensors into a few flat buffers, below the communicator: which
tensors share a bucket (one dtype each, up to a cap), the buckets with the
tensors' views into them, and the Work of an all-reduce over them. Used by
Communicator.all_reduce_coalesced and, above the communicator, by
bucketing.BucketSet; the buffers come from the `alloc` the caller passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

MiB = 1 << 20


class Bucket:
    """One flat buffer of one dtype and the views of the tensors placed in it."""

    __slots__ = ("index", "buffer", "members", "views")

    def __init__(self, index: int, buffer: torch.Tensor, members: list[int], views: list) -> None:
        self.index = index
        self.buffer = buffer  # flat, in a symmetric window
        self.members = members  # positions in the BucketSet's tensor list
        self.views = views  # views of `buffer`, in the members' shapes

    def __repr__(self) -> str:
        return (
            f"<Bucket {self.index}: {len(self.members)} tensors, {self.buffer.numel()} x "
            f"{self.buffer.dtype}>"
        )


def spec(t: Any, i: int, rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of tensors[i], a tensor or such a pair; raises ValueError
    naming it and the rank otherwise."""
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    if isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], torch.dtype):
        return tuple(t[0]), t[1]
    raise ValueError(
        f"pycollectives: rank {rank}: BucketSet: tensors[{i}]={t!r} is neither a tensor nor a "
        "(shape, dtype) pair"
    )


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_buckets(
    tensors: Sequence[Any],
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    alloc: Callable[[int, torch.dtype], torch.Tensor],
    rank: int,
) -> tuple[list, list[Bucket], list[tuple[int, int]]]:
    """Assigns `tensors` (or (shape, dtype) pairs) to buckets in the order given
    (one open bucket per dtype; a bucket closes when the next tensor would take
    it past its cap, the first bucket's being `first_bucket_cap_mb`) and
    allocates each with alloc(numel, dtype). Returns the (shape, dtype) specs,
    the buckets and, per spec, (bucket, position). Raises ValueError naming
    `rank` for a cap that is not > 0 or an entry that is neither."""
    if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
        raise ValueError(
            f"pycollectives: rank {rank}: BucketSet: bucket_cap_mb={bucket_cap_mb} and "
            f"first_bucket_cap_mb={first_bucket_cap_mb} must be > 0"
        )
    specs = [spec(t, i, rank) for i, t in enumerate(tensors)]
    plans: list[tuple[torch.dtype, list[int], int]] = []  # (dtype, members, numel)
    open_: dict[torch.dtype, int] = {}
    for i, (shape, dtype) in enumerate(specs):
        n = numel(shape)
        b = open_.get(dtype)
        if b is not None:
            _, members, size = plans[b]
            cap = (first_bucket_cap_mb if b == 0 else bucket_cap_mb) * MiB
            if members and (size + n) * dtype.itemsize > cap:
                b = None
        if b is None:
            b = len(plans)
            plans.append((dtype, [], 0))
            open_[dtype] = b
        dt, members, size = plans[b]
        members.append(i)
        plans[b] = (dt, members, size + n)
    buckets: list[Bucket] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(specs)
    for b, (dtype, members, total) in enumerate(plans):
        buf = alloc(total, dtype)
        views, off = [], 0
        for pos, i in enumerate(members):
            shape = specs[i][0]
            n = numel(shape)
            views.append(buf[off : off + n].view(shape))
            where[i] = (b, pos)
            off += n
        buckets.append(Bucket(b, buf, members, views))
    return specs, buckets, where


class CoalescedWork:
    """Work of a coalesced all-reduce: when wait() returns, the results are in
    the caller's tensors."""

    def __init__(self, works: list[Any], copy_out: Any) -> None:
        self._works = works
        self._copy_out = copy_out

    def wait(self, timeout: Any = None) -> bool:
        """Waits for every bucket, then copies the results into the tensors.
        Returns False if `timeout` passes first; re-raises an operation's error."""
        for w in self._works:
            if not w.wait(timeout):
                return False
        if self._copy_out is not None:
            self._copy_out()
            self._copy_out = None
        return True

    def is_completed(self) -> bool:
        """True once every bucket's all-reduce finished (wait() still copies out)."""
        return all(w.is_completed() for w in self._works)

    def exception(self) -> BaseException | None:
        """The first error among the buckets, if any completed with one."""
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None
