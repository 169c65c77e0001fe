"""Point-to-point operations of the Communicator: send, recv (from one rank or
any) and batch_p2p, on CPU buffers through the core and on CUDA tensors
through the core's CUDA path or, across hosts, host staging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _C
from ._buffers import describe, is_cuda_buffer
from ._args import cuda_args, cuda_ret, stage, stage_batch_p2p
from ._staging import Staged
from .work import Timeout, Work, to_seconds

Buffer = Any  # torch.Tensor | numpy.ndarray


class PointToPoint:
    """Mixed into Communicator, whose state (the core `_c`, its fast path
    `_fast`, `rank`, `_across_hosts`) and helpers (`_root`, `_ret`) these use."""

    rank: int
    _c: Any
    _fast: Any
    _across_hosts: bool

    def send(
        self, tensor: Buffer, dst: int, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Sends `tensor` to rank `dst`; returns once it is buffered or delivered."""
        if not async_op and timeout is None and self._fast.send(tensor, dst):
            return None
        if is_cuda_buffer(tensor):
            [(ptr, n, dt)], dev, stream = cuda_args(self, "send", (tensor, "tensor", False))
            dst = self._root(dst, "dst", "send")
            if self._across_hosts:
                call = lambda h, a: self.send(h[0], dst, async_op=a, timeout=timeout)  # noqa: E731
                return stage(self, [Staged(tensor, "tensor", True, False)], call, async_op)
            w = _C.cuda_send(self._c, ptr, n, dt, dst, dev, stream(), async_op, to_seconds(timeout))
            return cuda_ret(self, w, async_op, stream, tensor)
        ptr, n, dt = describe(tensor, self.rank, "send", "tensor", writable=False)
        dst = self._root(dst, "dst", "send")
        return self._ret(self._c.send(ptr, n, dt, dst, async_op, to_seconds(timeout)), tensor)

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
        if is_cuda_buffer(tensor):
            [(ptr, n, dt)], dev, stream = cuda_args(self, "recv", (tensor, "tensor", True))
            src = self._root(src, "src", "recv")
            if self._across_hosts:
                call = lambda h, a: self.recv(h[0], src, async_op=a, timeout=timeout)  # noqa: E731
                return stage(self, [Staged(tensor, "tensor", False, True)], call, async_op)
            w = _C.cuda_recv(self._c, ptr, n, dt, src, dev, stream(), async_op, to_seconds(timeout))
            w = cuda_ret(self, w, async_op, stream, tensor)
            return src if w is None else w
        ptr, n, dt = describe(tensor, self.rank, "recv", "tensor")
        src = self._root(src, "src", "recv")
        w = self._ret(self._c.recv(ptr, n, dt, src, async_op, to_seconds(timeout)), tensor)
        return src if w is None else w

    def _recv_any(self, tensor: Buffer, async_op: bool, timeout: Timeout) -> int | Work:
        """recv(src=None): from whichever peer sends first (across hosts, a CUDA
        tensor through a host copy)."""
        if is_cuda_buffer(tensor) and self._across_hosts:
            cuda_args(self, "recv", (tensor, "tensor", True))
            call = lambda h, a: self._recv_any(h[0], a, timeout)  # noqa: E731
            return stage(self, [Staged(tensor, "tensor", False, True)], call, async_op)
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
        if self._across_hosts and any(
            isinstance(op, tuple) and len(op) == 3 and is_cuda_buffer(op[1]) for op in ops
        ):
            return stage_batch_p2p(self, ops, async_op, timeout)
        name = "batch_p2p"
        items = []
        keep = []
        for i, op in enumerate(ops):
            if not (isinstance(op, tuple) and len(op) == 3 and op[0] in ("send", "recv")):
                raise ValueError(
                    f"pycollectives: rank {self.rank}: {name}: ops[{i}]={op!r} is not "
                    "('send', buffer, dst) or ('recv', buffer, src)"
                )
            kind, buf, peer = op
            is_send = kind == "send"
            arg = f"ops[{i}]"
            ptr, n, dt = describe(buf, self.rank, name, arg, writable=not is_send)
            self._root(peer, f"{arg} peer", name)
            items.append((is_send, ptr, n, dt, peer))
            keep.append(buf)
        return self._ret(self._c.batch_p2p(items, async_op, to_seconds(timeout)), *keep)
