"""ProcessGroupPycoll: the torch.distributed ProcessGroup of the "pycoll" backend.

Every group (the default one, `new_group`, DeviceMesh dimensions) gets its
own Communicator. Calls are issued on the caller's thread, in call order: a
synchronous torch call (opts.asyncOp False) runs its core operations there
and returns a completed Work; the others become asynchronous core operations
(run by the Communicator's progress thread), and the group's completion
thread completes the Works in issue order. Sends and receives are deferred
and issued in batches (p2p.py). This class parses torch's call forms and
hands each call to the module that plans it (collectives, p2p_collectives,
sparse).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..communicator import Communicator, to_seconds
from ..rendezvous import init as _init_communicator
from . import collectives as coll
from . import groups
from . import p2p_collectives as p2pc
from .args import Args
from .completion import Completer
from .monitored_barrier import monitored_barrier as run_monitored_barrier
from .options import CallOptions, call_options
from .p2p import P2P_FLUSH_DELAY_S, DeferredP2P
from .planned_call import Launch
from .registration import BACKEND_NAME
from .sparse import is_sparse, sparse_allreduce
from .work import PycollWork


class ProcessGroupPycoll(dist.ProcessGroup):
    """A torch.distributed ProcessGroup backed by one pycollectives Communicator.

    Created by torch through the registered creator (`init_process_group("pycoll")`,
    `new_group(backend="pycoll")`, DeviceMesh); every rank of the group must
    create it. Each method takes the forms torch's ProcessGroup API takes
    (options objects, or the ReduceOp / root / timeout overloads). Raises what
    pycollectives.init raises (ValueError, CollectiveTimeout).
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
        self._args = Args(rank, size)
        self._group_name = group_name
        self._group_desc = ""
        self._comm: Communicator = _init_communicator(
            rank=rank,
            world_size=size,
            store=store,
            timeout=timeout,
            prefix=f"pycoll-pg/{group_name}",
        )
        self._timeout = to_seconds(timeout)  # the default of the group's operations
        self._lock = threading.RLock()  # issue order = call order across threads
        self._comm._issue_from_any_thread()  # the lock serializes them (the completion thread too)
        self._completer = Completer(
            f"pycoll-pg-{group_name}",
            wake_every=lambda: P2P_FLUSH_DELAY_S if self._p2p else None,
            on_idle=lambda: self._p2p.flush_if_due(),
        )
        self._p2p = DeferredP2P(self._comm, self._lock, self._completer, self._args)
        self._closed = False
        groups.add(self)

    # -- identity -----------------------------------------------------------------
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
            f"ProcessGroupPycoll(rank={self._args.rank}, size={self._args.size}, "
            f"name={self._group_name!r})"
        )

    # -- collectives ----------------------------------------------------------------
    def allreduce(
        self, tensors: Any, opts: Any = None, timeout: Any = None, *, op: Any = None
    ) -> dist.Work:
        """All-reduce of each tensor in place (SUM, AVG, PRODUCT, MIN, MAX,
        PREMUL_SUM; a sparse COO tensor: SUM). `opts`: AllreduceOptions, a
        ReduceOp or RedOpType, or None (SUM)."""
        o = call_options(self._args, "allreduce", opts, op=op, timeout=timeout)
        ts = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        if any(is_sparse(t) for t in ts):
            return self._launch(sparse_allreduce(self._args, list(ts), o), o)
        ts = self._args.tensors(ts, "allreduce", "tensors")
        value = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        return self._launch(coll.allreduce(self._args, ts, o, value), o)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> dist.Work:
        """All-reduce of several tensors as one call (one flat buffer per dtype)."""
        o = call_options(self._args, "allreduce_coalesced", opts)
        ts = self._args.tensors(tensors, "allreduce_coalesced", "tensors")
        return self._launch(coll.allreduce_coalesced(self._args, ts, o), o)

    def broadcast(
        self, tensors: Any, opts: Any = None, timeout: Any = None, *, root: Any = None
    ) -> dist.Work:
        """Broadcast of the root's tensor, in place. `opts`: BroadcastOptions or the root rank."""
        o = call_options(self._args, "broadcast", opts, root=root, timeout=timeout, rooted=True)
        t = self._args.one(tensors, "broadcast")
        return self._launch(coll.broadcast(self._args, t, o), o)

    def allgather(
        self, output_tensors: list, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> dist.Work:
        """All-gather: output_tensors[0][r] (or output_tensors[r] with one input
        tensor, torch's other form) gets rank r's tensor."""
        name = "allgather"
        o = call_options(self._args, name, opts, timeout=timeout)
        inp = self._args.one(input_tensors, name, "input_tensors")
        if isinstance(input_tensors, torch.Tensor):  # allgather(list, tensor)
            outs, value = output_tensors, [output_tensors]
        elif len(output_tensors) == 1:
            outs, value = output_tensors[0], output_tensors
        else:
            raise ValueError(
                self._args.err(name, f"output_tensors must be [list of {self._args.size} tensors]")
            )
        return self._launch(coll.allgather(self._args, outs, inp, o, value), o)

    def allgather_coalesced(
        self, output_lists: list, input_list: list, opts: Any = None
    ) -> dist.Work:
        """All-gather of several tensors as one call: output_lists[r][i] gets
        rank r's input_list[i] (torch's layout, as gloo)."""
        o = call_options(self._args, "allgather_coalesced", opts)
        return self._launch(coll.allgather_coalesced(self._args, output_lists, input_list, o), o)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch's name
        opts: Any = None,
    ) -> dist.Work:
        """All-gather into one tensor (torch's all_gather_into_tensor)."""
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None, name: str = ""
    ) -> dist.Work:
        """Several all_gather_into_tensor as one call (completed with `outputs`)."""
        name = name or "all_gather_into_tensor_coalesced"
        o = call_options(self._args, name, opts)
        return self._launch(coll.all_gather_into_tensors(self._args, name, outputs, inputs, o), o)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self,
        output_tensors: Any,
        input_tensors: list,
        opts: Any = None,
        timeout: Any = None,
        *,
        op: Any = None,
    ) -> dist.Work:
        """Reduce-scatter of input_tensors[0], a list of world_size tensors, into
        output_tensors[0] (or of a list into one tensor, torch's other form)."""
        name = "reduce_scatter"
        o = call_options(self._args, name, opts, op=op, timeout=timeout)
        out = self._args.one(output_tensors, name, "output_tensors")
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(tensor, list, op)
            ins = input_tensors
        elif len(input_tensors) == 1:
            ins = input_tensors[0]
        else:
            raise ValueError(
                self._args.err(name, f"input_tensors must be [list of {self._args.size} tensors]")
            )
        return self._launch(coll.reduce_scatter(self._args, out, ins, o), o)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch's name
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
        """Several reduce_scatter_tensor as one call (completed with `outputs`)."""
        name = name or "reduce_scatter_tensor_coalesced"
        o = call_options(self._args, name, opts)
        return self._launch(coll.reduce_scatter_tensors(self._args, name, outputs, inputs, o), o)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(
        self,
        tensors: Any,
        opts: Any = None,
        op: Any = None,
        timeout: Any = None,
        *,
        root: Any = None,
    ) -> dist.Work:
        """Reduce into the root's tensor (the others' stay unchanged). `opts`:
        ReduceOptions, or the root rank with `op` after it."""
        o = call_options(self._args, "reduce", opts, op=op, root=root, timeout=timeout, rooted=True)
        t = self._args.one(tensors, "reduce")
        return self._launch(coll.reduce(self._args, t, o), o)

    def barrier(self, opts: Any = None, timeout: Any = None) -> dist.Work:
        """Completes once every rank of the group has entered the barrier.
        `opts`: BarrierOptions or a timeout."""
        o = call_options(self._args, "barrier", opts, timeout=timeout)
        return self._launch(coll.barrier(o), o)

    def monitored_barrier(
        self, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's debugging barrier: rank 0 names the ranks that did not arrive
        within `timeout` (the group's by default), the first or, with
        `wait_all_ranks`, all of them; RuntimeError on every rank that took
        part (monitored_barrier.py)."""
        seconds = call_options(self._args, "monitored_barrier", None, timeout=timeout).timeout
        if timeout is not None and seconds is None:  # 0 or negative: no time at all
            seconds = 0.0
        if groups.any_deferred_p2p():
            groups.flush_all_p2p()
        with self._lock:
            run_monitored_barrier(
                self._comm,
                self._args,
                self._timeout if seconds is None else seconds,
                wait_all_ranks,
            )

    # -- collectives built on point to point ------------------------------------------
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch's name
        output_split_sizes: list,
        input_split_sizes: list,
        opts: Any = None,
    ) -> dist.Work:
        """All-to-all of one tensor, even (no splits) or with split sizes along dim 0."""
        o = call_options(self._args, "all_to_all_single", opts)
        return self._launch(
            p2pc.all_to_all_single(
                self._args, output, input, output_split_sizes, input_split_sizes, o
            ),
            o,
        )

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """All-to-all of lists: input_tensors[j] goes to rank j's output_tensors[rank]."""
        o = call_options(self._args, "alltoall", opts)
        return self._launch(p2pc.alltoall(self._args, output_tensors, input_tensors, o), o)

    def gather(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> dist.Work:
        """Gather to the root: output_tensors[0][r] gets rank r's input. `opts`:
        GatherOptions, or the root rank (with a list and a tensor, torch's other form)."""
        o = call_options(self._args, "gather", opts, timeout=timeout, rooted=True)
        if isinstance(input_tensors, torch.Tensor):  # gather(list, tensor, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        return self._launch(
            p2pc.rooted(self._args, "gather", output_tensors, input_tensors, o, to_root=True), o
        )

    def scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> dist.Work:
        """Scatter from the root: rank r's output gets input_tensors[0][r]. `opts`:
        ScatterOptions, or the root rank (with a tensor and a list, torch's other form)."""
        o = call_options(self._args, "scatter", opts, timeout=timeout, rooted=True)
        if isinstance(output_tensors, torch.Tensor):  # scatter(tensor, list, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        return self._launch(
            p2pc.rooted(self._args, "scatter", output_tensors, input_tensors, o, to_root=False),
            o,
        )

    # -- point to point --------------------------------------------------------------------
    def send(self, tensors: list, dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        """Sends the tensor to group rank dstRank (deferred: p2p.py)."""
        t = self._args.one(tensors, "send")
        peer = self._args.peer(dstRank, "send", "dst")
        return self._defer("send", self._args.buf(t, None), peer, list(tensors), [])

    def recv(self, tensors: list, srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        """Receives into the tensor from group rank srcRank (deferred: p2p.py)."""
        t = self._args.one(tensors, "recv")
        peer = self._args.peer(srcRank, "recv", "src")
        copies: list = []
        return self._defer("recv", self._args.buf(t, copies), peer, list(tensors), copies)

    def recv_anysource(self, tensors: list, tag: int = 0) -> dist.Work:
        """Receives into the tensor the next message any rank sends this one;
        the Work's `_source_rank()` names the sender. Issued at once, after the
        deferred sends and receives (it does not progress with them)."""
        return self._launch(p2pc.recv_any(self._args, tensors), CallOptions())

    def _defer(
        self, kind: str, buf: torch.Tensor, peer: int, value: list, copies: list
    ) -> dist.Work:
        if self._closed:
            raise RuntimeError(self._args.err(kind, "the process group was shut down"))
        return self._work(self._p2p.defer(kind, buf, peer, value, copies))

    def has_deferred_p2p(self) -> bool:
        """Whether sends or receives wait to be issued."""
        return bool(self._p2p)

    def flush_p2p(self) -> None:
        """Issues the deferred sends and receives as one batch (they progress together)."""
        self._p2p.flush()

    # -- issue and completion -------------------------------------------------------------
    def _work(self, fut: torch.futures.Future, launch: Launch | None = None) -> PycollWork:
        source = launch.source if launch is not None else None
        return PycollWork(fut, self._flush_if_deferred, self._args.err, source)

    def _flush_if_deferred(self) -> None:
        if self._p2p:
            self._p2p.flush()

    def _launch(self, launch: Launch, o: CallOptions) -> PycollWork:
        """Issues one torch call (synchronously where torch waits at once:
        Launch.start) and returns its Work."""
        if self._closed:
            raise RuntimeError(self._args.err(launch.name, "the process group was shut down"))
        if groups.any_deferred_p2p():
            groups.flush_all_p2p()
        fut = launch.start(self._comm, self._lock, self._completer, o.async_op)
        return self._work(fut, launch)

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finishes pending operations, stops the completion thread, closes the
        Communicator (idempotent)."""
        if self._closed:
            return
        self.flush_p2p()
        self._closed = True
        self._completer.close()
        self._comm.close()
        groups.remove(self)

    def abort(self) -> None:
        """Closes the Communicator without waiting for the completion thread."""
        self._closed = True
        self._comm.close()
        groups.remove(self)
