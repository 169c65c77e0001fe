"""A measured step as data: the per-rank records of what ran when, as a
Chrome trace, as bubble figures comparable with `simulate`, and drawn beside
the simulated timeline.

Records are `(rank, start, end, action)` (execution_model.Record), from
`StepResult.records` gathered over the ranks (communications.gather_records)
or from `simulate(...).records`. Times are seconds (perf_counter, one clock
for every process of a host) or simulation units.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action
from .execution_model import Record
from .timeline import draw_timelines

__all__ = [
    "Measured",
    "chrome_trace",
    "draw_measured_and_simulated",
    "measure",
    "normalized",
    "save_chrome_trace",
]


def normalized(records: Sequence[Record], scale: float = 1.0) -> list[Record]:
    """The records shifted so that the earliest starts at 0, times multiplied
    by `scale` (1e3: milliseconds)."""
    t0 = min((r.start for r in records), default=0.0)
    return [Record(r.rank, (r.start - t0) * scale, (r.end - t0) * scale, r.action) for r in records]


def chrome_trace(records: Sequence[Record], *, name: str = "pipeline step") -> dict:
    """The Chrome trace (chrome://tracing, ui.perfetto.dev) of `records`
    (times in seconds): one process per rank, its computes on thread
    "compute" and its sends and receives on thread "p2p" (a batch from its
    issue until the rank saw it complete); each event named by its action
    string (2F0, 1SEND_B3), with stage, micro-batch and peer as arguments."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": -1, "args": {"name": name}}]
    ranks = sorted({r.rank for r in records})
    for rank in ranks:
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        for tid, label in ((0, "compute"), (1, "p2p")):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}}
            )
    for r in normalized(records, 1e6):
        a = r.action
        act = a if isinstance(a, Action) else None
        args = {} if act is None else {"stage": act.stage, "microbatch": act.microbatch}
        if act is not None and act.peer is not None:
            args["peer"] = act.peer
        events.append(
            {
                "name": str(a),
                "cat": act.kind.value if act is not None else "other",
                "ph": "X",
                "pid": r.rank,
                "tid": 1 if act is not None and act.is_comm else 0,
                "ts": round(r.start, 3),
                "dur": round(r.end - r.start, 3),
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(
    records: Sequence[Record], path: str | os.PathLike[str], *, name: str = "pipeline step"
) -> str:
    """Writes chrome_trace(records) as JSON to `path`; returns it as a string."""
    with open(path, "w") as f:
        json.dump(chrome_trace(records, name=name), f)
    return os.fspath(path)


@dataclass(frozen=True)
class Measured:
    """A step's figures from its records, defined as SimResult's: makespan
    from the first compute's start to the last compute's end, busy compute
    time per rank, bubble_fraction = 1 - sum(busy) / (p * makespan),
    bubble_ratio = (p * makespan - sum(busy)) / sum(busy)."""

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble_ratio: float


def measure(records: Sequence[Record], p: int) -> Measured:
    """The figures of `records` of a step on `p` ranks (computes only).

    Raises ValueError if there is no compute record.
    """
    compute = [r for r in records if isinstance(r.action, Action) and r.action.is_compute]
    if not compute:
        raise ValueError("measure: no compute record")
    start = min(r.start for r in compute)
    makespan = max(r.end for r in compute) - start
    busy = [0.0] * p
    for r in compute:
        busy[r.rank] += r.end - r.start
    total, work = p * makespan, sum(busy)
    return Measured(makespan, tuple(busy), (total - work) / total, (total - work) / work)


def draw_measured_and_simulated(
    measured: Sequence[Record],
    simulated: Sequence[Record],
    path: str | os.PathLike[str],
    *,
    title: str,
    sim_unit: float = 1.0,
) -> str:
    """One PNG: the measured step (seconds, shown in ms from its first
    compute) above its simulation (in units of `sim_unit` seconds, e.g. the
    stand-ins' t_F), on one time axis. Needs matplotlib."""
    p = max(r.rank for r in measured) + 1
    got, want = measure(measured, p), measure(simulated, p)
    t0 = min(r.start for r in measured if r.action.is_compute)
    ms = [
        Record(r.rank, max(0.0, r.start - t0) * 1e3, max(0.0, r.end - t0) * 1e3, r.action)
        for r in measured
    ]
    sim = [
        Record(r.rank, r.start * sim_unit * 1e3, r.end * sim_unit * 1e3, r.action)
        for r in simulated
    ]
    panels = [
        (f"{title}, measured: {got.makespan * 1e3:.1f} ms, bubble {got.bubble_fraction:.3f}", ms),
        (
            f"{title}, simulated: {want.makespan * sim_unit * 1e3:.1f} ms, "
            f"bubble {want.bubble_fraction:.3f}",
            sim,
        ),
    ]
    return draw_timelines(panels, path, time_unit="ms")
