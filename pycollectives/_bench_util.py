"""Helpers of :mod:`pycollectives.bench`: collective specs, sizes, check data, output, metadata,
plots, and the backends (pycollectives, gloo, MPI) a rank process runs.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

# --------------------------------------------------------------------------------------------
# collectives and data types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollSpec:
    """What the benchmark needs to know about one collective."""

    name: str
    reduces: bool  #: takes a reduction op
    rooted: bool  #: takes a root rank
    split: bool  #: the full buffer holds nranks blocks; the count column is the per-rank count
    inplace: bool  #: one buffer (in place) rather than input + output
    factor_kind: str  #: "allreduce" 2(n-1)/n, "n-1/n" or "one"

    def busbw_factor(self, nranks: int) -> float:
        """nccl-tests bus-bandwidth factor for ``nranks`` ranks."""
        if self.factor_kind == "allreduce":
            return 2.0 * (nranks - 1) / nranks
        if self.factor_kind == "n-1/n":
            return (nranks - 1) / nranks
        return 1.0


SPECS: dict[str, CollSpec] = {
    s.name: s
    for s in (
        CollSpec("all_reduce", True, False, False, True, "allreduce"),
        CollSpec("reduce_scatter", True, False, True, False, "n-1/n"),
        CollSpec("all_gather", False, False, True, False, "n-1/n"),
        CollSpec("broadcast", False, True, False, True, "one"),
        CollSpec("reduce", True, True, False, True, "one"),
        CollSpec("all_to_all", False, False, True, False, "n-1/n"),
        # nccl-tests' sendrecv_perf: every rank sends to the next and receives from the previous.
        CollSpec("sendrecv", False, False, False, False, "one"),
    )
}
COLLECTIVES: tuple[str, ...] = tuple(SPECS)

#: accepted -d names -> (canonical name, torch dtype, nccl-tests type name)
DTYPES: dict[str, tuple[str, torch.dtype, str]] = {
    "float32": ("float32", torch.float32, "float"),
    "float": ("float32", torch.float32, "float"),
    "float64": ("float64", torch.float64, "double"),
    "double": ("float64", torch.float64, "double"),
    "float16": ("float16", torch.float16, "half"),
    "half": ("float16", torch.float16, "half"),
    "bfloat16": ("bfloat16", torch.bfloat16, "bfloat16"),
    "int8": ("int8", torch.int8, "int8"),
    "uint8": ("uint8", torch.uint8, "uint8"),
    "int32": ("int32", torch.int32, "int32"),
    "int64": ("int64", torch.int64, "int64"),
}
OPS: tuple[str, ...] = ("sum", "prod", "min", "max", "avg")
BACKENDS: tuple[str, ...] = ("pycoll", "gloo", "mpi", "nccl")  # nccl: --device cuda only

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a byte count with an optional binary suffix: ``8``, ``64K``, ``64M``, ``1G``, ``4KiB``."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r} (expected e.g. 8, 64K, 64M, 1G)")
    mult = 1024 ** "_kmgt".index(m.group(2).lower()) if m.group(2) else 1
    value = float(m.group(1)) * mult
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def size_list(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """Byte sizes from minbytes to maxbytes (inclusive), multiplied by ``factor`` each step."""
    sizes, s = [], max(minbytes, 0)
    while s <= maxbytes:
        sizes.append(s)
        if s == 0:
            s = 1
            continue
        s *= factor
    return sizes


def counts_for(spec: CollSpec, nbytes: int, elsize: int, nranks: int) -> tuple[int, int]:
    """(count column, byte size column) for a requested byte size, as nccl-tests computes them.

    Split collectives report the per-rank count; the byte size is that of the full buffer, rounded
    down to a whole number of elements (and of blocks).
    """
    if spec.split:
        count = nbytes // (elsize * nranks)
        return count, count * nranks * elsize
    count = nbytes // elsize
    return count, count * elsize


# --------------------------------------------------------------------------------------------
# check data: small integers, so that every dtype holds every result exactly (tolerance 0)
# --------------------------------------------------------------------------------------------


def pattern(rank: int, nranks: int, start: int, numel: int, op: str) -> torch.Tensor:
    """Input elements [start, start + numel) of ``rank`` (int64) for reduction ``op``.

    sum/min/max: 1..8 varying with rank and index; prod: 1 or 2 (the product is a power of 2);
    avg: b(i) + d(rank) with sum over ranks of d = 0, so the average is the integer b(i).
    Non-reducing collectives use the sum pattern.
    """
    i = torch.arange(start, start + numel, dtype=torch.int64)
    if op == "prod":
        return torch.where((i + rank) % 3 == 0, 2, 1)
    if op == "avg":
        # d = -1, +1, -1, +1, ... (and 0 for the last of an odd number of ranks)
        d = 0 if (nranks % 2 == 1 and rank == nranks - 1) else (1 if rank % 2 else -1)
        return 2 + (i * 13) % 8 + d
    return 1 + (i * 13 + rank * 7) % 8


def reduced(nranks: int, start: int, numel: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    """Exact reduction over all ranks of their pattern elements [start, start + numel)."""
    acc = pattern(0, nranks, start, numel, op)
    for r in range(1, nranks):
        p = pattern(r, nranks, start, numel, op)
        if op in ("sum", "avg"):
            acc += p
        elif op == "prod":
            acc *= p
        elif op == "min":
            acc = torch.minimum(acc, p)
        elif op == "max":
            acc = torch.maximum(acc, p)
    if op == "avg":
        acc = acc // nranks  # exact by construction of the avg pattern
    if dtype.is_floating_point:
        return acc.to(torch.float64).to(dtype)
    return acc.to(dtype)  # integer results wrap like the reduction does


def fill_check_inputs(
    spec: CollSpec,
    rank: int,
    nranks: int,
    count: int,
    op: str,
    root: int,
    inp: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Write this rank's check input into ``inp`` (and clear ``out``)."""
    pat_op = op if spec.reduces else "sum"
    if spec.name == "broadcast" and rank != root:
        inp.zero_()
    else:
        inp.copy_(pattern(rank, nranks, 0, inp.numel(), pat_op))
    if out is not None:
        out.zero_()


