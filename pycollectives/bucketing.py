"""Bucketing: many tensors fused into a few flat buffers, each all-reduced as
one operation.

The buffers are symmetric shared-memory windows owned by the communicator
(Communicator.alloc_shared), so a bucket's all-reduce runs in place across the
ranks' buffers with no copy through the transport. The tensors become views
into the buckets: write into the views (DDP points gradients at them) and the
reduction needs no copy at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .communicator import Communicator, ReduceOp, Work

MiB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25.0  # as torch DDP
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch DDP's first bucket: communication starts early


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


class BucketSet:
    """Assigns tensors (or (shape, dtype) specs) to buckets in the order given
    and allocates the buckets on `comm`.

    A bucket holds tensors of one dtype up to `bucket_cap_mb` (a larger tensor
    gets a bucket of its own); the first bucket is capped at
    `first_bucket_cap_mb`, as torch DDP does so that the first all-reduce
    starts early in backward. Collective: every rank must pass the same specs.

    CPU buckets live in symmetric shared memory; on another `device` they are
    plain device tensors.

    Raises ValueError for a non-positive cap or an empty spec list entry that is
    neither a tensor nor a (shape, dtype) pair.
    """

    def __init__(
        self,
        comm: Communicator,
        tensors: Sequence[Any],
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        device: torch.device | str = "cpu",
    ) -> None:
        if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
            raise ValueError(
                f"pycollectives: rank {comm.rank}: BucketSet: bucket_cap_mb={bucket_cap_mb} and "
                f"first_bucket_cap_mb={first_bucket_cap_mb} must be > 0"
            )
        self.comm = comm
        specs = [_spec(t, i, comm.rank) for i, t in enumerate(tensors)]
        self.specs = specs
        # Assignment: one open bucket per dtype; a bucket closes when the next
        # tensor would take it past its cap.
        plans: list[tuple[torch.dtype, list[int], int]] = []  # (dtype, members, numel)
        open_: dict[torch.dtype, int] = {}
        for i, (shape, dtype) in enumerate(specs):
            numel = _numel(shape)
            b = open_.get(dtype)
            if b is not None:
                _, members, size = plans[b]
                cap = (first_bucket_cap_mb if b == 0 else bucket_cap_mb) * MiB
                if members and (size + numel) * dtype.itemsize > cap:
                    b = None
            if b is None:
                b = len(plans)
                plans.append((dtype, [], 0))
                open_[dtype] = b
            dt, members, size = plans[b]
            members.append(i)
            plans[b] = (dt, members, size + numel)
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * len(specs)  # (bucket, position)
        for b, (dtype, members, numel) in enumerate(plans):
            if torch.device(device).type == "cpu":
                buf = comm.alloc_shared(numel, dtype)
            else:  # device memory: the CUDA transport registers its own staging
                buf = torch.zeros(numel, dtype=dtype, device=device)
            views, off = [], 0
            for pos, i in enumerate(members):
                shape = specs[i][0]
                n = _numel(shape)
                views.append(buf[off : off + n].view(shape))
                self._where[i] = (b, pos)
                off += n
            self.buckets.append(Bucket(b, buf, members, views))

    def view(self, i: int) -> torch.Tensor:
        """The view of tensor i (in the order given) inside its bucket."""
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    def bucket_of(self, i: int) -> int:
        """The index of the bucket holding tensor i."""
        return self._where[i][0]

    def all_reduce(
        self, bucket: int, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = True
    ) -> Work | None:
        """All-reduces bucket `bucket` in place (asynchronously by default).
        Buckets complete in the order they are launched."""
        return self.comm.all_reduce(self.buckets[bucket].buffer, op, async_op=async_op)

    def __len__(self) -> int:
        return len(self.buckets)


class CoalescedWork:
    """Work of a coalesced all-reduce: when wait() returns, the results are in
    the caller's tensors."""

    def __init__(self, works: list[Work], copy_out: Any) -> None:
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


def all_reduce_coalesced(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    *,
    async_op: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> CoalescedWork | None:
    """All-reduces every tensor of `tensors` in place, fused into buckets of at
    most `bucket_cap_mb` per dtype: copies in, one all-reduce per bucket, copies
    out. The buckets are cached on the communicator by the list's shapes and
    dtypes, so a training loop allocates them once. Collective: every rank
    passes the same shapes and dtypes.

    Raises ValueError for a tensor that is not a contiguous CPU tensor.
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"pycollectives: rank {comm.rank}: all_reduce_coalesced: tensors[{i}] must be a "
                "contiguous CPU torch.Tensor"
            )
    key = (tuple((tuple(t.shape), t.dtype) for t in tensors), float(bucket_cap_mb))
    cache = comm._coalesced_buckets
    bs = cache.get(key)
    if bs is None:
        bs = cache[key] = BucketSet(
            comm, tensors, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb
        )
    with torch.inference_mode():  # outside autograd (Parameters), as the copies out
        for i, t in enumerate(tensors):
            bs.view(i).copy_(t)
    works = [bs.all_reduce(b, op, async_op=True) for b in range(len(bs))]

    def copy_out() -> None:  # inference tensors too, whatever thread or mode waits
        with torch.inference_mode():
            for i, t in enumerate(tensors):
                t.copy_(bs.view(i))

    work = CoalescedWork(works, copy_out)
    if async_op:
        return work
    work.wait()
    return None


def _spec(t: Any, i: int, rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    if isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], torch.dtype):
        return tuple(t[0]), t[1]
    raise ValueError(
        f"pycollectives: rank {rank}: BucketSet: tensors[{i}]={t!r} is neither a tensor nor a "
        "(shape, dtype) pair"
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
