"""What a run shows: the :class:`Row` of one measured size, the nccl-tests style table lines, the
tables comparing backends, the JSON file (also how the ranks hand their rows to the launcher), the
plot, and :func:`finalize`, which prints and writes them once every row is in."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pycollectives.bench.specs import SPECS, CollSpec

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class Row:
    """One measured size of one collective on one backend."""

    backend: str
    collective: str
    nranks: int
    size: int
    count: int
    dtype: str
    op: str
    root: int
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None  #: None when not checked (-c 0) or not run
    note: str = ""  #: why the row is n/a
    #: per trial, the slowest rank's time per call (us), in the order run; time_us is their median
    trials_us: list[float] = field(default_factory=list)
    #: pycollectives: rank 0's calls of the timed trials by the path they took (comm.stats()
    #: "paths": slots, oneshot, direct, cma, hierarchical, flat); empty for other backends
    paths: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


_LEFT = 52  # width of the size/count/type/redop/root columns
_GROUP = 32  # width of one time/algbw/busbw/#wrong group


def column_header(spec: CollSpec) -> str:
    """The three nccl-tests column header lines (one column group: in-place or out-of-place)."""
    label = "in-place" if spec.inplace else "out-of-place"
    return "\n".join(
        [
            "#" + " " * (_LEFT - 1) + label.center(_GROUP).rstrip(),
            "#       size         count      type   redop    root     time   algbw   busbw #wrong",
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)",
        ]
    )


def _fmt_time(us: float) -> str:
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_row(row: Row, type_name: str) -> str:
    """One nccl-tests data line."""
    redop = row.op if SPECS[row.collective].reduces else "none"
    root = row.root if SPECS[row.collective].rooted else -1
    left = f"{row.size:12d}  {row.count:12d}  {type_name:>8}  {redop:>6}  {root:6d}"
    if row.time_us is None:
        return f"{left}  {'n/a':>7}  {'n/a':>6}  {'n/a':>6}  {'n/a':>5}"
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return f"{left}  {_fmt_time(row.time_us)}  {row.algbw:6.2f}  {row.busbw:6.2f}  {wrong:>5}"


def footer(rows: Sequence[Row]) -> str:
    """nccl-tests footer: out-of-bounds values and average bus bandwidth of the measured rows."""
    measured = [r for r in rows if r.busbw is not None]
    wrong = sum(r.wrong or 0 for r in measured)
    avg = sum(r.busbw for r in measured) / len(measured) if measured else 0.0
    return "\n".join(
        [
            f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth    : {avg:.6g} ",
            "#",
        ]
    )


def _ratio(mine: Row | None, peer: Row | None) -> float | None:
    if mine is None or peer is None or mine.time_us is None or peer.time_us is None:
        return None
    # same size and bus factor, so busbw_mine / busbw_peer == time_peer / time_mine
    if mine.time_us <= 0:
        return None
    return peer.time_us / mine.time_us


def comparison_tables(rows: Sequence[Row], backends: Sequence[str]) -> str:
    """One table per collective: size | first backend us busbw | each peer us busbw ratio."""
    base, peers = backends[0], list(backends[1:])
    out: list[str] = []
    colls = list(dict.fromkeys(r.collective for r in rows))
    for coll in colls:
        by = {(r.backend, r.size): r for r in rows if r.collective == coll}
        sizes = sorted({r.size for r in rows if r.collective == coll})
        any_row = next(r for r in rows if r.collective == coll)
        out.append(
            f"# Comparison: {coll}, {any_row.dtype}, op {any_row.op}, nranks {any_row.nranks}"
            f"  (time us, busbw GB/s, ratio = busbw {base} / busbw peer; >1: {base} faster)"
        )
        head = f"#{'size':>11} | {base + ' us':>10} {'busbw':>7}"
        for p in peers:
            head += f" | {p + ' us':>10} {'busbw':>7} {'ratio':>6}"
        out.append(head)
        logs: dict[str, list[float]] = {p: [] for p in peers}
        for s in sizes:
            mine = by.get((base, s))
            line = f"{s:12d} | {_cell(mine)}"
            for p in peers:
                ratio = _ratio(mine, by.get((p, s)))
                if ratio is not None:
                    logs[p].append(math.log(ratio))
                line += (
                    f" | {_cell(by.get((p, s)))} {'n/a' if ratio is None else f'{ratio:.2f}':>6}"
                )
            out.append(line)
        for p in peers:
            if logs[p]:
                gm = math.exp(sum(logs[p]) / len(logs[p]))
                out.append(f"# geometric mean ratio {base}/{p} over {len(logs[p])} sizes: {gm:.2f}")
            else:
                out.append(f"# {p}: no comparable sizes")
        out.append("#")
    return "\n".join(out)


def _cell(row: Row | None) -> str:
    if row is None or row.time_us is None:
        return f"{'n/a':>10} {'n/a':>7}"
    return f"{row.time_us:10.2f} {row.busbw:7.3f}"


def write_json(path: str, meta: dict, rows: Iterable[Row]) -> None:
    """Write ``{"metadata": meta, "rows": [...]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"metadata": meta, "rows": [r.to_dict() for r in rows]}, f, indent=1)
        f.write("\n")


def read_json(path: str) -> tuple[dict, list[Row]]:
    """Inverse of :func:`write_json`."""
    with open(path) as f:
        data = json.load(f)
    return data["metadata"], [Row(**r) for r in data["rows"]]


def check_matplotlib() -> str | None:
    """None if matplotlib can be imported, else a message saying how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "--plot needs matplotlib, which is not installed: "
            "pip install matplotlib  (or pip install 'pycollectives[bench]')"
        )
    return None


def plot(path: str, rows: Sequence[Row]) -> Figure:
    """Writes to `path` busbw against size (log2 x axis, log busbw axis), one panel per
    collective, one line per backend; rows without busbw (n/a) or of size 0 are left out.
    Returns the figure (closed). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = list(dict.fromkeys(r.collective for r in rows))
    ncols = min(3, max(1, len(colls)))
    nrows = math.ceil(len(colls) / ncols) if colls else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.8 * nrows), squeeze=False)
    for ax, coll in zip(axes.flat, colls, strict=False):
        for backend in dict.fromkeys(r.backend for r in rows):
            pts = [
                (r.size, r.busbw)
                for r in rows
                if r.collective == coll
                and r.backend == backend
                and r.busbw is not None
                and r.size > 0
            ]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=backend)
        any_row = next(r for r in rows if r.collective == coll)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # small and large sizes differ by orders of magnitude
        ax.set_title(f"{coll} ({any_row.dtype}, {any_row.nranks} ranks)")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(colls) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def finalize(args: argparse.Namespace, meta: dict, rows: list[Row], backends: Sequence[str]) -> int:
    """Comparison tables, --json, --plot. Returns the exit status (1 if any value was wrong)."""
    if len(backends) > 1:
        print(comparison_tables(rows, list(backends)), flush=True)
    if args.json:
        write_json(args.json, meta, rows)
        print(f"# wrote {len(rows)} rows to {args.json}", flush=True)
    if args.plot:
        plot(args.plot, rows)
        print(f"# wrote plot to {args.plot}", flush=True)
    wrong = sum(r.wrong or 0 for r in rows)
    if wrong:
        print(f"pycollectives-bench: {wrong} wrong values", file=sys.stderr)
    return 1 if wrong else 0