def expected_result(
    spec: CollSpec,
    rank: int,
    nranks: int,
    count: int,
    op: str,
    root: int,
    dtype: torch.dtype,
    check_nonroot: bool = True,
) -> torch.Tensor | None:
    """What the result buffer of ``rank`` must hold after one call (None: nothing to check)."""
    name, c = spec.name, count
    if name == "all_reduce":
        return reduced(nranks, 0, c, op, dtype)
    if name == "reduce":
        if rank == root:
            return reduced(nranks, 0, c, op, dtype)
        return pattern(rank, nranks, 0, c, op).to(dtype) if check_nonroot else None
    if name == "reduce_scatter":
        return reduced(nranks, rank * c, c, op, dtype)
    if name == "broadcast":
        return pattern(root, nranks, 0, c, "sum").to(dtype)
    if name == "all_gather":
        return torch.cat([pattern(q, nranks, 0, c, "sum") for q in range(nranks)]).to(dtype)
    if name == "all_to_all":
        return torch.cat([pattern(q, nranks, rank * c, c, "sum") for q in range(nranks)]).to(dtype)
    if name == "sendrecv":
        return pattern((rank - 1) % nranks, nranks, 0, c, "sum").to(dtype)
    raise ValueError(name)


def count_wrong(result: torch.Tensor, expected: torch.Tensor | None) -> int:
    """Number of elements of ``result`` that differ from ``expected`` (tolerance 0)."""
    if expected is None:
        return 0
    return int((result.reshape(-1).cpu() != expected.reshape(-1)).sum())  # CUDA results too


