"""The actions of a pipeline schedule: what one rank does at one step.

An action names a kind, a stage and a micro-batch, and for a send or a receive
the peer rank. It is written as torch.distributed.pipelining writes its
`_Action`s: ``{stage}{kind}{microbatch}``, e.g. ``2F0`` (stage 2 forward of
micro-batch 0), ``1I3`` (stage 1 input-gradient backward of micro-batch 3),
``1SEND_B3`` (stage 1 sends the input gradient of micro-batch 3 to stage 0),
``0RECV_B3`` (stage 0 receives it). The peer rank is not written: a schedule
knows which rank holds each stage (`Schedule.stage_to_rank`) and fills it in
when it reads a CSV.

Torch's letters, not the zero-bubble paper's: ``B`` is the full backward,
``I`` the input-gradient backward (the paper's "B") and ``W`` the
weight-gradient backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Action", "Kind", "parse_action"]


class Kind(str, Enum):
    """What an action does; the value is torch's `_ComputationType` string."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients
    BACKWARD_INPUT = "I"  # input gradient only (zero bubble's "B")
    BACKWARD_WEIGHT = "W"  # weight gradient, after BACKWARD_INPUT
    SEND_F = "SEND_F"  # stage s sends its output to stage s + 1
    RECV_F = "RECV_F"  # stage s receives its input from stage s - 1
    SEND_B = "SEND_B"  # stage s sends its input gradient to stage s - 1
    RECV_B = "RECV_B"  # stage s receives its output gradient from stage s + 1

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self in COMPUTE

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self in SENDS

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self in RECVS


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})
# The kind of the other end of a message.
COUNTERPART = {
    Kind.SEND_F: Kind.RECV_F,
    Kind.RECV_F: Kind.SEND_F,
    Kind.SEND_B: Kind.RECV_B,
    Kind.RECV_B: Kind.SEND_B,
}

# Where the other end of a message is: the next stage or the previous one.
_PEER_STEP = {Kind.SEND_F: 1, Kind.RECV_B: 1, Kind.RECV_F: -1, Kind.SEND_B: -1}
# Longest alternatives first, so that "SEND_F" is not read as "S"...
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
# torch's bookkeeping actions with no data dependency between stages.
TORCH_BOOKKEEPING = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: `kind` on `stage` for `microbatch`.

    `peer` is the other rank of a send or a receive (None for compute). Two
    actions are equal when all four fields are; `str()` gives torch's string,
    which leaves the peer out.
    """

    kind: Kind
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action {self!r}: stage and microbatch must be >= 0")
        if self.peer is not None and self.kind in COMPUTE:
            raise ValueError(f"Action {self}: a compute action has no peer")

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE

    @property
    def is_comm(self) -> bool:
        """True for sends and receives."""
        return self.kind not in COMPUTE

    def peer_stage(self) -> int:
        """The stage at the other end of a send or receive.

        Raises ValueError for a compute action.
        """
        step = _PEER_STEP.get(self.kind)
        if step is None:
            raise ValueError(f"{self}: a compute action has no peer stage")
        return self.stage + step

    def counterpart(self) -> Action:
        """The receive matching this send, or the send matching this receive
        (peer left None).

        Raises ValueError for a compute action.
        """
        if self.kind in COMPUTE:
            raise ValueError(f"{self}: a compute action has no counterpart")
        return Action(COUNTERPART[self.kind], self.peer_stage(), self.microbatch)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Reads one of torch's action strings (``2F0``, ``1SEND_B3``); the peer is
    left None.

    Raises ValueError naming the string if it is not one: empty cells, torch's
    sub-action groups (``(0F1;1B0)OVERLAP_F_B``) and its bookkeeping actions
    (``0UNSHARD``, ``0REDUCE_GRAD``) included, which the caller filters.
    """
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"invalid action string {text!r}: expected [stage][kind][microbatch] with kind "
            f"one of {', '.join(k.value for k in Kind)}, e.g. 2F0 or 1SEND_B3"
        )
    stage, kind, microbatch = match.groups()
    return Action(Kind(kind), int(stage), int(microbatch))
