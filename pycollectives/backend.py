"""The torch.distributed backend "pycoll": a ProcessGroup whose collectives run
on a pycollectives Communicator.

    import pycollectives  # registers "pycoll"
    torch.distributed.init_process_group("pycoll")  # or "cpu:pycoll,cuda:pycoll"

Every group (the default one, `new_group`, DeviceMesh dimensions) gets its own
Communicator. Operations are issued on the caller's thread, in call order:
synchronous torch calls (opts.asyncOp False) run there and return a completed
Work; the others become asynchronous pycollectives operations (run by the
Communicator's progress thread), and one completion thread per group waits for
them in issue order and completes the torch Futures behind the returned Works,
with the operation's error where it failed. Sends and recvs are deferred and
issued in batches (see _Work). See docs/backend.md.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._backend_register import BACKEND_NAME
from .communicator import Communicator, ReduceOp
from .rendezvous import init as _init_communicator

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {
    _RedOpType.SUM: ReduceOp.SUM,
    _RedOpType.AVG: ReduceOp.AVG,
    _RedOpType.PRODUCT: ReduceOp.PROD,
    _RedOpType.MIN: ReduceOp.MIN,
    _RedOpType.MAX: ReduceOp.MAX,
}
# Pending sends/recvs are issued together at the latest this long after the
# last one was added (they are issued at once by a wait on one of them or by
# any other operation of the process); those of a batch_isend_irecv call wait
# longer, so that a stalled caller cannot split its batch.
P2P_FLUSH_DELAY_S = 0.02
P2P_BATCH_FLUSH_DELAY_S = 2.0


def _in_batch_isend_irecv() -> bool:
    """True when torch's batch_isend_irecv is a caller (a few frames up)."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return False
        if f.f_code.co_name == "batch_isend_irecv":
            return True
        f = f.f_back
    return False


_groups_lock = threading.Lock()
_live_groups: list[ProcessGroupPycoll] = []


@atexit.register
def _close_all_at_exit() -> None:
    """Closes the Communicators of the groups the program did not destroy, before
    the interpreter tears down (their C++ threads must not outlive it)."""
    for g in list(_live_groups):
        with contextlib.suppress(Exception):  # nothing to report to at exit
            g.abort()


def _flush_all_p2p() -> None:
    """Issues the deferred sends/recvs of every pycoll group of this process."""
    for g in list(_live_groups):
        if g._p2p:
            g._flush_p2p()