# --------------------------------------------------------------------------------------------
# rows and nccl-tests style output
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# metadata, JSON, plot
# --------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_round_trip() -> dict | None:
    """The cache-line round trip (ns) between the first two CPUs this process may use, as
    ``{"cpus": [a, b], "ns": t}`` (``_C.cpu_round_trip_ns``), or None with fewer than two CPUs,
    or when the probe failed (a thread that could not be pinned, or a CPU that did not answer
    within a second): the benchmark goes on without it, after saying why on stderr. On a VM it
    moves with where the host runs the vCPUs (docs/benchmarks.md, "Reading the CPU figures"),
    and with it every collective that reads what another CPU wrote."""
    from pycollectives import _C, PyCollectivesError

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    try:
        return {"cpus": cpus[:2], "ns": round(_C.cpu_round_trip_ns(cpus[0], cpus[1]), 1)}
    except PyCollectivesError as e:
        print(f"# cache-line round trip not measured: {e}", file=sys.stderr, flush=True)
        return None


def algo_env() -> dict[str, str]:
    """The PYCOLL_* variables that steer the library, with their defaults."""
    return {
        "PYCOLL_ALGO": os.environ.get("PYCOLL_ALGO", "auto"),
        "PYCOLL_SIMD": os.environ.get("PYCOLL_SIMD", "(auto)"),
        "PYCOLL_SLOT_BYTES": os.environ.get("PYCOLL_SLOT_BYTES", "(default)"),
        "PYCOLL_NSLOTS": os.environ.get("PYCOLL_NSLOTS", "(default)"),
        "PYCOLL_CMA": os.environ.get("PYCOLL_CMA", "(default)"),
    }


def base_metadata(argv: Sequence[str] | None = None) -> dict:
    """Command line, host, CPU, date, versions common to every backend."""
    import numpy

    return {
        "command": shlex.join(list(argv if argv is not None else sys.argv)),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
        },
        "env": algo_env(),
    }


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


def plot(path: str, rows: Sequence[Row]) -> None:
    """busbw against size (log2 x axis), one panel per collective, one line per backend."""
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


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


