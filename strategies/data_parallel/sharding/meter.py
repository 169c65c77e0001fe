"""What a sharding engine measures about itself, for benchmarks and tests:
how long this rank was blocked on the engine's collectives (the exposed
communication: the part no computation hid), how long it copied gradients
into flat buffers, and how many unit all-gathers were in flight at once
(the prefetch bound: at most max(prefetch, 1)).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["EngineMeter"]


@dataclass
class EngineMeter:
    """Counters since the last reset(); times in seconds on this rank.

    gather_wait_s: blocked waiting for all-gathers of sharded units (forward,
        backward; their order fingerprints included).
    step_gather_s: the all-gather of the updated parameters after a ZeRO-1/2
        optimizer step (issue and wait: none of it overlaps anything).
    reduce_wait_s: blocked waiting for gradient reduce-scatters.
    grad_copy_s: copying parameters' gradients into the flat buffers the
        reduce-scatters read (or the accumulation buffers).
    gathers: unit all-gathers started (sharded units).
    in_flight / max_in_flight: unit all-gathers started and not yet waited
        for, now / at most (reset keeps in_flight).
    """

    gather_wait_s: float = 0.0
    step_gather_s: float = 0.0
    reduce_wait_s: float = 0.0
    grad_copy_s: float = 0.0
    gathers: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    def gather_started(self) -> None:
        """A unit's all-gather was issued."""
        self.gathers += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def gather_finished(self, waited_s: float) -> None:
        """A unit's all-gather was waited for, blocking `waited_s` seconds."""
        self.in_flight -= 1
        self.gather_wait_s += waited_s

    def reset(self) -> None:
        """Zeroes every counter but in_flight (gathers issued are still pending)."""
        for f in fields(self):
            if f.name != "in_flight":
                setattr(self, f.name, f.default)
        self.max_in_flight = self.in_flight

    def as_dict(self) -> dict[str, float]:
        """The counters by name."""
        return dict(self.__dict__)
