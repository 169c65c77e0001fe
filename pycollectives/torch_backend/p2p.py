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
    """The deferred sends and receives of one group, in issue order."""

    def __init__(self) -> None:
        self.pending: list[Deferred] = []
        self._last = 0.0  # when the last one was added
        self._batch = False  # one comes from batch_isend_irecv

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, d: Deferred) -> bool:
        """Queues `d`; True when it is the first pending one."""
        first = not self.pending
        self.pending.append(d)
        self._last = time.monotonic()
        self._batch = self._batch or in_batch_isend_irecv()
        return first

    def due(self) -> bool:
        """Whether the pending ones have waited their delay."""
        delay = P2P_BATCH_FLUSH_DELAY_S if self._batch else P2P_FLUSH_DELAY_S
        return bool(self.pending) and time.monotonic() - self._last >= delay

    def take(self) -> list[Deferred]:
        """Removes and returns every pending one."""
        pend, self.pending, self._batch = self.pending, [], False
        return pend