class Runner:
    """One backend on one rank: binds collectives to buffers, barriers, cross-rank reductions."""

    name = "?"
    check_nonroot_reduce = True  #: whether reduce() promises to leave non-root buffers unchanged
    probe_first_call = False  #: run the first call of each collective in try/except (n/a on error)

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def unsupported(self, spec: CollSpec, dtype: str, op: str) -> str | None:
        """A reason why this backend cannot run (spec, dtype, op), or None."""
        return None

    def bind(
        self, coll: str, inp: torch.Tensor, out: torch.Tensor | None, op: str, root: int
    ) -> Callable[[], None]:
        """A no-argument callable running one collective call on these buffers."""
        raise NotImplementedError

    def buffers(
        self, spec: CollSpec, count: int, dtype: torch.dtype, device: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input, output) of one call on `device` (None: CPU); output is None for the
        in-place collectives."""
        n, empty = self.world_size, self.empty
        if spec.inplace:
            return empty(count, dtype, device), None
        if spec.name == "all_gather":
            return empty(count, dtype, device), empty(n * count, dtype, device)
        if spec.name == "reduce_scatter":
            return empty(n * count, dtype, device), empty(count, dtype, device)
        if spec.name == "sendrecv":
            return empty(count, dtype, device), empty(count, dtype, device)
        return empty(n * count, dtype, device), empty(n * count, dtype, device)  # all_to_all

    def empty(self, numel: int, dtype: torch.dtype, device: str | None) -> torch.Tensor:
        """An uninitialized buffer for `buffers`."""
        return torch.empty(numel, dtype=dtype, device=device)

    def barrier(self) -> None:
        """Barrier over all ranks."""
        raise NotImplementedError

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        raise NotImplementedError

    def sum_over_ranks(self, value: int) -> int:
        """Sum of an integer over ranks."""
        raise NotImplementedError

    def describe(self) -> list[str]:
        """Header lines describing the backend."""
        return []

    def close(self) -> None:
        """Release the backend."""


class PycollRunner(Runner):
    """pycollectives Communicator."""

    name = "pycoll"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: object,
        timeout: float,
        registered: int = 0,
        cuda: bool = False,
    ) -> None:
        super().__init__(rank, world_size)
        self.cuda = cuda
        import torch.distributed as dist

        import pycollectives as pc

        self.registered = bool(registered)

        self.pc = pc
        self.comm = pc.init(
            rank=rank,
            world_size=world_size,
            store=dist.PrefixStore("bench/pycoll", store),
            timeout=timeout,
        )
        self.ops = {o: getattr(pc.ReduceOp, o.upper()) for o in OPS}

    def unsupported(self, spec, dtype, op):  # noqa: D102
        if spec.name == "sendrecv" and self.cuda:
            return "pycollectives' batch_p2p takes CPU buffers only"
        return None

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        c, o = self.comm, self.ops[op]
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        return {
            "sendrecv": lambda: c.batch_p2p([("send", inp, nxt), ("recv", out, prv)]),
            "all_reduce": lambda: c.all_reduce(inp, o),
            "reduce_scatter": lambda: c.reduce_scatter(out, inp, o),
            "all_gather": lambda: c.all_gather(out, inp),
            "broadcast": lambda: c.broadcast(inp, root),
            "reduce": lambda: c.reduce(inp, root, o),
            "all_to_all": lambda: c.all_to_all(out, inp),
        }[coll]

    def empty(self, numel, dtype, device):  # noqa: D102
        if self.registered and device is None:
            return self.comm.alloc_shared(numel, dtype)  # collective: same order on every rank
        return super().empty(numel, dtype, device)

    def barrier(self):  # noqa: D102
        self.comm.barrier()

    def max_over_ranks(self, values):  # noqa: D102
        t = torch.tensor(list(values), dtype=torch.float64)
        self.comm.all_reduce(t, self.ops["max"])
        return t.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        t = torch.tensor([value], dtype=torch.int64)
        self.comm.all_reduce(t, self.ops["sum"])
        return int(t.item())

    def describe(self):  # noqa: D102
        simd = self.pc.simd_level() if hasattr(self.pc, "simd_level") else "?"
        env = " ".join(f"{k}={v}" for k, v in base_metadata()["env"].items())
        return [
            f"# backend pycoll: pycollectives {pycoll_version()}  simd_level: {simd}",
            f"# algorithm env: {env}",
            f"# buffers: {'registered (comm.alloc_shared windows)' if self.registered else 'plain'}",
            f"# single copy (CMA) between ranks: {'yes' if self.comm.single_copy else 'no'}",
        ]

    def close(self):  # noqa: D102
        self.comm.close()


class GlooRunner(Runner):
    """torch.distributed ProcessGroupGloo."""

    name = "gloo"
    check_nonroot_reduce = False  # torch does not promise anything about non-root reduce buffers
    probe_first_call = True
    device = torch.device("cpu")  # of the ranks' helper tensors (max/sum over ranks)

    def __init__(self, rank: int, world_size: int, store: object, timeout: float) -> None:
        super().__init__(rank, world_size)
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        self.dist = dist
        dist.init_process_group(
            self.name,
            store=dist.PrefixStore(f"bench/{self.name}", store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        ops = dist.ReduceOp
        self.ops = {
            "sum": ops.SUM,
            "prod": ops.PRODUCT,
            "min": ops.MIN,
            "max": ops.MAX,
            "avg": ops.AVG,
        }

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        d, o = self.dist, self.ops[op]
        reduce_scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        all_gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size

        def sendrecv() -> None:
            ops = [d.P2POp(d.isend, inp, nxt), d.P2POp(d.irecv, out, prv)]
            for w in d.batch_isend_irecv(ops):
                w.wait()

        return {
            "sendrecv": sendrecv,
            "all_reduce": lambda: d.all_reduce(inp, o),
            "reduce_scatter": lambda: reduce_scatter(out, inp, o),
            "all_gather": lambda: all_gather(out, inp),
            "broadcast": lambda: d.broadcast(inp, src=root),
            "reduce": lambda: d.reduce(inp, dst=root, op=o),
            "all_to_all": lambda: d.all_to_all_single(out, inp),
        }[coll]

    def barrier(self):  # noqa: D102
        self.dist.barrier()

    def max_over_ranks(self, values):  # noqa: D102
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, self.ops["max"])
        return t.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, self.ops["sum"])
        return int(t.item())

    def describe(self):  # noqa: D102
        return [f"# backend gloo: torch.distributed ProcessGroupGloo (torch {torch.__version__})"]

    def close(self):  # noqa: D102
        self.dist.destroy_process_group()


class NcclRunner(GlooRunner):
    """torch.distributed ProcessGroupNCCL on CUDA tensors (--device cuda). Several
    ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1; an
    NCCL that refuses them fails at the first call, reported as n/a."""

    name = "nccl"

    def __init__(self, rank: int, world_size: int, store: object, timeout: float) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, world_size, store, timeout)

    def barrier(self):  # noqa: D102
        t = torch.zeros(1, device=self.device)
        self.dist.all_reduce(t)
        torch.cuda.synchronize(self.device)

    def describe(self):  # noqa: D102
        v = ".".join(str(x) for x in torch.cuda.nccl.version())
        return [
            f"# backend nccl: torch.distributed ProcessGroupNCCL, NCCL {v} (torch "
            f"{torch.__version__}), NCCL_MULTI_RANK_GPU_ENABLE="
            f"{os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE', '(unset)')}"
        ]


class MpiRunner(Runner):
    """mpi4py buffer methods on MPI.COMM_WORLD (numpy views of the same torch buffers)."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def unsupported(self, spec, dtype, op):  # noqa: D102
        if dtype in ("float16", "bfloat16"):
            return f"MPI has no standard {dtype} type"
        if spec.reduces and op not in self.ops:
            return f"MPI has no {op} reduction"
        return None

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        c, o, inplace = self.comm, self.ops.get(op), self.MPI.IN_PLACE
        a = inp.numpy()
        b = out.numpy() if out is not None else None
        if coll == "reduce":
            if self.rank == root:
                return lambda: c.Reduce(inplace, a, o, root)
            return lambda: c.Reduce(a, None, o, root)
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        return {
            "sendrecv": lambda: c.Sendrecv(a, nxt, 0, b, prv, 0),
            "all_reduce": lambda: c.Allreduce(inplace, a, o),
            "reduce_scatter": lambda: c.Reduce_scatter_block(a, b, o),
            "all_gather": lambda: c.Allgather(a, b),
            "broadcast": lambda: c.Bcast(a, root),
            "all_to_all": lambda: c.Alltoall(a, b),
        }[coll]

    def barrier(self):  # noqa: D102
        self.comm.Barrier()

    def max_over_ranks(self, values):  # noqa: D102
        import numpy as np

        a = np.array(values, dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, a, self.MPI.MAX)
        return a.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        return int(self.comm.allreduce(int(value), self.MPI.SUM))

    def describe(self):  # noqa: D102
        return [f"# backend mpi: {mpi_version()} (mpi4py buffer methods)"]


def pycoll_version() -> str:
    try:
        import pycollectives

        v = getattr(pycollectives, "__version__", None)
        if v:
            return str(v)
        from importlib.metadata import version

        return version("pycollectives")
    except Exception:  # version is informative only
        return "unknown"


def mpi_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip().rstrip(",")
