"""Host staging of CUDA tensors for communicators whose ranks span hosts (as
gloo's ProcessGroupGloo does for CUDA tensors): CUDA IPC works within one host
only, so each CUDA buffer of a call is copied to a pinned host buffer on the
caller's current stream, the copy is waited for (a CUDA event) before the CPU
collective reads it, the CPU collective runs, and the results are copied back
to the CUDA buffers on that stream.

The device side (pinned allocation, copies, events, stream waits) goes through
a `DeviceOps` object, so the orchestration here runs on the CPU with a fake
one in tests (tests/multihost/test_staging.py); `TorchCudaOps` is the real one.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .work import Timeout, Work

DEFAULT_CACHE_BYTES = 256 << 20  # PYCOLL_STAGING_CACHE_MB: pinned bytes kept between calls
MAX_CACHED = 16  # pinned buffers kept between calls, at most


class DeviceOps(Protocol):
    """The device operations staging needs (injectable: tests pass a fake)."""

    def current_stream(self, tensor: Any) -> Any:
        """The caller's current stream on `tensor`'s device."""

    def pinned(self, nbytes: int) -> Any:
        """A new page-locked host buffer of `nbytes` bytes (a uint8 tensor)."""

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        """Enqueues dst.copy_(src) on `stream` without blocking the host."""

    def record(self, stream: Any) -> Any:
        """Records and returns an event on `stream` (after what is enqueued)."""

    def synchronize(self, event: Any) -> None:
        """Blocks the host until `event` has completed."""

    def query(self, event: Any) -> bool:
        """Whether `event` has completed."""

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Makes `stream` wait for `event` (without blocking the host)."""


