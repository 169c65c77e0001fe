"""`simulate(schedule, t_F, t_B, t_W, t_p2p)`: what a schedule costs.

Runs the execution model of execution_model.py with times: F costs t_F, I (input
gradient) t_B, W t_W, and the full backward B t_B + t_W; a batch of sends
and receives ends t_p2p after its last operation has met its peer's. Compute
costs are per stage: with v stages per rank, a stage is 1/v of what the rank
holds, so t_F here is 1/v of a rank's forward.

With t_p2p = 0 (messages free) and batches overlapping compute (the
default, `overlap=True`):

- GPipe and 1F1B: bubble_fraction = (p-1)/(m+p-1) exactly, for any t_F, t_B,
  t_W and with synchronous batches too (the classic figure is the idle share
  of the step);
- interleaved 1F1B: bubble_ratio = (p-1)/(v*m) exactly for m >= p, p need not
  divide m (the paper's figure is relative to the ideal time, bubble over
  compute, not a share of the step; it is an approximation below m = p,
  where the pipeline never fills); with synchronous batches, more;
- ZB-H1 with t_F = t_B = t_W: bubble_ratio = (p-1)/(3m) exactly for m >= p
  (again relative to the ideal time 3m). The paper's (p-1)(t_F + t_B - t_W)
  assumes those equal costs too: with t = (2, 2, 1) this fixed order idles
  more in the steady state (p = 4, m = 16: 21 units, not 9).

Exact means exact with integer costs: the figures are one division of exact
sums, so they equal the formula's float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action, Kind
from .execution_model import Record, check_static, execute
from .schedule import Schedule

__all__ = ["SimResult", "peak_activations", "simulate", "timed_table"]


@dataclass(frozen=True)
class SimResult:
    """What `simulate` found.

    - makespan: when the last rank finishes.
    - busy: compute time of each rank (communication is not busy).
    - bubble_fraction: idle share of the step, 1 - sum(busy) / (p * makespan).
    - bubble_ratio: idle time over compute time, (p * makespan - sum(busy)) /
      sum(busy): the bubble relative to the ideal (bubble-free) time.
    - peak_activations: per rank, the most (stage, micro-batch) pairs whose
      forward has run and whose backward has not finished (B, or W when split):
      activations held, in stages (each 1/v of a rank's model).
    - records: what ran when, (rank, start, end, action), sends and receives
      from when they met their peer to when they ended.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble_ratio: float
    peak_activations: tuple[int, ...]
    records: tuple[Record, ...]


def simulate(
    schedule: Schedule,
    t_F: float | Sequence[float] = 1.0,  # noqa: N803 (the cost names of the literature)
    t_B: float | Sequence[float] = 1.0,  # noqa: N803
    t_W: float | Sequence[float] = 1.0,  # noqa: N803
    t_p2p: float = 0.0,
    *,
    overlap: bool = True,
) -> SimResult:
    """Simulates `schedule` with these costs (see the module docstring). Each compute
    cost is one number for every stage, or a sequence of one per stage (stages that
    hold different shares of the model: the first the embeddings, the last the head).

    Raises ScheduleError (from verify) if the schedule breaks a dependency or
    deadlocks, ValueError on a negative cost or a sequence that is not one per stage.
    """
    stages = schedule.p * schedule.v
    per_stage = {}
    for name, t in (("t_F", t_F), ("t_B", t_B), ("t_W", t_W)):
        ts = [float(t)] * stages if isinstance(t, (int, float)) else [float(x) for x in t]
        if len(ts) != stages:
            raise ValueError(f"simulate: {name} has {len(ts)} costs for {stages} stages")
        per_stage[name] = ts
    if min(min(ts) for ts in per_stage.values()) < 0 or t_p2p < 0:
        raise ValueError(f"simulate: costs must be >= 0, got {t_F=}, {t_B=}, {t_W=}, {t_p2p=}")
    f, b, w = per_stage["t_F"], per_stage["t_B"], per_stage["t_W"]
    costs = {
        Kind.FORWARD: f,
        Kind.BACKWARD: [x + y for x, y in zip(b, w, strict=True)],
        Kind.BACKWARD_INPUT: b,
        Kind.BACKWARD_WEIGHT: w,
    }
    records = execute(
        schedule, check_static(schedule), lambda a: costs[a.kind][a.stage], t_p2p, overlap=overlap
    )
    busy = [0.0] * schedule.p
    makespan = 0.0
    for rec in records:
        makespan = max(makespan, rec.end)
        if rec.action.is_compute:
            busy[rec.rank] += rec.end - rec.start
    total = schedule.p * makespan
    work = sum(busy)
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=(total - work) / total if total else 0.0,
        bubble_ratio=(total - work) / work if work else 0.0,
        peak_activations=peak_activations(schedule),
        records=tuple(records),
    )


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs holding activations at
    once: +1 at F, -1 when B or W ends. A rank runs its list in order, so this
    does not depend on the costs."""
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            if a.kind is Kind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def timed_table(schedule: Schedule, records: Sequence[Record] | None = None) -> str:
    """A time x rank table of the compute actions: one row per unit of time,
    as `simulate(schedule)` runs them with its default costs (F, I and W one
    unit, B two: its second row shows `...`), an empty cell where the rank
    waits. Pass `records` with integer times to lay out another run.
    """
    if records is None:
        records = simulate(schedule).records
    grid: dict[tuple[int, int], str] = {}
    for rec in records:
        if isinstance(rec.action, Action) and rec.action.is_comm:
            continue
        t = int(rec.start)
        for u in range(t, max(t + 1, int(rec.end))):
            grid[(u, rec.rank)] = str(rec.action) if u == t else "..."
    n = max((u for u, _ in grid), default=-1) + 1
    width = max([len(f"Rank {schedule.p - 1}")] + [len(c) for c in grid.values()])
    digits = len(str(max(n - 1, 0)))
    head = " " * (digits + 3) + " ".join(f"Rank {r}".ljust(width) for r in range(schedule.p))
    lines = [head.rstrip()]
    for u in range(n):
        row = " ".join(grid.get((u, r), "").ljust(width) for r in range(schedule.p))
        lines.append(f"t={u:0{digits}d} {row}".rstrip())
    return "\n".join(lines) + "\n"
