"""The Communicator: collectives on torch tensors and NumPy arrays, run by the
C++ core over shared memory."""

from __future__ import annotations

import atexit
import collections
import enum
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

from . import _C
from ._buffers import ITEMSIZE, describe, is_cuda_buffer
from ._args import cuda_args, cuda_ret, describe_pair, stage, stage_pair
from ._point_to_point import PointToPoint
from ._staging import Staged
from .work import CudaWork, Timeout, Work, to_seconds

__all__ = ["Communicator", "CudaWork", "ReduceOp", "Timeout", "Work", "to_seconds"]

Buffer = Any  # torch.Tensor | numpy.ndarray


class ReduceOp(enum.IntEnum):
    """Reduction operators (codes of the C++ core)."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4


_OP_CODES = {op: int(op) for op in ReduceOp}  # IntEnum members and plain ints alike


def _op_code(op: Any, rank: int, name: str) -> int:
    code = _OP_CODES.get(op) if not isinstance(op, (bool, float)) else None
    if code is None:
        raise ValueError(
            f"pycollectives: rank {rank}: {name}: op={op!r} is not a pycollectives.ReduceOp "
            "(SUM, PROD, MIN, MAX, AVG)"
        )
    return code


def _check_no_overlap(a: tuple, b: tuple, allowed: int | None, rank: int, name: str) -> None:
    """Raises ValueError if byte ranges a=(ptr, nbytes) and b overlap, unless b
    starts exactly at `allowed` (the in-place layout torch uses)."""
    (pa, na), (pb, nb) = a, b
    if na == 0 or nb == 0 or pa + na <= pb or pb + nb <= pa:
        return
    if allowed is not None and pb == allowed:
        return
    raise ValueError(f"pycollectives: rank {rank}: {name}: input and output overlap")


_live: weakref.WeakSet = weakref.WeakSet()  # closed at exit: see _close_all_at_exit


class Communicator(PointToPoint):
    """A group of ranks (on one host or several); create with pycollectives.init() or split().

    Collectives here; send, recv and batch_p2p in PointToPoint (_point_to_point.py)."""

    def __init__(self, core: Any) -> None:
        self._c = core
        self._fast = _C.fast_path(core)  # synchronous CPU-tensor calls without pybind11
        self.rank: int = core.rank
        self.world_size: int = core.world_size
        # (core work, buffers) of asynchronous operations not known to be done:
        # the buffers stay alive until the operation completes, even if the
        # caller drops its Work (the progress thread still reads and writes them).
        self._inflight: collections.deque = collections.deque()
        self._cuda_device: int | None = None  # set by the first CUDA operation
        # Ranks on several hosts: CUDA buffers go through pinned host copies (_staging.py).
        self._across_hosts = any(core.host_of)
        self._stager: Any = None  # made by the first staged operation
        # all_reduce_coalesced's window buckets, by (shapes and dtypes, cap): see bucketing.py
        self._coalesced_buckets: dict = {}
        self._on_close: list[Any] = []  # run once by close() (rendezvous.py: the caller's store)
        _live.add(self)

    def _issue_from_any_thread(self) -> None:
        """Lets any thread issue operations: the caller serializes its calls (the
        torch backend does, under its lock). By default only the first thread
        that issues one may (a second raises ValueError)."""
        self._c.set_any_thread(True)

    # -- helpers --------------------------------------------------------------
    def _ret(self, work: Any, *buffers: Buffer) -> Work | None:
        if work is None:
            return None
        self._prune()
        self._inflight.append((work, buffers))
        return Work(work, self)

    def _prune(self) -> None:
        """Drops the buffers of operations that completed (they complete in order)."""
        inflight = self._inflight
        while inflight and inflight[0][0].is_completed():
            inflight.popleft()

    def _root(self, root: int, arg: str, name: str) -> int:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: {arg}={root!r} is out of range [0, {self.world_size})"
            )
        return root

    # -- collectives ----------------------------------------------------------
    def all_reduce(
        self,
        tensor: Buffer,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Reduces `tensor` across ranks in place; every rank gets the same bits."""
        if not async_op and timeout is None and self._fast.all_reduce(tensor, op):
            return None
        if is_cuda_buffer(tensor):
            code = _op_code(op, self.rank, "all_reduce")
            [(ptr, n, dt)], dev, stream = cuda_args(self, "all_reduce", (tensor, "tensor", True))
            if self._across_hosts:
                call = lambda h, a: self.all_reduce(h[0], op, async_op=a, timeout=timeout)  # noqa: E731
                return stage(self, [Staged(tensor, "tensor", True, True)], call, async_op)
            w = _C.cuda_all_reduce(
                self._c, ptr, n, dt, code, dev, stream(), async_op, to_seconds(timeout)
            )
            return cuda_ret(self, w, async_op, stream, tensor)
        ptr, n, dt = describe(tensor, self.rank, "all_reduce", "tensor")
        code = _op_code(op, self.rank, "all_reduce")
        return self._ret(
            self._c.all_reduce(ptr, n, dt, code, async_op, to_seconds(timeout)), tensor
        )

    def reduce_scatter(
        self,
        output: Buffer,
        input: Buffer,
        op: ReduceOp = ReduceOp.SUM,
        *,  # noqa: A002
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Reduces `input` (world_size blocks) across ranks; rank r gets block r in `output`."""
        if not async_op and timeout is None and self._fast.reduce_scatter(output, input, op):
            return None
        name = "reduce_scatter"
        (po, no, do), (pi, ni, di), cuda = describe_pair(self, name, output, input)
        if ni != no * self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: input has {ni} elements, expected "
                f"world_size * output.numel() = {self.world_size * no}"
            )
        es = ITEMSIZE[di]
        _check_no_overlap((pi, ni * es), (po, no * es), pi + self.rank * no * es, self.rank, name)
        code = _op_code(op, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.reduce_scatter(o, i, op, async_op=a, timeout=timeout)  # noqa: E731
            return stage_pair(self, output, input, call, async_op)
        if cuda:
            dev, stream = cuda
            w = _C.cuda_reduce_scatter(
                self._c, po, pi, no, di, code, dev, stream(), async_op, to_seconds(timeout)
            )
            return cuda_ret(self, w, async_op, stream, output, input)
        w = self._c.reduce_scatter(po, pi, no, di, code, async_op, to_seconds(timeout))
        return self._ret(w, output, input)

    def all_gather(
        self,
        output: Buffer,
        input: Buffer,
        *,
        async_op: bool = False,  # noqa: A002
        timeout: Timeout = None,
    ) -> Work | None:
        """Gathers every rank's `input` into `output` (world_size blocks, block r from rank r)."""
        if not async_op and timeout is None and self._fast.all_gather(output, input):
            return None
        name = "all_gather"
        (po, no, do), (pi, ni, di), cuda = describe_pair(self, name, output, input)
        if no != ni * self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: output has {no} elements, expected "
                f"world_size * input.numel() = {self.world_size * ni}"
            )
        es = ITEMSIZE[di]
        _check_no_overlap((po, no * es), (pi, ni * es), po + self.rank * ni * es, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.all_gather(o, i, async_op=a, timeout=timeout)  # noqa: E731
            return stage_pair(self, output, input, call, async_op)
        if cuda:
            dev, stream = cuda
            w = _C.cuda_all_gather(
                self._c, po, pi, ni, di, dev, stream(), async_op, to_seconds(timeout)
            )
            return cuda_ret(self, w, async_op, stream, output, input)
        w = self._c.all_gather(po, pi, ni, di, async_op, to_seconds(timeout))
        return self._ret(w, output, input)

    def broadcast(
        self, tensor: Buffer, src: int, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Copies rank `src`'s `tensor` into every rank's `tensor`."""
        if not async_op and timeout is None and self._fast.broadcast(tensor, src):
            return None
        if is_cuda_buffer(tensor):
            [(ptr, n, dt)], dev, stream = cuda_args(self, "broadcast", (tensor, "tensor", True))
            src = self._root(src, "src", "broadcast")
            if self._across_hosts:
                call = lambda h, a: self.broadcast(h[0], src, async_op=a, timeout=timeout)  # noqa: E731
                bufs = [Staged(tensor, "tensor", self.rank == src, self.rank != src)]
                return stage(self, bufs, call, async_op)
            w = _C.cuda_broadcast(
                self._c, ptr, n, dt, src, dev, stream(), async_op, to_seconds(timeout)
            )
            return cuda_ret(self, w, async_op, stream, tensor)
        ptr, n, dt = describe(tensor, self.rank, "broadcast", "tensor")
        src = self._root(src, "src", "broadcast")
        return self._ret(self._c.broadcast(ptr, n, dt, src, async_op, to_seconds(timeout)), tensor)

    def reduce(
        self,
        tensor: Buffer,
        dst: int,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Reduces `tensor` across ranks into rank `dst`'s `tensor` (others unchanged)."""
        if not async_op and timeout is None and self._fast.reduce(tensor, dst, op):
            return None
        if is_cuda_buffer(tensor):
            [(ptr, n, dt)], dev, stream = cuda_args(self, "reduce", (tensor, "tensor", True))
            dst = self._root(dst, "dst", "reduce")
            code = _op_code(op, self.rank, "reduce")
            if self._across_hosts:
                call = lambda h, a: self.reduce(h[0], dst, op, async_op=a, timeout=timeout)  # noqa: E731
                bufs = [Staged(tensor, "tensor", True, self.rank == dst)]
                return stage(self, bufs, call, async_op)
            to = to_seconds(timeout)
            w = _C.cuda_reduce(self._c, ptr, n, dt, code, dst, dev, stream(), async_op, to)
            return cuda_ret(self, w, async_op, stream, tensor)
        ptr, n, dt = describe(tensor, self.rank, "reduce", "tensor")
        dst = self._root(dst, "dst", "reduce")
        code = _op_code(op, self.rank, "reduce")
        return self._ret(
            self._c.reduce(ptr, n, dt, code, dst, async_op, to_seconds(timeout)), tensor
        )

    def all_to_all(
        self,
        output: Buffer,
        input: Buffer,
        *,
        async_op: bool = False,  # noqa: A002
        timeout: Timeout = None,
    ) -> Work | None:
        """Block j of this rank's `input` goes to block `rank` of rank j's `output`."""
        if not async_op and timeout is None and self._fast.all_to_all(output, input):
            return None
        name = "all_to_all"
        (po, no, do), (pi, ni, di), cuda = describe_pair(self, name, output, input)
        if no != ni:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: output has {no} elements, input {ni}"
            )
        if ni % self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: input has {ni} elements, not divisible by "
                f"world_size {self.world_size}"
            )
        es = ITEMSIZE[di]
        _check_no_overlap((po, no * es), (pi, ni * es), None, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.all_to_all(o, i, async_op=a, timeout=timeout)  # noqa: E731
            return stage_pair(self, output, input, call, async_op)
        if cuda:
            (dev, stream), count, to = cuda, ni // self.world_size, to_seconds(timeout)
            w = _C.cuda_all_to_all(self._c, po, pi, count, di, dev, stream(), async_op, to)
            return cuda_ret(self, w, async_op, stream, output, input)
        w = self._c.all_to_all(po, pi, ni // self.world_size, di, async_op, to_seconds(timeout))
        return self._ret(w, output, input)

    def alloc_shared(
        self, shape: int | Sequence[int], dtype: Any = None, *, timeout: Timeout = None
    ) -> Any:
        """Collective: returns a zero-filled CPU torch tensor of `shape` and
        `dtype` (default float32) in a symmetric shared-memory window: every
        rank allocates the same size and maps every peer's buffer. An
        all_reduce of the tensor, a reduce_scatter whose input or an
        all_gather whose output it is (the same view on every rank) then runs
        in place across the ranks' buffers with no copy through the
        transport's slots (as NCCL's registered buffers). The memory lives as
        long as any tensor viewing it. Every rank must call it with the same
        size, in the same order as its other collectives.

        Raises ValueError for a negative size or an unsupported dtype, and the
        communicator's errors (e.g. /dev/shm too small) on every rank.
        """
        import torch

        dtype = torch.float32 if dtype is None else dtype
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(
                f"pycollectives: rank {self.rank}: alloc_shared: shape={shape!r} must be "
                "non-negative ints"
            )
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
            raise ValueError(
                f"pycollectives: rank {self.rank}: alloc_shared: dtype={dtype!r} is not supported"
            )
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        win = self._c.alloc_window(nbytes, to_seconds(timeout))
        flat = torch.frombuffer(win, dtype=torch.uint8, count=nbytes) if nbytes else None
        if flat is None:
            return torch.zeros(shape, dtype=dtype)
        return flat.view(dtype).view(shape)

    def all_reduce_coalesced(
        self,
        tensors: Sequence[Any],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        bucket_cap_mb: float = 25.0,
    ) -> Any:
        """All-reduces a list of CPU tensors in place, fused into shared-memory
        buckets of at most `bucket_cap_mb` per dtype (see
        pycollectives.bucketing.all_reduce_coalesced). With async_op, returns a
        CoalescedWork whose wait() puts the results into the tensors.

        Raises ValueError for a tensor that is not a contiguous CPU tensor."""
        from .bucketing import all_reduce_coalesced

        return all_reduce_coalesced(
            self, tensors, op, async_op=async_op, bucket_cap_mb=bucket_cap_mb
        )

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Returns once every rank has entered the barrier."""
        return self._ret(self._c.barrier(async_op, to_seconds(timeout)))

    def split(
        self, color: int | None, key: int = 0, *, timeout: Timeout = None
    ) -> Communicator | None:
        """Collective: ranks with equal `color` form a new communicator, ordered by
        (key, rank). Returns None where color is None or negative. Across hosts,
        a color spanning hosts makes a communicator across them (shared memory
        within each host, TCP between them), set up through this one.

        Raises TypeError for a color or key that is not an int, and, on every
        rank of a color, ValueError (bad input, a bad setting) or
        PyCollectivesError naming the rank that could not make or join it."""
        c = -1 if color is None else color
        if not isinstance(c, int) or not isinstance(key, int):
            raise TypeError(f"pycollectives: rank {self.rank}: split: color and key must be ints")
        child = self._c.split(c, key, to_seconds(timeout))
        return None if child is None else Communicator(child)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-operation counters: calls, bytes_sent, bytes_received, time_s, paths, taken_over.

        ``paths`` counts the calls by how they moved their bytes: ``"slots"``
        (ring, chain or pairwise schedules through the shared slots),
        ``"oneshot"`` (small messages through the one-shot areas),
        ``"direct"`` (in place across symmetric windows, see `alloc_shared`, or, for
        CUDA buffers, across the peers' own buffers mapped with CUDA IPC) or
        ``"cma"`` (single copy between the peers' plain buffers, see `single_copy`).
        Across hosts: ``"hierarchical"`` (within each host, then across hosts
        by the hosts' ranks in parallel, or the reverse) or ``"flat"`` (one
        ring or chain over every rank, host by host: ``PYCOLL_ALGO=ring``).
        ``taken_over`` counts the single-copy chunks this rank did for another
        rank's part because that rank had not claimed them yet (it was
        descheduled or slower).
        """
        return self._c.stats()

    def cma_tuning(self) -> dict[str, dict[int, dict[str, Any]]]:
        """What this rank's single-copy tuner measured and decided, per operation name
        and size class (a power of two of bytes, the class ``[b, 2b)`` keyed by ``b``):
        ``{"decided": "cma" | "slots" | None (still timing), "cma_ns_per_byte",
        "slots_ns_per_byte"}``, the best time per byte of each path's timed calls
        (None before one ran). Only classes inside the single-copy bands that ran an
        operation appear; empty with ``PYCOLL_CMA_TUNE=0`` or without single copy.
        Each rank decides on its own timings (docs/api.md, "Single copy").
        """
        return self._c.cma_tuning()

    @property
    def algorithm(self) -> str:
        """The PYCOLL_ALGO setting in force (rank 0's): auto, ring, oneshot or cma."""
        return self._c.algo

    @property
    def single_copy(self) -> bool:
        """Whether ranks read and write each other's plain buffers directly (CMA).

        Decided at init, alike on every rank: true when every rank could read
        and write every peer with ``process_vm_readv``/``process_vm_writev``
        (same user, ptrace allowed, not refused by seccomp) and neither
        ``PYCOLL_CMA=0`` nor ``PYCOLL_ALGO`` ``ring``/``oneshot`` is set. Where
        it is false, the slots carry everything.
        """
        return self._c.cma

    @property
    def hosts(self) -> list[int]:
        """Every rank's host (hosts numbered in the order of their lowest
        rank): ranks of one host share memory, ranks of different hosts talk
        over TCP. All zeros on one host."""
        return list(self._c.host_of)

    def net_info(self) -> dict[str, Any]:
        """Across hosts, this rank's TCP side: ``address`` ("ip:port" it
        listens on), ``interface``, ``rejected`` (connections refused: failed
        handshakes, evicted or expired pending ones), ``listening`` (whether
        the port is still open: it closes once every expected connection is
        in), ``control_buffer_peak`` (bytes), ``bytes_sent`` /
        ``bytes_received`` (payload to and from other hosts). Empty address
        and zeros on one host."""
        return dict(self._c.net_info())

    def close(self) -> None:
        """Releases the communicator (idempotent). Pending operations run on,
        but one that a peer stays away from for a second, idle, is aborted
        (its peers raise too) rather than left to its timeout; a warning names
        each pending operation that failed (its Work raises the error)."""
        failed = self._c.close()
        self._inflight.clear()
        while self._on_close:
            self._on_close.pop()()
        for msg in failed:
            warnings.warn(
                f"pycollectives: rank {self.rank}: close(): a pending {msg}",
                RuntimeWarning,
                stacklevel=2,
            )

    def abort(self, reason: str) -> None:
        """Aborts the communicator on every rank, as ncclCommAbort: their
        pending and later operations raise CommunicatorAborted with
        "pycollectives: <reason>" (the first abort wins). For a rank that stops
        for a reason of its own, such as Ctrl-C in Python code, so that its
        peers say why instead of waiting for it. A no-op once closed."""
        self._c.abort(f"pycollectives: {reason}")

    @property
    def aborted(self) -> bool:
        """Whether the communicator is aborted (an error, a timeout, a dead or
        interrupted peer, abort()): every operation on it raises."""
        return bool(self._c.aborted)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pycollectives.Communicator rank={self.rank} world_size={self.world_size}>"


def abort_all_interrupted() -> None:
    """Aborts every open communicator of this process saying "rank R was
    interrupted (SIGINT)", R this process's rank in each (see
    Communicator.abort): what Ctrl-C does to a rank's peers."""
    for comm in list(_live):
        comm.abort(f"rank {comm.rank} was interrupted (SIGINT)")


@atexit.register
def _close_all_at_exit() -> None:
    """Closes the communicators still open at exit, while Python still runs: a
    pending operation is then aborted (or finishes) and reported, instead of
    holding the exit until its timeout. Exiting on Ctrl-C (an uncaught
    KeyboardInterrupt), it first aborts them saying so: the peers then report
    the interrupt, not a closed communicator or a mismatch."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        abort_all_interrupted()
    for comm in list(_live):
        comm.close()
