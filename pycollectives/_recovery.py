"""Recovery from a lost rank on one host (docs/recovery.md): revoke, a
fault-tolerant agreement and shrink, as ULFM's MPIX_Comm_revoke /
MPIX_Comm_agree / MPIX_Comm_shrink. The core does the work (csrc/comm/recovery.cc);
this module checks the arguments and names the verdicts."""

from __future__ import annotations

from typing import Any, NamedTuple

from .work import Timeout, to_seconds

# The core's verdicts on a rank in an agreement, by code.
VERDICTS = ("alive", "died", "closed", "unresponsive")


class Agreement(NamedTuple):
    """What a fault-tolerant agreement decided, the same on every survivor.

    `value`: the AND of the flags of the ranks that took part and are alive
    (a bool where the flag was one); `failed`: the ranks of the communicator
    that failed, now or in an earlier agreement, sorted; `verdicts`: each
    rank's verdict, "alive", "died", "closed" (closed its communicator) or
    "unresponsive" (did not take part within the timeout: it is fenced)."""

    value: Any
    failed: tuple[int, ...]
    verdicts: tuple[str, ...]


def _names(codes: list[int]) -> tuple[str, ...]:
    return tuple(VERDICTS[c] for c in codes)


def _failed(codes: list[int]) -> tuple[int, ...]:
    return tuple(r for r, c in enumerate(codes) if c != 0)


class RecoveryMixin:
    """revoke(), agree() and shrink() of a Communicator."""

    _c: Any
    rank: int

    def revoke(self, reason: str = "") -> None:
        """Revokes the communicator on every rank (MPIX_Comm_revoke): their
        pending and later operations raise CommunicatorRevoked at once, naming
        this rank and `reason`. agree() and shrink() still work on it: the
        way out is shrink() (or close()). Raises CommunicatorAborted once closed."""
        if not isinstance(reason, str):
            raise TypeError(f"pycollectives: rank {self.rank}: revoke: reason must be a str")
        why = f": {reason}" if reason else ""
        self._c.revoke(f"pycollectives: rank {self.rank} revoked the communicator{why}")

    def agree(self, flag: bool | int = True, *, timeout: Timeout = None) -> Agreement:
        """Fault-tolerant agreement (MPIX_Comm_agree), collective over the ranks
        that did not fail in an earlier one: every survivor returns the same
        Agreement, the AND of the survivors' flags (bitwise, of 32-bit
        non-negative ints) and the same failed ranks, whoever dies meanwhile.
        Works on an aborted or revoked communicator. A rank that does not enter
        within `timeout` (default: the communicator's) is declared
        unresponsive and fenced; once a rank failed, the communicator is revoked.

        Raises ValueError for a flag outside [0, 2**32), CommunicatorAborted
        on a rank that was fenced (it must leave the job), and
        PyCollectivesError across hosts (not supported yet)."""
        is_bool = isinstance(flag, bool)
        if not isinstance(flag, int) or not 0 <= int(flag) < 1 << 32:
            raise ValueError(
                f"pycollectives: rank {self.rank}: agree: flag={flag!r} must be a bool or an "
                "int in [0, 2**32)"
            )
        value, codes = self._c.agree(int(flag), to_seconds(timeout))
        return Agreement(bool(value) if is_bool else value, _failed(codes), _names(codes))

    def shrink(self, *, timeout: Timeout = None) -> Any:
        """Collective (MPIX_Comm_shrink): returns a new Communicator of the ranks
        that did not fail, renumbered in the order of their ranks here; its
        `parent_ranks` holds each new rank's rank here, `failed` the ranks that
        failed. Works on an aborted or revoked communicator (close this one
        afterwards). A rank that dies or stops (past `timeout`) while the
        survivors build it is left out too, in another round; every round is
        bounded (about three timeouts), and each but the last loses a rank.

        Raises CommunicatorAborted on a fenced rank, and on every survivor
        alike PyCollectivesError if the survivors could not build it."""
        child, survivors, codes = self._c.shrink(to_seconds(timeout))
        comm = type(self)(child)  # a Communicator, which this class is mixed into
        comm.parent_ranks = tuple(survivors)
        comm.failed = _failed(codes)
        return comm
