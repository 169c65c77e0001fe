"""Exceptions raised by pycollectives (the C++ core raises these classes too)."""

from __future__ import annotations


class PyCollectivesError(RuntimeError):
    """Base class of every error raised by an operation of pycollectives."""


class CollectiveTimeout(PyCollectivesError, TimeoutError):
    """A peer was late past the timeout; the message names the operation, its
    sequence number and the ranks being waited for."""


class PeerFailure(PyCollectivesError):
    """A peer process died or closed the communicator; the message names it."""


class CollectiveMismatch(PyCollectivesError):
    """Ranks called different operations (kind, count, dtype, op or root) at the
    same sequence number; the message names both calls."""


class CommunicatorAborted(PyCollectivesError):
    """The communicator is unusable: closed, or aborted by an earlier error."""


class CommunicatorRevoked(CommunicatorAborted):
    """The communicator was revoked (Communicator.revoke(), or by the survivors
    once an agreement found a rank failed): its operations raise, while
    agree() and shrink() still work on it (docs/recovery.md)."""


class GrowRefused(PyCollectivesError):
    """pycollectives.join: the survivors will not take in newcomers
    (rendezvous.grow.refuse: the lost ranks' state is lost too, say).
    `reason`: what they said; `failed`: the lost ranks they named."""

    def __init__(self, message: str, reason: str = "", failed: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.reason, self.failed = reason, failed
