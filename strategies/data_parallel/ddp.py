"""Data parallelism on pycollectives: gradients averaged across ranks in
buckets, each bucket's all-reduce launched the moment its last gradient is
ready, so communication overlaps the rest of backward.

Like torch.nn.parallel.DistributedDataParallel, but every byte moves through
pycollectives (never torch.distributed). CPU gradients are bucketed in
symmetric shared memory, where the all-reduce runs in place across the ranks'
buckets.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator, ReduceOp, Work
from pycollectives.bucketing import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    BucketSet,
)

from ..autograd_threads import autograd_comm

__all__ = ["CompressionHook", "DistributedDataParallel"]


class CompressionHook:
    """A communication hook that all-reduces each bucket in a narrower dtype
    (torch.float16 or torch.bfloat16) and widens the result back: half the
    bytes on the wire for a rounding of the gradients. Like torch's
    fp16_compress_hook, it divides by the world size before the sum so that
    float16 does not overflow."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CompressionHook: dtype={dtype} must be float16 or bfloat16")
        self.dtype = dtype
        self._shadow: list[torch.Tensor] = []

    def setup(self, comm: Communicator, buckets: BucketSet) -> None:
        """Allocates one compressed buffer per bucket (collective)."""
        self._shadow = [
            comm.alloc_shared(b.buffer.numel(), self.dtype)
            if b.buffer.device.type == "cpu"
            else torch.empty(b.buffer.numel(), dtype=self.dtype, device=b.buffer.device)
            for b in buckets.buckets
        ]

    def launch(self, comm: Communicator, index: int, buffer: torch.Tensor) -> Work | None:
        """Starts the all-reduce of bucket `index` (whose data is `buffer`)."""
        shadow = self._shadow[index]
        shadow.copy_(buffer)
        shadow.div_(comm.world_size)
        return comm.all_reduce(shadow, ReduceOp.SUM, async_op=True)

    def finish(self, index: int, buffer: torch.Tensor) -> None:
        """Writes the reduced result of bucket `index` back into `buffer`."""
        buffer.copy_(self._shadow[index])


