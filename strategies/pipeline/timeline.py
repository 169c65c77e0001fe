"""What ran when, per rank: `(rank, start, end, action)` records drawn as a
timeline (PNG), written as a Chrome trace, and measured as bubble figures
comparable with `simulate`.

Records are `(rank, start, end, action)` (execution_model.Record), from
`StepResult.records` gathered over the ranks (communications.gather_records)
or from `simulate(...).records`, so a simulation and a runtime's
measurements draw the same way. Times are seconds (perf_counter, one clock
for every process of a host) or simulation units. `action` is an `Action`
or one of torch's action strings (``2F0``); anything else is drawn grey
under its `str()`. Drawing needs matplotlib, an optional dependency (`pip
install matplotlib`, or the bench extra).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .actions import Action, Kind, parse_action
from .execution_model import Record

__all__ = [
    "MATPLOTLIB_MISSING",
    "Measured",
    "chrome_trace",
    "draw_measured_and_simulated",
    "draw_timeline",
    "draw_timelines",
    "measure",
    "missing_matplotlib",
    "normalized",
    "save_chrome_trace",
]

MATPLOTLIB_MISSING = (
    "drawing a pipeline timeline needs matplotlib, which is not installed: "
    "pip install matplotlib  (or pip install 'pycollectives[bench]')"
)

_COLORS = {
    Kind.FORWARD: "#4c72b0",
    Kind.BACKWARD: "#55a868",
    Kind.BACKWARD_INPUT: "#dd8452",
    Kind.BACKWARD_WEIGHT: "#8172b3",
}
_COMM_COLOR, _OTHER_COLOR = "#9a9a9a", "#c8c8c8"
_NAMES = {
    Kind.FORWARD: "F forward",
    Kind.BACKWARD: "B backward",
    Kind.BACKWARD_INPUT: "I input grad",
    Kind.BACKWARD_WEIGHT: "W weight grad",
}


def missing_matplotlib() -> str | None:
    """None if matplotlib imports, else the message saying how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MATPLOTLIB_MISSING
    return None


def _as_action(action: object) -> Action | None:
    """`action` as an Action if it is one or parses as one, else None."""
    if isinstance(action, Action):
        return action
    try:
        return parse_action(str(action))
    except ValueError:
        return None


def draw_timeline(
    records: Iterable[Sequence[object]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    time_unit: str = "",
) -> str:
    """Draws one row per rank (rank 0 on top), one box per record from start
    to end: compute colored by kind (F, B, I, W) and labelled with the
    micro-batch (and stage where a rank holds several), sends and receives as
    thin grey bars under the row (zero-length ones are left out). Writes a
    PNG to `path` and returns it as a string.

    Raises ImportError with MATPLOTLIB_MISSING when matplotlib is not
    installed, ValueError for a record with end < start.
    """
    return draw_timelines([(title, records)], path, time_unit=time_unit)


def draw_timelines(
    panels: Sequence[tuple[str | None, Iterable[Sequence[object]]]],
    path: str | os.PathLike[str],
    *,
    time_unit: str = "",
) -> str:
    """Draws several timelines (as draw_timeline does one) stacked in one
    PNG, each panel titled, on one time axis: e.g. a measured step above its
    simulation. Returns `path` as a string.

    Raises ImportError with MATPLOTLIB_MISSING when matplotlib is not
    installed, ValueError for a record with end < start.
    """
    if missing_matplotlib():
        raise ImportError(MATPLOTLIB_MISSING)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [[(int(r), float(t0), float(t1), a) for r, t0, t1, a in recs] for _, recs in panels]
    for r, t0, t1, a in (x for panel in rows for x in panel):
        if t1 < t0:
            raise ValueError(f"draw_timeline: record ({r}, {t0}, {t1}, {a}) ends before it starts")
    ranks = [max((r for r, *_ in panel), default=0) + 1 for panel in rows]
    end = max((t1 for panel in rows for _, _, t1, _ in panel), default=1.0) or 1.0
    per_rank = max(len(panel) / n for panel, n in zip(rows, ranks, strict=True))
    width = min(18.0, max(8.0, 4.0 + 0.12 * per_rank))
    heights = [0.8 + 0.45 * n for n in ranks]
    fig = Figure(figsize=(width, 0.4 + sum(heights)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), 1, squeeze=False, height_ratios=heights, sharex=True)[:, 0]
    seen: set[Kind] = set()
    for ax, (title, _), panel, n in zip(axes, panels, rows, ranks, strict=True):
        seen |= _draw_panel(ax, panel, n, end, width)
        if title:
            ax.set_title(title, fontsize=10)
    axes[-1].set_xlabel(f"time ({time_unit})" if time_unit else "time")
    handles = [Patch(color=_COLORS[k], label=_NAMES[k]) for k in Kind if k in seen]
    if handles:
        axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)


def _draw_panel(ax: object, rows: list, n_ranks: int, end: float, width: float) -> set[Kind]:
    """One timeline on `ax`; returns the kinds of compute drawn."""
    stages: dict[int, set[int]] = {}
    parsed = [(r, t0, t1, a, _as_action(a)) for r, t0, t1, a in rows]
    for r, _, _, _, act in parsed:
        if act is not None and act.is_compute:
            stages.setdefault(r, set()).add(act.stage)
    seen: set[Kind] = set()
    for r, t0, t1, a, act in parsed:
        y = n_ranks - 1 - r
        if act is not None and act.is_comm:
            if t1 > t0:
                ax.broken_barh([(t0, t1 - t0)], (y - 0.45, 0.12), facecolors=_COMM_COLOR)
            continue
        color = _COLORS[act.kind] if act is not None else _OTHER_COLOR
        if act is not None:
            seen.add(act.kind)
        ax.broken_barh(
            [(t0, t1 - t0)], (y - 0.3, 0.7), facecolors=color, edgecolors="white", linewidth=0.5
        )
        if act is None:
            label = str(a)
        elif len(stages.get(r, ())) > 1:
            label = f"{act.microbatch}s{act.stage}"
        else:
            label = str(act.microbatch)
        if (t1 - t0) / end * width * 0.8 > 0.075 * len(label):  # inches it has, needs
            ax.text(
                (t0 + t1) / 2, y + 0.05, label, ha="center", va="center", fontsize=7, color="white"
            )
    ax.set_yticks(range(n_ranks), [f"rank {n_ranks - 1 - y}" for y in range(n_ranks)])
    ax.set_ylim(-0.6, n_ranks - 0.4)
    ax.set_xlim(0, end)
    return seen


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
