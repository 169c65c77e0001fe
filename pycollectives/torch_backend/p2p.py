"""Deferred point to point of the "pycoll" backend (docs/backend.md, "Point to
point"): torch hands a Python ProcessGroup the sends and receives of
batch_isend_irecv one by one, and two ranks that both send more than the
slots hold before receiving would wait for each other. So sends and receives
wait here and are issued together, as one Communicator.batch_p2p whose
messages progress concurrently: when one of them is waited on or polled, when
any other operation of the process is issued, or at the latest after a delay.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..communicator import Communicator
from .args import Args
from .completion import Completer
from .p2p_collectives import batch

# Pending sends/recvs are issued together at the latest this long after the
# last one was added; those of a batch_isend_irecv call wait longer, so that a
# stalled caller cannot split its batch.
P2P_FLUSH_DELAY_S = 0.02
P2P_BATCH_FLUSH_DELAY_S = 2.0


def in_batch_isend_irecv() -> bool:
    """True when torch's batch_isend_irecv is a caller (a few frames up)."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return False
        if f.f_code.co_name == "batch_isend_irecv":
            return True
        f = f.f_back
    return False


@dataclass
class Deferred:
    """One deferred send or receive: the core's ("send"|"recv", buffer, peer),
    its Future, the value that completes it and the copies back into the
    caller's tensors once it is done."""

    kind: str
    buf: torch.Tensor
    peer: int
    fut: torch.futures.Future
    value: Any
    copies: list = field(default_factory=list)


class DeferredP2P:
    """The deferred sends and receives of one group, in issue order: `defer`
    queues one, `flush` issues every pending one as one batch_p2p on `comm`,
    whose Works the `completer` waits for before completing their Futures.
    `lock` is the group's issue lock (issue order = call order)."""

    def __init__(self, comm: Communicator, lock: Any, completer: Completer, args: Args) -> None:
        self._comm = comm
        self._lock = lock
        self._completer = completer
        self._args = args
        self.pending: list[Deferred] = []
        self._last = 0.0  # when the last one was added
        self._batch = False  # one comes from batch_isend_irecv

    def __bool__(self) -> bool:
        return bool(self.pending)

    def defer(
        self, kind: str, buf: torch.Tensor, peer: int, value: Any, copies: list
    ) -> torch.futures.Future:
        """Queues a send or receive of `buf` with `peer`; returns the Future
        completed with `value` once it is done (and `copies` are made).
        Raises ValueError for this rank as the peer."""
        if peer == self._args.rank:
            raise ValueError(self._args.err(kind, f"peer {peer} is this rank"))
        fut = torch.futures.Future()
        with self._lock:
            first = not self.pending
            self.pending.append(Deferred(kind, buf, peer, fut, value, copies))
            self._last = time.monotonic()
            self._batch = self._batch or in_batch_isend_irecv()
        if first:  # wake the completion thread: it issues them if nothing else does
            self._completer.submit([], [], [])
        return fut

    def flush(self) -> None:
        """Issues every pending send and receive as one batch (they progress together)."""
        with self._lock:
            pend, self.pending, self._batch = self.pending, [], False
            if not pend:
                return
            try:
                works = batch(self._comm, [(d.kind, d.buf, d.peer) for d in pend], True)
            except BaseException as e:  # noqa: BLE001 - handed to the Futures
                for d in pend:
                    d.fut.set_exception(e)
                return
            copies = [c for d in pend for c in d.copies]
            self._completer.submit(
                works, [d.fut for d in pend], [d.value for d in pend], copies, pend
            )

    def flush_if_due(self) -> None:
        """Flushes once the pending ones have waited their delay (the completion
        thread's idle hook)."""
        delay = P2P_BATCH_FLUSH_DELAY_S if self._batch else P2P_FLUSH_DELAY_S
        if self.pending and time.monotonic() - self._last >= delay:
            self.flush()
