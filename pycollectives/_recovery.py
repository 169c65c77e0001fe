"""Recovery from a lost rank on one host (docs/recovery.md): revoke, a
fault-tolerant agreement and shrink, as ULFM's MPIX_Comm_revoke /
MPIX_Comm_agree / MPIX_Comm_shrink. The core does the work (csrc/comm/recovery.cc);
this module names the verdicts (CommunicatorBase.revoke / agree / shrink check
the arguments)."""

from __future__ import annotations

from typing import Any, NamedTuple

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


def verdict_names(codes: list[int]) -> tuple[str, ...]:
    """The verdicts the core gave each rank, by name."""
    return tuple(VERDICTS[c] for c in codes)


def failed_ranks(codes: list[int]) -> tuple[int, ...]:
    """The ranks whose verdict is not "alive"."""
    return tuple(r for r, c in enumerate(codes) if c != 0)
