"""Point to point of the "pycoll" backend (pycollectives.backend): send and recv
are deferred and issued together as one Communicator.batch_p2p (_P2PMixin,
mixed into ProcessGroupPycoll), with the delays after which they are issued at
the latest. See docs/backend.md, "Point to point".
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ._backend_common import _live_groups
from ._backend_work import _Work
from .communicator import Communicator

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


def _flush_all_p2p() -> None:
    """Issues the deferred sends/recvs of every pycoll group of this process."""
    for g in list(_live_groups):
        if g._p2p:
            g._flush_p2p()


class _P2PMixin:
    """send/recv of ProcessGroupPycoll (mixed into it; uses its state and
    helpers): deferred, then issued as one batch by _flush_p2p."""

    # -- point to point ------------------------------------------------------------
    def _p2p_issue(self, c: Communicator, ops: list, a: bool = True) -> list:
        """Issues sends/recvs that progress together (core batch_p2p: in any
        order on either side, however many, without deadlock)."""
        return [c.batch_p2p(ops, async_op=a)] if ops else []

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
                works = self._p2p_issue(self._comm, [p[:3] for p in pend])
            except BaseException as e:  # noqa: BLE001 - handed to the Futures
                for f in futs:
                    f.set_exception(e)
                return
            copies = [c for p in pend for c in p[5]]
            self._submit(works, futs, [p[4] for p in pend], copies, pend)