class DistributedDataParallel(nn.Module):
    """Wraps `module` for data-parallel training over `comm`.

    At construction, checks that every rank holds a model with the same
    parameter shapes and dtypes (ValueError on every rank otherwise) and
    broadcasts parameters and buffers from rank 0. During backward, a hook on
    each parameter copies its gradient into its bucket (or finds it already
    there with gradient_as_bucket_view); a bucket's all-reduce (average) starts
    as soon as its last gradient is ready, buckets in reverse parameter order
    and always in the same order on every rank. An autograd callback at the
    end of backward waits for every bucket, so the optimizer sees averaged
    gradients with no extra call.

    Args:
        module: the model; its parameters must all be on one device.
        comm: the pycollectives communicator of the data-parallel group.
        bucket_cap_mb / first_bucket_cap_mb: bucket sizes (torch DDP's defaults).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics)
            at every forward.
        find_unused_parameters: parameters that get no gradient in a backward
            (on this rank, or on all) are allowed; a parameter unused on every
            rank keeps its gradient as it was (None), one unused only here
            contributes zeros. Without it, such a backward still completes on
            every rank (never a hang), then raises RuntimeError on the ranks
            that lacked gradients.
        gradient_as_bucket_view: True (the default; torch DDP's is False):
            parameters' .grad become views into the buckets: no copy out, the
            gradients accumulate in place, and no second copy of the gradients
            is held (16 bytes per parameter with fp32 AdamW, not 20; steps
            1.16-1.21x faster, docs/benchmarks.md). The same bits as False. A
            .grad kept across steps is overwritten by the next backward (as in
            torch); False copies each gradient into its bucket and the result
            back.
        overlap: False delays every all-reduce to the end of backward (for
            measuring what overlap buys).
        comm_hook: e.g. CompressionHook(torch.float16).
        init_sync: what construction does to make the ranks' parameters and
            buffers alike: True broadcasts rank 0's (as torch DDP); "verify"
            compares an exact fingerprint of their bits (an integer sum per
            tensor, one small all-gather) and broadcasts only where a rank
            differs (a model known alike, as the survivors' after a dropped
            step, skips the copy: ElasticDataParallel); False does neither.
            The model check (names, shapes, dtypes) runs in every mode.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        overlap: bool = True,
        comm_hook: CompressionHook | None = None,
        init_sync: bool | str = True,
    ) -> None:
        super().__init__()
        if init_sync not in (True, False, "verify"):
            raise ValueError(
                f"DistributedDataParallel: rank {comm.rank}: init_sync={init_sync!r} is not "
                "True, False or 'verify'"
            )
        self.module = module
        self.comm = autograd_comm(comm)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.overlap = overlap
        self.require_backward_grad_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(
                f"DistributedDataParallel: rank {comm.rank}: parameters span devices {devices}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        _check_same_model(comm, module)
        state = list(module.parameters()) + list(module.buffers())
        if init_sync is True:
            _broadcast_state(comm, state)
        elif init_sync == "verify":
            broadcast_if_differ(comm, state)

        # Reverse parameter order: roughly the order in which backward
        # produces the gradients.
        self._order = list(reversed(range(len(self._params))))
        self.buckets = BucketSet(
            comm,
            [self._params[i] for i in self._order],
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            device=self.device,
        )
        slot = {i: k for k, i in enumerate(self._order)}
        self._view = [self.buckets.view(slot[i]) for i in range(len(self._params))]
        self._bucket = [self.buckets.bucket_of(slot[i]) for i in range(len(self._params))]
        self._size = [len(b.members) for b in self.buckets.buckets]
        self.comm_hook: CompressionHook | None = None
        if comm_hook is not None:
            self.register_comm_hook(comm_hook)
        self._reset()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]

    # -- public ---------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module (after broadcasting buffers, if enabled)."""
        if self.broadcast_buffers and self.comm.world_size > 1:
            bufs = list(self.module.buffers())
            if bufs:
                _broadcast_state(self.comm, bufs)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without
        communication; the first backward after it averages the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, hook: CompressionHook) -> None:
        """Installs a communication hook (collective: allocates its buffers)."""
        hook.setup(self.comm, self.buckets)
        self.comm_hook = hook

    def detach(self) -> None:
        """Removes this wrapper's gradient hooks from the parameters and drops
        gradients that view its buckets: the module can then be wrapped again,
        on another communicator (e.g. the survivors' after a rank died,
        elastic.py). The wrapper is unusable afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            p.grad = None
        self._reset()

    # -- backward -------------------------------------------------------------
    def _reset(self) -> None:
        self._pending = list(self._size)
        self._used = [False] * len(self._params)
        self._works: list[Work | None] = [None] * len(self._size)
        self._next = 0  # next bucket to launch: always in order
        self._active = False

    def _make_hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            if not self._active:
                self._active = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            if self._used[i]:
                return
            view = self._view[i]
            if p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                view.copy_(p.grad)
                if self.gradient_as_bucket_view:
                    p.grad = view
            self._used[i] = True
            b = self._bucket[i]
            self._pending[b] -= 1
            if self.overlap:
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        buf = self.buckets.buckets[b].buffer
        if self.comm_hook is not None:
            self._works[b] = self.comm_hook.launch(self.comm, b, buf)
        else:
            self._works[b] = self.comm.all_reduce(buf, ReduceOp.AVG, async_op=True)
        self._next = b + 1

    def _finalize(self) -> None:
        try:
            unused = [i for i, u in enumerate(self._used) if not u]
            for i in unused:  # every rank launches every bucket, in order
                # No gradient in this backward: contribute what .grad holds (a sum
                # accumulated under no_sync), or zeros.
                g, view = self._params[i].grad, self._view[i]
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                self._pending[self._bucket[i]] -= 1
            self._launch_ready()
            globally_used = None
            if self.find_unused_parameters:
                mask = torch.tensor(self._used, dtype=torch.uint8)
                self.comm.all_reduce(mask, ReduceOp.MAX)
                globally_used = mask.bool().tolist()
            for b, w in enumerate(self._works):
                if w is not None:
                    w.wait()
                if self.comm_hook is not None:
                    self.comm_hook.finish(b, self.buckets.buckets[b].buffer)
            for i, p in enumerate(self._params):
                if not self._used[i] and (globally_used is None or not globally_used[i]):
                    continue  # no gradient anywhere (or an error below): leave .grad alone
                view = self._view[i]
                if self.gradient_as_bucket_view:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
            if unused and not self.find_unused_parameters:
                names = [self._names[i] for i in unused]
                raise RuntimeError(
                    f"DistributedDataParallel: rank {self.comm.rank}: parameters {names} "
                    "received no gradient in this backward; construct with "
                    "find_unused_parameters=True if that is expected"
                )
        finally:
            self._reset()


def _signature(module: nn.Module) -> int:
    """A 63-bit digest of the parameters' names, shapes and dtypes."""
    h = hashlib.sha256()
    for n, p in module.named_parameters():
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def ranks_that_differ(
    comm: Communicator, count: int, signature: int
) -> tuple[list[int], list[int]]:
    """Collective: the ranks whose (count, signature) differ from rank 0's, and every rank's count."""
    mine = torch.tensor([count, signature])
    every = torch.empty(2 * comm.world_size, dtype=torch.int64)
    comm.all_gather(every, mine)
    every = every.view(comm.world_size, 2)
    differ = [r for r in range(comm.world_size) if not torch.equal(every[r], every[0])]
    return differ, every[:, 0].tolist()


def _check_same_model(comm: Communicator, module: nn.Module) -> None:
    count = sum(1 for _ in module.parameters())
    differ, counts = ranks_that_differ(comm, count, _signature(module))
    if differ:
        raise ValueError(
            f"DistributedDataParallel: rank {comm.rank}: the model on ranks {differ} differs "
            f"from rank 0's (parameter counts {counts}); every rank must wrap a "
            "model with the same parameter names, shapes and dtypes"
        )


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """A 63-bit digest of the tensors' values, bit for bit: the integer sum of
    each tensor's elements read as integers of their width (exact; any one
    flipped bit changes it), hashed with their shapes and dtypes."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in tensors:
            bits = t.detach().reshape(-1)
            if bits.dtype.is_floating_point or bits.dtype.is_complex or bits.dtype == torch.bool:
                bits = bits.contiguous().view(_INT_VIEW.get(bits.element_size(), torch.uint8))
            total = int(bits.sum(dtype=torch.int64)) if bits.numel() else 0
            h.update(f"{tuple(t.shape)}:{t.dtype}:{total};".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def broadcast_if_differ(comm: Communicator, tensors: list[torch.Tensor]) -> bool:
    """Collective: broadcasts rank 0's values of `tensors` only if some rank's
    fingerprint() differs from rank 0's; returns whether it broadcast (alike
    on every rank)."""
    differ, _ = ranks_that_differ(comm, len(tensors), fingerprint(tensors))
    if differ:
        _broadcast_state(comm, tensors)
    return bool(differ)


def _broadcast_state(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Broadcasts rank 0's values of `tensors`, fused per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            if flat.device.type == "cpu" and not flat.is_contiguous():
                flat = flat.contiguous()
            comm.broadcast(flat, 0)
            off = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n
