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

The class is assembled from mixins, one module each: _backend_collectives (the
core collectives), _backend_p2p_collectives (all-to-all, gather, scatter),
_backend_p2p (deferred send/recv), _backend_common (argument helpers, the live
groups); the Work is in _backend_work.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._backend_collectives import _CollectivesMixin
from ._backend_common import _ArgsMixin, _groups_lock, _live_groups
from ._backend_p2p import P2P_BATCH_FLUSH_DELAY_S, P2P_FLUSH_DELAY_S, _flush_all_p2p, _P2PMixin
from ._backend_p2p_collectives import _P2PCollectivesMixin
from ._backend_register import BACKEND_NAME
from ._backend_work import _Work
from .communicator import Communicator
from .communicator import ReduceOp as ReduceOp  # re-exported, as before the split
from .rendezvous import init as _init_communicator


class ProcessGroupPycoll(
    _CollectivesMixin, _P2PCollectivesMixin, _P2PMixin, _ArgsMixin, dist.ProcessGroup
):
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