class TorchCudaOps:
    """DeviceOps on torch.cuda."""

    def current_stream(self, tensor: Any) -> Any:
        import torch

        return torch.cuda.current_stream(tensor.device)

    def pinned(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        import torch

        # Outside autograd, as c10d's copies: the copy back may go into a
        # Parameter (or a view of one) or an inference tensor, at a wait() made
        # outside the inference mode the operation was issued in.
        with torch.cuda.stream(stream), torch.inference_mode():
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def query(self, event: Any) -> bool:
        return event.query()

    def stream_wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


class PinnedCache:
    """Pinned host buffers kept for reuse, keyed by size in bytes: at most
    `max_buffers` and `max_bytes` in all, the least recently returned going
    first. A buffer comes back with the event of the last copy reading it; it
    is handed out again only once that event has completed."""

    def __init__(self, ops: DeviceOps, max_bytes: int, max_buffers: int = MAX_CACHED) -> None:
        self._ops = ops
        self.max_bytes = max_bytes
        self.max_buffers = max_buffers
        self._free: collections.OrderedDict = collections.OrderedDict()  # id -> (buf, event)
        self._lock = threading.Lock()
        self.allocated = 0  # pinned allocations made (for tests and the benchmark)

    @property
    def cached_bytes(self) -> int:
        """Bytes held by the buffers now in the cache."""
        return sum(buf.numel() for buf, _ in self._free.values())

    def __len__(self) -> int:
        return len(self._free)

    def take(self, nbytes: int) -> Any:
        """A pinned uint8 buffer of `nbytes` bytes, cached or new."""
        with self._lock:
            found = next((k for k, (b, _) in self._free.items() if b.numel() == nbytes), None)
            buf, event = self._free.pop(found) if found is not None else (None, None)
        if buf is None:
            self.allocated += 1
            return self._ops.pinned(nbytes)
        if event is not None:  # a copy back may still read it
            self._ops.synchronize(event)
        return buf

    def give(self, buf: Any, event: Any) -> None:
        """Returns `buf` (free once `event` completed; None: free now)."""
        nbytes = buf.numel()
        if nbytes > self.max_bytes or self.max_buffers == 0:
            return  # too large to keep: torch frees it (once its copies are done)
        with self._lock:
            self._free[id(buf)] = (buf, event)
            total = sum(b.numel() for b, _ in self._free.values())
            while len(self._free) > self.max_buffers or total > self.max_bytes:
                _, (old, _) = self._free.popitem(last=False)
                total -= old.numel()


@dataclass
class Staged:
    """One CUDA buffer of a call: `copy_in` (the operation reads it) and
    `copy_out` (it writes it)."""

    tensor: Any
    arg: str
    copy_in: bool
    copy_out: bool


def cache_bytes_from_env(rank: int) -> int:
    """PYCOLL_STAGING_CACHE_MB (default 256): the pinned bytes kept between
    calls. Raises ValueError naming the rank for a value that is not a
    non-negative number."""
    raw = os.environ.get("PYCOLL_STAGING_CACHE_MB")
    if raw is None or raw == "":
        return DEFAULT_CACHE_BYTES
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(
            f"pycollectives: rank {rank}: PYCOLL_STAGING_CACHE_MB={raw!r} must be a number >= 0"
        )
    return int(mb * (1 << 20))


class Stager:
    """Runs one operation on host copies of its CUDA buffers (see the module)."""

    def __init__(self, ops: DeviceOps, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.ops = ops
        self.cache = PinnedCache(ops, cache_bytes)

    def run(
        self,
        owner: Any,
        bufs: Sequence[Staged],
        call: Callable[[list, bool], Any],
        async_op: bool,
    ) -> Any:
        """Copies the `copy_in` buffers to pinned host buffers on the current
        stream and waits for those copies; then call(host buffers, async_op)
        runs the CPU operation (it validates its arguments and raises as the
        CPU path does). Synchronous: copies the `copy_out` buffers back on the
        current stream and returns what call returned (None, or recv's
        source). Asynchronous: returns a StagedWork whose wait() copies back.
        The host buffers go back to the cache whatever happens."""
        stream = self.ops.current_stream(bufs[0].tensor)
        raw: list = []  # the cache's uint8 buffers
        hosts: list = []  # the same, shaped as the CUDA buffers
        try:
            for b in bufs:
                raw.append(self.cache.take(b.tensor.numel() * b.tensor.element_size()))
                hosts.append(raw[-1].view(b.tensor.dtype).view(b.tensor.shape))
            if any(b.copy_in for b in bufs):
                for b, h in zip(bufs, hosts, strict=True):
                    if b.copy_in:
                        self.ops.copy(h, b.tensor, stream)
                self.ops.synchronize(self.ops.record(stream))  # before the CPU reads them
            result = call(hosts, async_op)
        except BaseException:
            self._release(raw, None)
            raise
        if async_op and isinstance(result, Work):
            return StagedWork(result, owner, self, bufs, raw, hosts, stream)
        self._release(raw, self._copy_back(bufs, hosts, stream))
        return result

    def _copy_back(self, bufs: Sequence[Staged], hosts: list, stream: Any) -> Any:
        """Enqueues the copies of the results to the CUDA buffers on `stream`;
        returns the event after them (None when nothing is copied)."""
        out = [(b, h) for b, h in zip(bufs, hosts, strict=True) if b.copy_out]
        for b, h in out:
            self.ops.copy(b.tensor, h, stream)
        return self.ops.record(stream) if out else None

    def _release(self, raw: list, event: Any) -> None:
        for buf in raw:
            self.cache.give(buf, event)


class StagedWork(Work):
    """Handle of an asynchronous operation on host copies of CUDA buffers.
    The results reach the CUDA buffers when wait() or is_completed() finds the
    CPU operation done: the copies back are then enqueued on the stream that
    was current when the operation was issued, and wait() makes the current
    stream wait for them (torch.distributed/NCCL stream semantics)."""

    __slots__ = ("_stager", "_bufs", "_raw", "_hosts", "_stream", "_event", "_done", "_lock")

    def __init__(
        self,
        inner: Work,
        owner: Any,
        stager: Stager,
        bufs: Sequence[Staged],
        raw: list,
        hosts: list,
        stream: Any,
    ) -> None:
        super().__init__(inner, owner)
        self._stager, self._bufs, self._stream = stager, bufs, stream
        self._raw, self._hosts = raw, hosts
        self._event: Any = None
        self._done = False  # copied back (or failed): the host buffers are released
        self._lock = threading.Lock()

    def _finish(self, failed: bool) -> None:
        """Once: enqueues the copies back (unless the operation failed) and
        releases the host buffers."""
        with self._lock:
            if self._done:
                return
            self._done = True
            if not failed:
                self._event = self._stager._copy_back(self._bufs, self._hosts, self._stream)
            self._stager._release(self._raw, self._event)
            self._raw, self._hosts = [], []

    def wait(self, timeout: Timeout = None) -> bool:
        """Waits for the CPU operation (re-raising its error), enqueues the
        copies back and makes the current stream wait for them; returns True.
        With `timeout`, returns False if the CPU operation is not done by then."""
        try:
            if not self._work.wait(timeout):
                return False
        except BaseException:
            self._finish(failed=True)
            raise
        self._finish(failed=False)
        if self._event is not None:
            stream = self._stager.ops.current_stream(self._bufs[0].tensor)
            self._stager.ops.stream_wait(stream, self._event)
        return True

    def synchronize(self, timeout: Timeout = None) -> bool:
        """As wait(), then blocks the host until the copies back have completed."""
        if not self.wait(timeout):
            return False
        if self._event is not None:
            self._stager.ops.synchronize(self._event)
        return True

    def is_completed(self) -> bool:
        """True once the CPU operation finished with an error, or finished and
        its results are in the CUDA buffers (the copies back, enqueued here if
        not yet, have completed)."""
        if not self._work.is_completed():
            return False
        if self._work.exception() is not None:
            self._finish(failed=True)
            return True
        self._finish(failed=False)
        return self._event is None or self._stager.ops.query(self._event)

    def exception(self) -> BaseException | None:
        """The CPU operation's error once it completed with one, else None."""
        return self._work.exception()

    @property
    def source(self) -> int | None:
        """As Work.source (a receive from any source: the sender's rank)."""
        return self._work.source


__all__ = ["DeviceOps", "PinnedCache", "Staged", "StagedWork", "Stager", "TorchCudaOps"]
