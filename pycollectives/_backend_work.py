"""The Work of the "pycoll" backend (pycollectives.backend): _Work, the
torch.distributed.Work that every ProcessGroupPycoll call returns, completed
through a torch Future by the group's completion thread.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .backend import ProcessGroupPycoll


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
        self._done: threading.Event | None = None  # set on completion; made by a timed wait

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Waits for the operation and returns True; raises its error. Without
        `timeout` (or 0, torch's "none") the group's timeout bounds the wait;
        with one, raises TimeoutError if the operation is not done by then."""
        if self._pg._p2p:
            self._pg._flush_p2p()
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and not self._fut.done():
            done = self._done
            if done is None:  # one callback per Work, however often it is waited on
                done = self._done = threading.Event()
                self._fut.add_done_callback(lambda _, d=done: d.set())
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
