"""The live "pycoll" groups of this process: closed at exit (their C++ threads
must not outlive the interpreter), and flushed together (an operation of any
group first issues every group's deferred sends and receives)."""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Protocol


class Group(Protocol):
    """What the registry needs of a group."""

    def has_deferred_p2p(self) -> bool: ...  # noqa: D102
    def flush_p2p(self) -> None: ...  # noqa: D102
    def abort(self) -> None: ...  # noqa: D102


_lock = threading.Lock()
_live: list[Group] = []


def add(g: Group) -> None:
    """Registers a new group."""
    with _lock:
        _live.append(g)


def remove(g: Group) -> None:
    """Forgets a group (idempotent)."""
    with _lock:
        if g in _live:
            _live.remove(g)


def flush_all_p2p() -> None:
    """Issues the deferred sends and receives of every live group."""
    for g in list(_live):
        if g.has_deferred_p2p():
            g.flush_p2p()


def any_deferred_p2p() -> bool:
    """Whether any live group has deferred sends or receives (cheap)."""
    return any(g.has_deferred_p2p() for g in _live)


@atexit.register
def _close_all_at_exit() -> None:
    for g in list(_live):
        with contextlib.suppress(Exception):  # nothing to report to at exit
            g.abort()
