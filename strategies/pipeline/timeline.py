"""A per-rank timeline of what ran when, drawn as a PNG.

`draw_timeline` takes plain (rank, start, end, action) records, so a
simulation (`simulate(...).records`) and a runtime's measurements draw the
same way; `action` is an `Action` or one of torch's action strings (``2F0``),
anything else is drawn grey under its `str()`. Needs matplotlib, an optional
dependency (`pip install matplotlib`, or the bench extra).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from .actions import Action, Kind, parse_action

__all__ = ["MATPLOTLIB_MISSING", "draw_timeline", "draw_timelines", "missing_matplotlib"]

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
