"""The Work every call of the "pycoll" backend returns: a torch.distributed.Work
completed through a torch Future (by the group's completion thread, or at
once for a synchronous call)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist


class PycollWork(dist.Work):
    """Work of one torch call. wait() raises the operation's error (torch's
    _create_work_from_future Work would return True and drop it).

    `flush` issues the group's deferred sends and receives (a wait on one of
    them, or a poll, must not wait for the flush timer); `source`, for a
    receive from any source, returns the sender's rank once it completed."""

    def __init__(
        self,
        fut: torch.futures.Future,
        flush: Callable[[], None],
        describe: Callable[[str, str], str],
        source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self._fut = fut
        self._flush = flush
        self._describe = describe  # (operation, message) -> error text naming the rank
        self._source = source
        self._done: threading.Event | None = None  # set on completion; made by a timed wait

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Waits for the operation and returns True; raises its error. Without
        `timeout` (or 0, torch's "none") the group's timeout bounds the wait;
        with one, raises TimeoutError if the operation is not done by then."""
        self._flush()
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and not self._fut.done():
            done = self._done
            if done is None:  # one callback per Work, however often it is waited on
                done = self._done = threading.Event()
                self._fut.add_done_callback(lambda _, d=done: d.set())
            if not done.wait(seconds):
                raise TimeoutError(
                    self._describe(
                        "wait",
                        f"Timed out waiting {round(seconds * 1e3)}ms for the operation to complete",
                    )
                )
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""
        self._flush()
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
        self._flush()
        return self._fut

    def result(self) -> list[torch.Tensor]:
        """The tensors of the operation, after waiting for it."""
        self.wait()
        return self._fut.value()

    def _source_rank(self) -> int:
        """The sender's group rank of a completed receive from any source
        (what torch.distributed.recv returns); RuntimeError for another Work."""
        if self._source is None:
            raise RuntimeError(
                self._describe("source_rank", "only a receive from any source has a source rank")
            )
        self.wait()
        return self._source()

    source_rank = _source_rank