class _Work(dist.Work):
    """Work of one torch call: completed by the group's completion thread,
    through a torch Future. wait() raises the operation's error (torch's
    _create_work_from_future Work would return True and drop it).

    Sends and recvs are deferred until waited on, polled, or until the next
    operation of the process, so that the sends and recvs torch's
    batch_isend_irecv issues one by one reach the core as one batch."""

    def __init__(self, pg: ProcessGroupPycoll, fut: torch.futures.Future) -> None:
        super().__init__()
        self._pg = pg
        self._fut = fut

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Waits for the operation and returns True; raises its error. Without
        `timeout` (or 0, torch's "none") the group's timeout bounds the wait;
        with one, raises TimeoutError if the operation is not done by then."""
        if self._pg._p2p:
            self._pg._flush_p2p()
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and not self._fut.done():
            done = threading.Event()
            self._fut.add_done_callback(lambda _: done.set())
            if not done.wait(seconds):
                raise TimeoutError(
                    self._pg._err("wait", f"the operation did not complete within {seconds} s")
                )
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""
        if self._pg._p2p:
            self._pg._flush_p2p()
        return self._fut.done()

    def is_success(self) -> bool:
        """True once the operation finished without error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error once it failed, else None."""
        if not self._fut.done():
            return None
        try:
            self._fut.wait()
        except Exception as e:  # noqa: BLE001 - returned, not raised
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        """A Future completed with the operation's tensors (or its error)."""
        if self._pg._p2p:
            self._pg._flush_p2p()
        return self._fut

    def result(self) -> list[torch.Tensor]:
        """The tensors of the operation, after waiting for it."""
        self.wait()
        return self._fut.value()


class ProcessGroupPycoll(dist.ProcessGroup):
    """A torch.distributed ProcessGroup backed by one pycollectives Communicator.

    Created by torch through the registered creator (`init_process_group("pycoll")`,
    `new_group(backend="pycoll")`, DeviceMesh); every rank of the group must create
    it. Raises what pycollectives.init raises (ValueError, CollectiveTimeout).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: datetime.timedelta | float,
        group_name: str = "",
    ) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._group_name = group_name
        self._group_desc = ""
        self._comm: Communicator = _init_communicator(
            rank=rank,
            world_size=size,
            store=store,
            timeout=timeout,
            prefix=f"pycoll-pg/{group_name}",
        )
        self._batch_p2p = getattr(self._comm, "batch_p2p", None)
        self._lock = threading.RLock()  # issue order = call order across threads
        self._p2p: list[tuple] = []  # deferred (kind, buf, peer, fut, value, copies, keep)
        self._p2p_last = 0.0
        self._p2p_batch = False  # a pending op comes from batch_isend_irecv
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        with _groups_lock:
            _live_groups.append(self)

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, "pycoll"."""
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        """The name torch registered this group under."""
        return self._group_name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch registered this group under."""
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Called by torch after creation."""
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """The group's description (torch's group_desc)."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Called by torch after creation."""
        self._group_desc = desc

    @property
    def communicator(self) -> Communicator:
        """The pycollectives Communicator of this group."""
        return self._comm

    def __repr__(self) -> str:
        return (
            f"ProcessGroupPycoll(rank={self._rank}, size={self._size}, name={self._group_name!r})"
        )

    # -- completion ----------------------------------------------------------
    def _err(self, name: str, msg: str) -> str:
        return f"pycollectives: rank {self._rank}: {name}: {msg}"

    def _complete_loop(self) -> None:
        """Completion thread: waits for the core operations in issue order and
        completes their Futures; issues deferred sends/recvs when idle."""
        q = self._queue
        while True:
            try:
                item = q.get(timeout=P2P_FLUSH_DELAY_S if self._p2p else None)
            except queue.Empty:
                delay = P2P_BATCH_FLUSH_DELAY_S if self._p2p_batch else P2P_FLUSH_DELAY_S
                if self._p2p and time.monotonic() - self._p2p_last >= delay:
                    self._flush_p2p()
                continue
            if item is None:
                return
            works, futs, values, copies, _keep = item
            try:
                for w in works:
                    w._work.wait(-1.0)  # the core's own timeout bounds this
                for dst, src in copies:
                    dst.copy_(src)
            except BaseException as e:  # noqa: BLE001 - handed to the Futures
                for f in futs:
                    f.set_exception(e)
                del item, works, futs, values, copies, _keep, e
                continue
            for f, v in zip(futs, values, strict=True):
                f.set_result(v)
            del item, works, futs, values, copies, _keep  # free the buffers now

    def _submit(
        self, works: list, futs: list, values: list, copies: Sequence = (), keep: Any = None
    ) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._complete_loop, name=f"pycoll-pg-{self._group_name}", daemon=True
            )
            self._thread.start()
        self._queue.put((works, futs, values, copies, keep))

    def _launch(
        self,
        name: str,
        issue: Callable[[Communicator, bool], list],
        value: Any,
        copies: Sequence = (),
        keep: Any = None,
        opts: Any = None,
    ) -> dist.Work:
        """Issues the core operations of one torch call and returns its Work.

        Where torch says the caller waits at once (`opts.asyncOp` False: the
        synchronous torch.distributed calls), the operations run synchronously
        (the core's fast path on this thread, no hand-off to the progress and
        completion threads) and the Work returned is complete. Otherwise they
        are asynchronous and the completion thread completes the Work."""
        if self._closed:
            raise RuntimeError(self._err(name, "the process group was shut down"))
        if _live_groups and any(g._p2p for g in _live_groups):
            _flush_all_p2p()
        fut = torch.futures.Future()
        if opts is not None and not getattr(opts, "asyncOp", True):
            with self._lock:
                issue(self._comm, False)
            for dst, src in copies:
                dst.copy_(src)
            fut.set_result(value)
            return _Work(self, fut)
        with self._lock:
            works = issue(self._comm, True)
        if not works and not copies:
            fut.set_result(value)
        else:
            self._submit(works, [fut], [value], copies, keep)
        return _Work(self, fut)

    # -- argument helpers ------------------------------------------------------
    def _tensor(self, t: Any, name: str, arg: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                self._err(name, f"{arg} must be a torch.Tensor, not {type(t).__name__}")
            )
        return t

    def _one(self, tensors: Any, name: str, arg: str = "tensors") -> torch.Tensor:
        if isinstance(tensors, torch.Tensor):
            return self._tensor(tensors, name, arg)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(self._err(name, f"{arg} must hold exactly one tensor, got {n}"))
        return self._tensor(tensors[0], name, arg)

    def _buf(self, t: torch.Tensor, copies: list | None, complex_ok: bool = True) -> torch.Tensor:
        """A contiguous real view of `t` for the core; where `t` is not
        contiguous a copy, copied back into `t` afterwards if `copies` is a list."""
        buf = t
        if not buf.is_contiguous():
            buf = buf.contiguous()
            if copies is not None:
                copies.append((t, buf))
        if buf.is_complex():
            buf = torch.view_as_real(buf)
        return buf

    def _peer(self, peer: Any, name: str, arg: str) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self._size:
            raise ValueError(self._err(name, f"{arg}={peer!r} is out of range [0, {self._size})"))
        return peer

    def _op(self, opts: Any, name: str, tensors: Sequence[torch.Tensor]) -> tuple[ReduceOp, Any]:
        """(pycollectives op, PREMUL_SUM factor or None) of torch options."""
        rop = getattr(opts, "reduceOp", opts)
        if rop is None:
            rop = dist.ReduceOp.SUM
        kind = rop.op if isinstance(rop, dist.ReduceOp) else rop
        factor = None
        if kind == _RedOpType.PREMUL_SUM:
            factor, code = rop.factor, ReduceOp.SUM
        else:
            code = _OPS.get(kind)
            if code is None:
                raise ValueError(
                    self._err(
                        name,
                        f"op={kind} is not supported (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)",
                    )
                )
        if code not in (ReduceOp.SUM, ReduceOp.AVG) and any(t.is_complex() for t in tensors):
            raise ValueError(self._err(name, f"op={kind} is not defined for complex tensors"))
        return code, factor

    # -- collectives -------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """All-reduce of each tensor in place (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)."""
        name = "allreduce"
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        ts = [self._tensor(t, name, "tensors") for t in tensors]
        op, factor = self._op(opts, name, ts)
        if factor is not None:  # PREMUL_SUM: scale, then sum (in place, as NCCL)
            for t in ts:
                t.mul_(factor)
        copies: list = []
        bufs = [self._buf(t, copies) for t in ts]

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_reduce(b, op, async_op=a) for b in bufs]

        return self._launch(name, issue, list(tensors), copies, bufs, opts=opts)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> dist.Work:
        """All-reduce of several tensors as one operation (one flat buffer per dtype)."""
        name = "allreduce_coalesced"
        ts = [self._tensor(t, name, "tensors") for t in tensors]
        op, factor = self._op(opts, name, ts)
        if factor is not None:
            for t in ts:
                t.mul_(factor)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in ts:
            groups.setdefault(t.dtype, []).append(t)
        flats, copies = [], []
        for dt_ts in groups.values():
            if len(dt_ts) == 1:
                flats.append(self._buf(dt_ts[0], copies))
                continue
            flat = torch.cat([t.reshape(-1) for t in dt_ts])
            flats.append(self._buf(flat, None))
            off = 0
            for t in dt_ts:
                n = t.numel()
                copies.append((t, flat[off : off + n].view(t.shape)))
                off += n

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_reduce(f, op, async_op=a) for f in flats]

        return self._launch(name, issue, list(tensors), copies, flats, opts=opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        """Broadcast of rank opts.rootRank's tensor, in place."""
        name = "broadcast"
        t = self._one(tensors, name)
        root = self._peer(getattr(opts, "rootRank", 0), name, "src")
        copies: list = []
        buf = self._buf(t, copies)

        def issue(c: Communicator, a: bool) -> list:
            return [c.broadcast(buf, root, async_op=a)]

        return self._launch(name, issue, [t], copies, buf, opts=opts)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """All-gather into a list of world_size tensors (output_tensors[0])."""
        name = "allgather"
        inp = self._one(input_tensors, name, "input_tensors")
        outs = output_tensors[0] if output_tensors else []
        if len(output_tensors) != 1 or len(outs) != self._size:
            raise ValueError(
                self._err(name, f"output_tensors must be [list of {self._size} tensors]")
            )
        for o in outs:
            self._tensor(o, name, "output_tensors")
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError(
                    self._err(
                        name,
                        f"output tensor of {o.numel()} {o.dtype} elements does not match the "
                        f"input ({inp.numel()} {inp.dtype})",
                    )
                )
        src = inp.contiguous()
        flat = torch.empty((self._size, *src.shape), dtype=src.dtype, device=src.device)
        copies = [(o, flat[r].view_as(o)) for r, o in enumerate(outs)]
        src, flat = self._buf(src, None), self._buf(flat, None)

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_gather(flat, src, async_op=a)]

        return self._launch(name, issue, output_tensors, copies, (src, flat), opts=opts)

    def allgather_coalesced(
        self, output_lists: list, input_list: list, opts: Any = None
    ) -> dist.Work:
        """All-gather of several tensors: output_lists[i] gets every rank's input_list[i]."""
        name = "allgather_coalesced"
        if len(output_lists) != len(input_list):
            raise ValueError(self._err(name, "output_lists and input_list differ in length"))
        works = [
            self.allgather([outs], [inp], opts)
            for outs, inp in zip(output_lists, input_list, strict=True)
        ]
        if not works:
            return self._launch(name, lambda c, a: [], output_lists, opts=opts)
        return works[-1]  # the Works of a group complete in issue order

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> dist.Work:
        """All-gather into one tensor (torch's all_gather_into_tensor)."""
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None, name: str = ""
    ) -> dist.Work:
        """Several all_gather_into_tensor as one Work (completed with `outputs`)."""
        name = name or "all_gather_into_tensor_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(self._err(name, "outputs and inputs differ in length"))
        copies: list = []
        pairs = [
            (
                self._buf(self._tensor(o, name, "output"), copies),
                self._buf(self._tensor(i, name, "input"), None),
            )
            for o, i in zip(outputs, inputs, strict=True)
        ]

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_gather(ob, ib, async_op=a) for ob, ib in pairs]

        return self._launch(name, issue, list(outputs), copies, pairs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self, output_tensors: list, input_tensors: list, opts: Any = None
    ) -> dist.Work:
        """Reduce-scatter of a list of world_size tensors into output_tensors[0]."""
        name = "reduce_scatter"
        out = self._one(output_tensors, name, "output_tensors")
        ins = input_tensors[0] if input_tensors else []
        if len(input_tensors) != 1 or len(ins) != self._size:
            raise ValueError(
                self._err(name, f"input_tensors must be [list of {self._size} tensors]")
            )
        ins = [self._tensor(t, name, "input_tensors") for t in ins]
        op, factor = self._op(opts, name, [out, *ins])
        flat = torch.cat([self._buf(t, None).reshape(-1) for t in ins])
        if factor is not None:
            flat.mul_(factor)
        copies: list = []
        ob = self._buf(out, copies)

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce_scatter(ob, flat, op, async_op=a)]

        return self._launch(name, issue, [out], copies, (ob, flat), opts=opts)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> dist.Work:
        """Reduce-scatter of one tensor (torch's reduce_scatter_tensor)."""
        return self.reduce_scatter_single_coalesced(
            [output], [input], opts, "reduce_scatter_tensor"
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None, name: str = ""
    ) -> dist.Work:
        """Several reduce_scatter_tensor as one Work (completed with `outputs`)."""
        name = name or "reduce_scatter_tensor_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(self._err(name, "outputs and inputs differ in length"))
        outs = [self._tensor(o, name, "output") for o in outputs]
        ins = [self._tensor(i, name, "input") for i in inputs]
        op, factor = self._op(opts, name, outs + ins)
        copies: list = []
        pairs = []
        for o, i in zip(outs, ins, strict=True):
            ib = self._buf(i, None)
            if factor is not None:  # PREMUL_SUM: scale a copy (the input stays as it was)
                ib = ib.mul(factor)
            pairs.append((self._buf(o, copies), ib))

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce_scatter(ob, ib, op, async_op=a) for ob, ib in pairs]

        return self._launch(name, issue, list(outputs), copies, pairs, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """Reduce into rank opts.rootRank's tensor (others unchanged)."""
        name = "reduce"
        t = self._one(tensors, name)
        root = self._peer(getattr(opts, "rootRank", 0), name, "dst")
        op, factor = self._op(opts, name, [t])
        copies: list = []
        buf = self._buf(t, copies)
        if factor is not None:
            if self._rank == root:
                buf.mul_(factor)
            else:  # other ranks' tensors stay unchanged
                buf = buf.mul(factor)
                copies = []

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce(buf, root, op, async_op=a)]

        return self._launch(name, issue, [t], copies, buf, opts=opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        """Completes once every rank of the group has entered the barrier."""

        def issue(c: Communicator, a: bool) -> list:
            return [c.barrier(async_op=a)]

        return self._launch("barrier", issue, [], opts=opts)

    # -- point to point and the collectives built on it ----------------------------
    def _p2p_issue(self, c: Communicator, name: str, ops: list, a: bool = True) -> list:
        """Issues sends/recvs that progress together (core batch_p2p)."""
        if not ops:
            return []
        if self._batch_p2p is not None:
            return [c.batch_p2p(ops, async_op=a)]
        # Without batch_p2p (an older core): sends first would deadlock beyond the
        # slot capacity, so order them: lower rank sends first to each peer.
        out = []
        for kind, buf, peer in ops:
            fn = c.send if kind == "send" else c.recv
            out.append(fn(buf, peer, async_op=a))
        return out

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list,
        input_split_sizes: list,
        opts: Any = None,
    ) -> dist.Work:
        """All-to-all of one tensor, even (no splits) or with split sizes along dim 0."""
        name = "all_to_all_single"
        out = self._tensor(output, name, "output")
        inp = self._tensor(input, name, "input")
        if out.dtype != inp.dtype:
            raise ValueError(
                self._err(name, f"output dtype {out.dtype} differs from input {inp.dtype}")
            )
        copies: list = []
        ob = self._buf(out, copies)
        ib = self._buf(inp, None)
        n = self._size
        if not output_split_sizes and not input_split_sizes:

            def issue(c: Communicator, a: bool) -> list:
                return [c.all_to_all(ob, ib, async_op=a)]

            return self._launch(name, issue, [output], copies, (ob, ib), opts=opts)
        in_rows = self._splits(input_split_sizes, inp, "input_split_sizes", name)
        out_rows = self._splits(output_split_sizes, out, "output_split_sizes", name)
        ib_rows = self._rows(ib, inp)
        ob_rows = self._rows(ob, out)
        in_blocks = torch.split(ib_rows, in_rows)
        out_blocks = torch.split(ob_rows, out_rows)
        ops = []
        for k in range(1, n):  # pair order: each rank sends to r+k and receives from r-k
            dst, src = (self._rank + k) % n, (self._rank - k) % n
            ops.append(("send", in_blocks[dst], dst))
            ops.append(("recv", out_blocks[src], src))
        me = self._rank

        def issue(c: Communicator, a: bool) -> list:
            if in_blocks[me].numel() != out_blocks[me].numel():
                raise ValueError(
                    self._err(name, f"input_split_sizes[{me}] and output_split_sizes[{me}] differ")
                )
            out_blocks[me].copy_(in_blocks[me])
            return self._p2p_issue(c, name, ops, a)

        return self._launch(name, issue, [output], copies, (ob, ib, ops), opts=opts)

    alltoall_base = all_to_all_single

    @staticmethod
    def _rows(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """`buf` (the core's view of `t`) as a 2-D tensor of t's dim-0 rows."""
        rows = t.shape[0] if t.dim() else 1
        return buf.reshape(rows, buf.numel() // rows if rows else 0)

    def _splits(self, splits: list, t: torch.Tensor, arg: str, name: str) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % self._size:
                raise ValueError(
                    self._err(
                        name, f"{arg} is empty but dim 0 ({rows}) is not divisible by {self._size}"
                    )
                )
            return [rows // self._size] * self._size
        splits = [int(s) for s in splits]
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                self._err(
                    name,
                    f"{arg}={splits} must be {self._size} non-negative sizes summing to dim 0 ({rows})",
                )
            )
        return splits

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """All-to-all of lists: input_tensors[j] goes to rank j's output_tensors[rank]."""
        name = "alltoall"
        n, me = self._size, self._rank
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(self._err(name, f"output and input lists must hold {n} tensors each"))
        outs = [self._tensor(t, name, "output_tensors") for t in output_tensors]
        ins = [self._tensor(t, name, "input_tensors") for t in input_tensors]
        copies: list = []
        obs = [self._buf(t, copies) for t in outs]
        ibs = [self._buf(t, None) for t in ins]
        ops = []
        for k in range(1, n):
            dst, src = (me + k) % n, (me - k) % n
            ops.append(("send", ibs[dst], dst))
            ops.append(("recv", obs[src], src))

        def issue(c: Communicator, a: bool) -> list:
            if obs[me].numel() != ibs[me].numel():
                raise ValueError(
                    self._err(name, f"output_tensors[{me}] and input_tensors[{me}] differ in size")
                )
            obs[me].copy_(ibs[me])
            return self._p2p_issue(c, name, ops, a)

        return self._launch(name, issue, output_tensors, copies, (obs, ibs), opts=opts)

    def gather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """Gather to rank opts.rootRank: output_tensors[0][r] gets rank r's input."""
        return self._rooted("gather", output_tensors, input_tensors, opts, to_root=True)

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """Scatter from rank opts.rootRank: rank r's output gets input_tensors[0][r]."""
        return self._rooted("scatter", output_tensors, input_tensors, opts, to_root=False)

    def _rooted(
        self, name: str, output_tensors: list, input_tensors: list, opts: Any, to_root: bool
    ) -> dist.Work:
        """Gather (to_root) or scatter as one batch of sends and receives: the
        root exchanges with every other rank; its own block is a local copy."""
        root = self._peer(getattr(opts, "rootRank", 0), name, "dst" if to_root else "src")
        # The root's side is a list of world_size tensors, the others' one tensor.
        many, many_arg = (
            (output_tensors, "output_tensors") if to_root else (input_tensors, "input_tensors")
        )
        one_list, one_arg = (
            (input_tensors, "input_tensors") if to_root else (output_tensors, "output_tensors")
        )
        copies: list = []
        one = self._buf(self._one(one_list, name, one_arg), None if to_root else copies)
        ops: list = []
        local = None
        if self._rank == root:
            blocks = many[0] if len(many) == 1 else None
            if blocks is None or len(blocks) != self._size:
                raise ValueError(
                    self._err(
                        name, f"on the root, {many_arg} must be [list of {self._size} tensors]"
                    )
                )
            bufs = [
                self._buf(self._tensor(t, name, many_arg), copies if to_root else None)
                for t in blocks
            ]
            kind = "recv" if to_root else "send"
            ops = [(kind, bufs[r], r) for r in range(self._size) if r != root]
            local = (bufs[root], one) if to_root else (one, bufs[root])  # (destination, source)
        else:
            if many and any(len(x) for x in many):
                raise ValueError(self._err(name, f"{many_arg} must be empty on non-root ranks"))
            ops = [("send" if to_root else "recv", one, root)]

        def issue(c: Communicator, a: bool) -> list:
            if local is not None:
                if local[0].numel() != local[1].numel():
                    raise ValueError(self._err(name, "output and input tensors differ in size"))
                local[0].copy_(local[1])
            return self._p2p_issue(c, name, ops, a)

        return self._launch(name, issue, output_tensors, copies, (one, ops), opts=opts)

    def send(self, tensors: list, dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        """Sends the tensor to group rank dstRank (deferred; see _Work)."""
        t = self._one(tensors, "send")
        peer = self._peer(dstRank, "send", "dst")
        return self._defer("send", self._buf(t, None), peer, list(tensors), [])

    def recv(self, tensors: list, srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        """Receives into the tensor from group rank srcRank (deferred; see _Work)."""
        t = self._one(tensors, "recv")
        peer = self._peer(srcRank, "recv", "src")
        copies: list = []
        return self._defer("recv", self._buf(t, copies), peer, list(tensors), copies)

    def recv_anysource(self, tensors: list, tag: int = 0) -> dist.Work:
        """Not supported: raises RuntimeError (a recv must name its source)."""
        raise RuntimeError(
            self._err("recv", "receiving from any source is not supported by pycoll; pass src")
        )

    def _defer(
        self, kind: str, buf: torch.Tensor, peer: int, value: list, copies: list
    ) -> dist.Work:
        if self._closed:
            raise RuntimeError(self._err(kind, "the process group was shut down"))
        if peer == self._rank:
            raise ValueError(self._err(kind, f"peer {peer} is this rank"))
        fut = torch.futures.Future()
        batch = _in_batch_isend_irecv()
        with self._lock:
            first = not self._p2p
            self._p2p.append((kind, buf, peer, fut, value, copies))
            self._p2p_last = time.monotonic()
            self._p2p_batch = self._p2p_batch or batch
        if first:  # wake the completion thread: it issues them if nothing else does
            self._submit([], [], [])
        return _Work(self, fut)

    def _flush_p2p(self) -> None:
        """Issues the deferred sends/recvs as one batch (they progress together)."""
        with self._lock:
            pend, self._p2p = self._p2p, []
            self._p2p_batch = False
            if not pend:
                return
            futs = [p[3] for p in pend]
            try:
                works = self._p2p_issue(self._comm, "batch_isend_irecv", [p[:3] for p in pend])
            except BaseException as e:  # noqa: BLE001 - handed to the Futures
                for f in futs:
                    f.set_exception(e)
                return
            copies = [c for p in pend for c in p[5]]
            self._submit(works, futs, [p[4] for p in pend], copies, pend)

    # -- lifetime ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finishes pending operations, stops the completion thread, closes the
        Communicator (idempotent)."""
        if self._closed:
            return
        self._flush_p2p()
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._comm.close()
        with _groups_lock:
            if self in _live_groups:
                _live_groups.remove(self)

    def abort(self) -> None:
        """Closes the Communicator without waiting for the completion thread."""
        self._closed = True
        self._comm.close()
        with _groups_lock:
            if self in _live_groups:
                _live_groups.remove(self)
