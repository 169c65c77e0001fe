"""Completion handles of asynchronous operations (Work, CudaWork) and the
timeouts they and the operations take."""

from __future__ import annotations

import datetime
import math
from typing import Any, Protocol

from .errors import PyCollectivesError

Timeout = float | datetime.timedelta | None


class Owner(Protocol):
    """What a Work needs of its communicator: dropping the buffers of the
    operations that completed."""

    def _prune(self) -> None: ...


def to_seconds(timeout: Timeout, what: str = "timeout") -> float:
    """Converts a timeout (seconds or timedelta; None: -1, the default) to seconds.

    An infinite or immense one (inf, 1e300, timedelta.max) waits forever (the
    core treats anything from 1e9 s on as no limit). Raises ValueError for a
    non-positive timeout or NaN, and TypeError for another type.
    """
    if timeout is None:
        return -1.0
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(
            f"pycollectives: {what} must be seconds or a timedelta, not {type(timeout).__name__}"
        )
    if isinstance(timeout, float) and math.isnan(timeout):
        raise ValueError(f"pycollectives: {what} must be > 0 seconds (inf: no limit), not nan")
    if timeout <= 0:
        raise ValueError(f"pycollectives: {what} must be > 0, not {timeout}")
    try:
        return float(timeout)
    except OverflowError:  # an int beyond any float
        return math.inf


class Work:
    """Handle of an asynchronous operation (its communicator keeps the buffers
    alive until the operation completes)."""

    __slots__ = ("_work", "_owner")

    def __init__(self, work: Any, owner: Owner) -> None:
        self._work = work
        self._owner = owner

    def wait(self, timeout: Timeout = None) -> bool:
        """Blocks until the operation is done and returns True; re-raises its
        error. With `timeout` (seconds or timedelta), returns False if it is
        not done by then."""
        done = self._work.wait(to_seconds(timeout))
        if done:
            self._owner._prune()
        return done

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._work.is_completed()

    def exception(self) -> BaseException | None:
        """The operation's error once it completed with one, else None."""
        if not self._work.is_completed():
            return None
        try:
            self._work.wait(-1.0)
        except PyCollectivesError as e:
            return e
        return None

    @property
    def source(self) -> int | None:
        """A receive from any source (``recv(t, None, async_op=True)``): the
        sender's rank once it completed; None before, and for other operations."""
        src = self._work.source
        return None if src < 0 else src


class CudaWork(Work):
    """Handle of an operation on CUDA buffers, with torch.distributed/NCCL
    stream semantics: wait() makes the caller's current CUDA stream wait for
    the operation, blocking the host only until the operation's last kernel
    has been enqueued (the host drives the handshakes with the peers)."""

    __slots__ = ("_stream",)

    def __init__(self, work: Any, owner: Owner, stream: Any) -> None:
        super().__init__(work, owner)
        self._stream = stream  # () -> the caller's current cudaStream_t, as an int

    def wait(self, timeout: Timeout = None) -> bool:
        """Makes the current CUDA stream wait for the operation and returns True;
        re-raises its error. With `timeout`, returns False if its last kernel
        was not enqueued by then."""
        done = self._work.wait_stream(self._stream(), to_seconds(timeout))
        if done:
            self._owner._prune()
        return done

    def synchronize(self, timeout: Timeout = None) -> bool:
        """Blocks the host until every kernel of the operation has completed;
        re-raises its error. With `timeout`, returns False if not done by then."""
        return self._work.wait(to_seconds(timeout))
