"""The Communicator: collectives and point-to-point operations on torch tensors
and NumPy arrays, run by the C++ core over shared memory (and TCP across
hosts). Every operation checks its buffers in one prologue (`_buffers`, with
the helpers of _args.py) and hands them to the core in one epilogue (`_issue`);
CUDA buffers go to the core's CUDA path or, across hosts, through pinned host
copies (`_stage`, _staging.py). Its state, reports and lifetime: _base.py."""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Any

from . import _C
from ._args import check_no_overlap, check_root, cuda_args, cuda_p2p_ops, p2p_ops
from ._base import CommunicatorBase
from ._buffers import ITEMSIZE, describe, is_cuda_buffer
from ._recovery import Agreement
from ._recovery_hosts import HostRecovery
from ._staging import Staged
from .work import CudaWork, Timeout, Work, to_seconds

__all__ = ["Agreement", "Communicator", "CudaWork", "ReduceOp", "Timeout", "Work", "to_seconds"]

Buffer = Any  # torch.Tensor | numpy.ndarray | an object with __cuda_array_interface__


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


class Communicator(CommunicatorBase):
    """A group of ranks (on one host or several); create with pycollectives.init() or split()."""

    def __init__(self, core: Any) -> None:
        super().__init__(core)
        # comm.all_reduce(tensor[, op]), synchronous on a CPU tensor, goes straight
        # into the core with no Python frame (~0.14 us of a ~0.8 us 8-byte
        # all-reduce); any other call goes to the method below (fast_path.h).
        self.all_reduce = _C.fast_method(
            self._fast.all_reduce, Communicator.all_reduce, weakref.ref(self), ReduceOp.SUM
        )

    # -- the prologue of every operation on buffers (the epilogues: _base.py) --
    def _buffers(self, name: str, *specs: tuple[Buffer, str, bool]) -> tuple[list, Any]:
        """Checks and describes the buffers of one call, specs (buffer, argument
        name, writable), as CUDA buffers if the first is one: returns
        ([(address, numel, dtype code)], None or (device, current-stream
        getter)). Two buffers are (output, input) and must share a dtype.
        Raises ValueError naming the argument, the rank and the operation."""
        if is_cuda_buffer(specs[0][0]):
            descs, dev, stream = cuda_args(
                self.rank, self._across_hosts, self._cuda_device, name, *specs
            )
            self._cuda_device, cuda = dev, (dev, stream)
        else:
            descs = [describe(b, self.rank, name, arg, writable=w) for b, arg, w in specs]
            cuda = None
        if len(descs) == 2 and descs[0][2] != descs[1][2]:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: output dtype differs from input dtype"
            )
        return descs, cuda

    def _pair(self, name: str, output: Buffer, input: Buffer) -> tuple:  # noqa: A002
        """_buffers() of an operation writing `output` and reading `input`."""
        return self._buffers(name, (output, "output", True), (input, "input", False))

    def _root(self, root: int, arg: str, name: str) -> int:
        return check_root(root, self.world_size, self.rank, arg, name)

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
        [(ptr, n, dt)], cuda = self._buffers("all_reduce", (tensor, "tensor", True))
        code = _op_code(op, self.rank, "all_reduce")
        if cuda and self._across_hosts:
            call = lambda h, a: self.all_reduce(h[0], op, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage([Staged(tensor, "tensor", True, True)], call, async_op)
        args = (ptr, n, dt, code)
        return self._issue("all_reduce", args, (tensor,), cuda, async_op, timeout)

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
        [(po, no, _), (pi, ni, dt)], cuda = self._pair(name, output, input)
        if ni != no * self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: input has {ni} elements, expected "
                f"world_size * output.numel() = {self.world_size * no}"
            )
        es = ITEMSIZE[dt]
        check_no_overlap((pi, ni * es), (po, no * es), pi + self.rank * no * es, self.rank, name)
        code = _op_code(op, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.reduce_scatter(o, i, op, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage_pair(output, input, call, async_op)
        args = (po, pi, no, dt, code)
        return self._issue("reduce_scatter", args, (output, input), cuda, async_op, timeout)

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
        [(po, no, _), (pi, ni, dt)], cuda = self._pair(name, output, input)
        if no != ni * self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: output has {no} elements, expected "
                f"world_size * input.numel() = {self.world_size * ni}"
            )
        es = ITEMSIZE[dt]
        check_no_overlap((po, no * es), (pi, ni * es), po + self.rank * ni * es, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.all_gather(o, i, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage_pair(output, input, call, async_op)
        args = (po, pi, ni, dt)
        return self._issue("all_gather", args, (output, input), cuda, async_op, timeout)

    def broadcast(
        self, tensor: Buffer, src: int, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Copies rank `src`'s `tensor` into every rank's `tensor`."""
        if not async_op and timeout is None and self._fast.broadcast(tensor, src):
            return None
        [(ptr, n, dt)], cuda = self._buffers("broadcast", (tensor, "tensor", True))
        src = self._root(src, "src", "broadcast")
        if cuda and self._across_hosts:
            call = lambda h, a: self.broadcast(h[0], src, async_op=a, timeout=timeout)  # noqa: E731
            bufs = [Staged(tensor, "tensor", self.rank == src, self.rank != src)]
            return self._stage(bufs, call, async_op)
        args = (ptr, n, dt, src)
        return self._issue("broadcast", args, (tensor,), cuda, async_op, timeout)

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
        [(ptr, n, dt)], cuda = self._buffers("reduce", (tensor, "tensor", True))
        dst = self._root(dst, "dst", "reduce")
        code = _op_code(op, self.rank, "reduce")
        if cuda and self._across_hosts:
            call = lambda h, a: self.reduce(h[0], dst, op, async_op=a, timeout=timeout)  # noqa: E731
            bufs = [Staged(tensor, "tensor", True, self.rank == dst)]
            return self._stage(bufs, call, async_op)
        args = (ptr, n, dt, code, dst)
        return self._issue("reduce", args, (tensor,), cuda, async_op, timeout)

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
        [(po, no, _), (pi, ni, dt)], cuda = self._pair(name, output, input)
        if no != ni:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: output has {no} elements, input {ni}"
            )
        if ni % self.world_size:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {name}: input has {ni} elements, not divisible by "
                f"world_size {self.world_size}"
            )
        es = ITEMSIZE[dt]
        check_no_overlap((po, no * es), (pi, ni * es), None, self.rank, name)
        if cuda and self._across_hosts:
            call = lambda o, i, a: self.all_to_all(o, i, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage_pair(output, input, call, async_op)
        args = (po, pi, ni // self.world_size, dt)
        return self._issue("all_to_all", args, (output, input), cuda, async_op, timeout)

    def all_reduce_coalesced(
        self,
        tensors: Sequence[Any],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        bucket_cap_mb: float = 25.0,
    ) -> Any:
        """All-reduces a list of CPU tensors in place, fused into shared-memory
        buckets of at most `bucket_cap_mb` per dtype: copies in, one all-reduce per
        bucket, copies out. The buckets are cached by the list's shapes and dtypes,
        so a training loop allocates them once. Collective: every rank passes the
        same shapes and dtypes. With async_op, returns a CoalescedWork whose wait()
        puts the results into the tensors.

        Raises ValueError for a tensor that is not a contiguous CPU tensor."""
        import torch

        from ._fusion import CoalescedWork, make_buckets

        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(
                    f"pycollectives: rank {self.rank}: all_reduce_coalesced: tensors[{i}] must "
                    "be a contiguous CPU torch.Tensor"
                )
        key = (tuple((tuple(t.shape), t.dtype) for t in tensors), float(bucket_cap_mb))
        if key not in self._coalesced_buckets:
            cap, alloc = bucket_cap_mb, self.alloc_shared
            self._coalesced_buckets[key] = make_buckets(tensors, cap, cap, alloc, self.rank)[1:]
        buckets, where = self._coalesced_buckets[key]
        views = [buckets[b].views[pos] for b, pos in where]
        with torch.inference_mode():  # outside autograd (Parameters), as the copies out
            for v, t in zip(views, tensors, strict=True):
                v.copy_(t)
        works = [self.all_reduce(b.buffer, op, async_op=True) for b in buckets]

        def copy_out() -> None:  # inference tensors too, whatever thread or mode waits
            with torch.inference_mode():
                for v, t in zip(views, tensors, strict=True):
                    t.copy_(v)

        work = CoalescedWork(works, copy_out)
        if async_op:
            return work
        work.wait()
        return None

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
        PyCollectivesError naming the rank that could not make or join it.

        Across hosts, a split that keeps every rank (one color: a renumbering,
        as ParallelDims makes of a grown world) agrees and shrinks through its
        parent's store (init's store=, or keep_store) as the parent does; any
        other split communicator is not recoverable by itself (shrink the
        parent and split it again)."""
        c = -1 if color is None else color
        if not isinstance(c, int) or not isinstance(key, int):
            raise TypeError(f"pycollectives: rank {self.rank}: split: color and key must be ints")
        number = self._splits
        self._splits += 1
        child = self._c.split(c, key, to_seconds(timeout))
        if child is None:
            return None
        out = Communicator(child)
        rec = self._host_recovery
        renumbered = out.world_size == self.world_size  # every rank of this one is in it
        if out._across_hosts and renumbered and rec is not None and rec.store is not None:
            # Every rank is in it, so every rank names it alike: the parent's key, this split.
            out._host_recovery = HostRecovery(f"{rec.key}/split{number}", rec.store)
        return out

    # -- point-to-point -------------------------------------------------------
    def send(
        self, tensor: Buffer, dst: int, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Sends `tensor` to rank `dst`; returns once it is buffered or delivered."""
        if not async_op and timeout is None and self._fast.send(tensor, dst):
            return None
        [(ptr, n, dt)], cuda = self._buffers("send", (tensor, "tensor", False))
        dst = self._root(dst, "dst", "send")
        if cuda and self._across_hosts:
            call = lambda h, a: self.send(h[0], dst, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage([Staged(tensor, "tensor", True, False)], call, async_op)
        args = (ptr, n, dt, dst)
        return self._issue("send", args, (tensor,), cuda, async_op, timeout)

    def recv(
        self, tensor: Buffer, src: int | None, *, async_op: bool = False, timeout: Timeout = None
    ) -> int | Work:
        """Receives into `tensor` from rank `src` (count and dtype must match the send).

        `src=None` receives from any source (MPI_ANY_SOURCE): the message of
        whichever peer sends one first, after every operation issued before
        this one (CPU buffers; across hosts CUDA tensors too, staged through host
        memory). Returns the sender's rank, or with
        `async_op` a Work whose `source` is the sender's rank once it completed.
        Raises ValueError for a bad `src` or buffer, and the core's errors.
        """
        if src is None:
            return self._recv_any(tensor, async_op, timeout)
        if not async_op and timeout is None and self._fast.recv(tensor, src):
            return src
        [(ptr, n, dt)], cuda = self._buffers("recv", (tensor, "tensor", True))
        src = self._root(src, "src", "recv")
        if cuda and self._across_hosts:
            call = lambda h, a: self.recv(h[0], src, async_op=a, timeout=timeout)  # noqa: E731
            return self._stage([Staged(tensor, "tensor", False, True)], call, async_op)
        args = (ptr, n, dt, src)
        w = self._issue("recv", args, (tensor,), cuda, async_op, timeout)
        return src if w is None else w

    def _recv_any(self, tensor: Buffer, async_op: bool, timeout: Timeout) -> int | Work:
        """recv(src=None): from whichever peer sends first (across hosts, a CUDA
        tensor through a host copy)."""
        if is_cuda_buffer(tensor) and self._across_hosts:
            self._buffers("recv", (tensor, "tensor", True))
            call = lambda h, a: self._recv_any(h[0], a, timeout)  # noqa: E731
            return self._stage([Staged(tensor, "tensor", False, True)], call, async_op)
        if is_cuda_buffer(tensor):
            raise ValueError(
                f"pycollectives: rank {self.rank}: recv: src=None (any source) takes CPU "
                "buffers; pass src for a CUDA tensor"
            )
        ptr, n, dt = describe(tensor, self.rank, "recv", "tensor")
        work, source = self._c.recv_any(ptr, n, dt, async_op, to_seconds(timeout))
        w = self._ret(work, tensor)
        return source if w is None else w

    def batch_p2p(
        self,
        ops: Sequence[tuple[str, Buffer, int]],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Runs sends and receives together, as ncclGroupStart/End or torch's
        batch_isend_irecv: `ops` holds ``("send", buffer, dst)`` and
        ``("recv", buffer, src)``. All of them progress at once, each as far as
        its connection lets it, so any matched pattern completes (every rank
        sending a large tensor to the next and receiving from the previous, or
        a peer issuing the counterparts as single calls or other batches),
        where sends issued one by one before their receives would wait for
        each other. Messages
        between two ranks match in the order listed; a send to this rank pairs
        with the next receive from this rank.

        Raises ValueError naming the op's index for a bad kind, peer or buffer,
        and for sends to self that do not pair with receives from self.
        """
        if not async_op and timeout is None and self._fast.batch_p2p(ops):
            return None
        on_cuda = cuda_p2p_ops(ops) if self._across_hosts else []
        if on_cuda:  # across hosts: the CUDA buffers through host copies
            bufs = []
            for i, recv in on_cuda:
                self._buffers("batch_p2p", (ops[i][1], f"ops[{i}]", recv))
                bufs.append(Staged(ops[i][1], f"ops[{i}]", not recv, recv))

            def call(hosts: list, a: bool) -> Work | None:
                host_ops = list(ops)
                for (i, _), h in zip(on_cuda, hosts, strict=True):
                    host_ops[i] = (ops[i][0], h, ops[i][2])
                return self.batch_p2p(host_ops, async_op=a, timeout=timeout)

            return self._stage(bufs, call, async_op)
        items, keep = p2p_ops(self.rank, self.world_size, ops)
        return self._ret(self._c.batch_p2p(items, async_op, to_seconds(timeout)), *keep)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
