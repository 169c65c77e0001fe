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

from ._fusion import Bucket, CoalescedWork, make_buckets
from .communicator import Communicator, ReduceOp, Work

__all__ = ["Bucket", "BucketSet", "CoalescedWork", "all_reduce_coalesced"]

DEFAULT_BUCKET_CAP_MB = 25.0  # as torch DDP
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch DDP's first bucket: communication starts early


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
        self.comm = comm
        if torch.device(device).type == "cpu":
            alloc = comm.alloc_shared
        else:  # device memory: the CUDA transport registers its own staging
            alloc = lambda n, dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
        self.specs, self.buckets, self._where = make_buckets(
            tensors, bucket_cap_mb, first_bucket_cap_mb, alloc, comm.rank
        )

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


def all_reduce_coalesced(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    *,
    async_op: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> CoalescedWork | None:
    """Communicator.all_reduce_coalesced: all-reduces every tensor of `tensors`
    in place, fused into cached buckets of at most `bucket_cap_mb` per dtype.

    Raises ValueError for a tensor that is not a contiguous CPU tensor.
    """
    return comm.all_reduce_coalesced(tensors, op, async_op=async_op, bucket_cap_mb=bucket_cap_mb)
