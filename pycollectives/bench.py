"""pycollectives-bench: nccl-tests style benchmark of pycollectives (and of gloo / MPI for comparison).

Run it under torchrun (one process per rank)::

    torchrun --nproc-per-node 2 -m pycollectives.bench -b 8 -e 64M -f 2 --coll all

or let it spawn the local ranks itself::

    python -m pycollectives.bench --nproc 2 -b 1K -e 16M --compare gloo,mpi --json out.json

Each size is timed ``--trials`` times; one trial is ``-n`` iterations timed together after a
barrier. The reported time is the median over trials of (max over ranks of the time per
iteration); the JSON rows also list every trial's time (``trials_us``). ``--compare gloo,mpi``
runs gloo in the same ranks after pycollectives and MPI as its own mpirun job after them, each
backend timing all trials of a size back to back after ``-w`` warmup iterations. With
``--interleave 1`` they run in the same ranks (launched by mpirun when MPI is compared) in
``--trials`` rounds instead: each round goes over every size and at each size every backend runs
one trial (``-w`` warmup iterations before its first trial of the size, 1 before each later one).
A slowdown episode of a shared machine then spoils a trial or two of a size, which the median
rejects, and a drift weighs on every side of a ratio alike; the buffers of every size stay
allocated until their last trial. Ranks spawned with ``--nproc`` are pinned one per CPU when there
are enough CPUs (``--bind``, as mpirun binds 2 ranks to cores), and the mpirun jobs get the same
choice. With ``-c 1`` every row is then checked on a fresh call whose inputs are small integers,
so the exact result is known in every dtype (tolerance 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec

import torch

from pycollectives._bench_util import (
    BACKENDS,
    COLLECTIVES,
    DTYPES,
    OPS,
    SPECS,
    CollSpec,
    GlooRunner,
    MpiRunner,
    NcclRunner,
    PycollRunner,
    Row,
    Runner,
    base_metadata,
    check_matplotlib,
    column_header,
    comparison_tables,
    count_wrong,
    counts_for,
    cpu_round_trip,
    expected_result,
    fill_check_inputs,
    footer,
    format_row,
    mpi_version,
    parse_size,
    plot,
    pycoll_version,
    read_json,
    size_list,
    write_json,
)

_RESULT_ENV = "PYCOLL_BENCH_RESULT"  # set by the launcher: rank 0 writes its rows there
# Set by the launcher of --interleave 1 --compare ...,mpi: the ranks run under mpirun and take
# MPI's ranks, and MPI takes its turns in them beside pycollectives and gloo.
_JOINT_ENV = "PYCOLL_BENCH_JOINT_MPI"
_CPU_ENV = "PYCOLL_BENCH_CPU"  # set by the launcher under --bind: the CPU this rank pins itself to
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return conv


def _coll_arg(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if names == ["all"]:
        return list(COLLECTIVES)
    bad = [c for c in names if c not in COLLECTIVES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown collective {', '.join(bad) or text!r}; choose from {', '.join(COLLECTIVES)} or all"
        )
    return list(dict.fromkeys(names))


def _compare_arg(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(bad)}; choose from gloo, mpi, nccl (--device cuda)"
        )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (nccl-tests flags plus launcher / comparison options)."""
    p = argparse.ArgumentParser(
        prog="pycollectives-bench",
        description="nccl-tests style collective benchmark for pycollectives "
        "(run under torchrun, or with --nproc N to spawn local ranks)",
    )
    p.add_argument(
        "-b",
        "--minbytes",
        type=_size_arg,
        default=8,
        help="smallest size (default 8; K/M/G suffixes)",
    )
    p.add_argument(
        "-e", "--maxbytes", type=_size_arg, default=64 << 20, help="largest size (default 64M)"
    )
    p.add_argument(
        "-f", "--stepfactor", type=_int_at_least(2), default=2, help="size multiplier (default 2)"
    )
    p.add_argument(
        "-n", "--iters", type=_int_at_least(1), default=20, help="iterations per trial (default 20)"
    )
    p.add_argument(
        "-w",
        "--warmup_iters",
        type=_int_at_least(0),
        default=5,
        help="warmup iterations (default 5)",
    )
    p.add_argument(
        "-c", "--check", type=int, choices=(0, 1), default=1, help="check results (default 1)"
    )
    p.add_argument("-o", "--op", choices=OPS, default="sum", help="reduction op (default sum)")
    p.add_argument(
        "-d",
        "--datatype",
        choices=list(DTYPES),
        default="float32",
        metavar="DTYPE",
        help=f"data type (default float32): {', '.join(DTYPES)}",
    )
    p.add_argument(
        "-r",
        "--root",
        type=_int_at_least(0),
        default=0,
        help="root of broadcast / reduce (default 0)",
    )
    p.add_argument(
        "--coll",
        type=_coll_arg,
        default=["all_reduce"],
        metavar="NAME[,NAME]",
        help=f"collectives: {', '.join(COLLECTIVES)} or all (default all_reduce)",
    )
    p.add_argument(
        "--trials", type=_int_at_least(1), default=5, help="timed trials per size (default 5)"
    )
    p.add_argument(
        "--nproc",
        type=_int_at_least(1),
        default=None,
        help="spawn this many local ranks (default 2; ignored under torchrun)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="overall timeout in seconds, also each operation's timeout (default 3600)",
    )
    p.add_argument(
        "--compare",
        type=_compare_arg,
        default=[],
        metavar="gloo[,mpi]",
        help="also run the same sizes on torch.distributed gloo (in the same ranks, after "
        "pycollectives) and/or MPI (mpi4py, a separate mpirun job afterwards; with --interleave 1 "
        "all in the same ranks under mpirun)",
    )
    p.add_argument(
        "--interleave",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: with --compare, run --trials rounds, each of which goes over every size and "
        "runs one trial of pycollectives and of each peer at each size (-w warmup iterations "
        "before the first trial of a size, 1 before each later one), in the same ranks (run by "
        "mpirun when MPI is compared), instead of one sweep after the other with the trials of a "
        "size back to back: a slowdown of the machine spoils a trial or two of a size, which "
        "the median rejects, and a slow drift weighs on all alike; the buffers of all sizes "
        "stay allocated together, and a peer's threads may slow the microsecond sizes of "
        "pycollectives that follow them",
    )
    p.add_argument(
        "--bind",
        choices=("auto", "core", "none"),
        default="auto",
        help="with --nproc: core pins rank r to the r-th usable CPU (round robin), none leaves "
        "the ranks to the scheduler, auto (default) pins when there are at least as many CPUs as "
        "ranks, as mpirun binds 2 ranks to cores by default; mpirun jobs (MPI) get the same "
        "choice (--bind-to core, with more ranks than CPUs --map-by core:OVERSUBSCRIBE "
        "--bind-to core:overload-allowed; or none). Unpinned ranks that wake each other may be "
        "stacked on one CPU by the scheduler for a whole run",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the buffers live (default cpu); cuda: rank r uses cuda:(LOCAL_RANK %% "
        "device count), times are taken after torch.cuda.synchronize(), and --compare gloo "
        "runs on the same CUDA tensors",
    )
    p.add_argument(
        "-R",
        "--registered",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: pycollectives' buffers come from comm.alloc_shared (symmetric shared-memory "
        "windows, as nccl-tests -R with registered buffers), so all_reduce, reduce_scatter "
        "and all_gather run in place across the ranks' buffers; peers keep plain buffers "
        "(default 0)",
    )
    p.add_argument("--json", metavar="FILE", help="write every row and the run's metadata as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="pycoll",
        help="(advanced) backend run by the rank processes (default pycoll)",
    )
    return p


# --------------------------------------------------------------------------------------------
# benchmark loop (inside a rank process)
# --------------------------------------------------------------------------------------------


def time_trial(
    runner: Runner, fn: Callable[[], None], iters: int, sync: Callable[[], None] | None = None
) -> float:
    """One trial: a barrier, then `iters` calls timed together. Returns this rank's seconds per
    call. `sync` (CUDA: torch.cuda.synchronize) runs before the barrier and before the stop."""
    if sync:
        sync()
    runner.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - t0) / iters


@dataclass
class _Point:
    """One size of a sweep between its prepare and its finish: the row, the buffers and bound
    call (None when the backend cannot run it) and this rank's seconds per call of each trial."""

    row: Row
    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    fn: Callable[[], None] | None = None
    per_iter: list[float] = field(default_factory=list)


class _Sweep:
    """One collective on one backend, measured size by size and trial by trial, so that backends
    can take turns (--interleave): prepare(count, size) makes a size's row, buffers and bound call,
    trial(size) times one trial of it, finish(size) records its median (and -c 1 check) and frees
    its buffers. Every rank makes the same calls in the same order (they run collectives)."""

    def __init__(
        self, runner: Runner, spec: CollSpec, args: argparse.Namespace, rewarm: int = 0
    ) -> None:
        self.runner, self.spec, self.args = runner, spec, args
        self.rewarm = rewarm  # warmup calls before each trial of a size after its first
        self.dname, self.tdtype, self.tname = DTYPES[args.datatype]
        self.device = getattr(args, "cuda_device", None)  # "cuda:i", set by _rank_main
        self.sync = torch.cuda.synchronize if self.device is not None else None
        self.reason = runner.unsupported(spec, self.dname, args.op)
        self.points: dict[int, _Point] = {}  # size -> prepared and not yet finished
        self.rows: list[Row] = []  # in the order prepared
        self.lines = [f"# Collective: {spec.name}  backend: {runner.name}\n{column_header(spec)}"]
        self._noted = ""  # the note of the last finished row (a repeated note is not printed)

    def prepare(self, count: int, size: int) -> None:
        """Makes the row of one size and, unless the backend cannot run it, its buffers (holding
        the check inputs) and bound call. The sweep's first size probes the first call where the
        runner asks for it: an error there becomes the reason of every row."""
        runner, spec, args = self.runner, self.spec, self.args
        n, op, root = runner.world_size, args.op, args.root
        row = Row(
            backend=runner.name, collective=spec.name, nranks=n, size=size, count=count,
            dtype=self.dname, op=op if spec.reduces else "none", root=root if spec.rooted else -1,
            time_us=None, algbw=None, busbw=None, wrong=None, note=self.reason or "",
        )  # fmt: skip
        point = self.points[size] = _Point(row)
        first = not self.rows
        self.rows.append(row)
        if self.reason is not None:
            return
        inp, out = runner.buffers(spec, count, self.tdtype, self.device)
        fill_check_inputs(spec, runner.rank, n, count, op, root, inp, out)
        fn = runner.bind(spec.name, inp, out, op, root)
        if runner.probe_first_call and first:
            try:
                fn()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                self.reason = f"{runner.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                row.note = self.reason
                return
        point.inp, point.out, point.fn = inp, out, fn

    def trial(self, size: int) -> None:
        """Times one trial of a prepared size (nothing if the backend cannot run it): `-w` warmup
        calls before its first trial, `rewarm` before each later one."""
        point = self.points[size]
        if point.fn is None:
            return
        for _ in range(self.rewarm if point.per_iter else self.args.warmup_iters):
            point.fn()
        point.per_iter.append(time_trial(self.runner, point.fn, self.args.iters, self.sync))

    def finish(self, size: int) -> str:
        """Records a size once its trials are done: per trial the slowest rank's time per call,
        their median, bandwidths and with -c 1 the wrong elements of one fresh call. Frees the
        size's buffers; returns its table line."""
        point = self.points.pop(size)
        row = point.row
        if point.fn is not None:
            row.trials_us = [t * 1e6 for t in self.runner.max_over_ranks(point.per_iter)]
            row.time_us = statistics.median(row.trials_us)
            row.algbw = size / row.time_us / 1e3 if row.time_us > 0 else 0.0  # GB/s
            row.busbw = row.algbw * self.spec.busbw_factor(row.nranks)
            if self.args.check:
                row.wrong = self._check(point)
        line = format_row(row, self.tname)
        if row.time_us is None and row.note and row.note != self._noted:
            line += f"   # {row.note}"
        self._noted = row.note
        self.lines.append(line)
        return line

    def _check(self, point: _Point) -> int:
        """Wrong elements, summed over ranks, of one call on fresh check inputs."""
        runner, spec, args, row = self.runner, self.spec, self.args, point.row
        rank, n, count, op, root = runner.rank, runner.world_size, row.count, args.op, args.root
        fill_check_inputs(spec, rank, n, count, op, root, point.inp, point.out)
        point.fn()
        want = expected_result(spec, rank, n, count, op, root, self.tdtype,
                               check_nonroot=runner.check_nonroot_reduce)  # fmt: skip
        result = point.out if point.out is not None else point.inp
        return runner.sum_over_ranks(count_wrong(result, want))


def bench_collective(
    runners: Sequence[Runner], spec: CollSpec, args: argparse.Namespace, say: Callable[[str], None]
) -> list[Row]:
    """Benchmark one collective over all sizes on every runner: one runner after the other (all
    trials of a size back to back), each row printed as it is measured, or with --interleave 1
    in `--trials` rounds, each of which runs one trial of every runner at every size (the same
    tables, printed once the collective is done)."""
    interleave = bool(args.interleave) and len(runners) > 1
    sweeps = [_Sweep(r, spec, args, rewarm=1 if interleave else 0) for r in runners]
    elsize = torch.empty(0, dtype=sweeps[0].tdtype).element_size()
    sizes: dict[int, int] = {}  # size -> count, in order
    for nbytes in size_list(args.minbytes, args.maxbytes, args.stepfactor):
        count, size = counts_for(spec, nbytes, elsize, runners[0].world_size)
        if count > 0:  # else too small for one element per rank; duplicates after rounding merge
            sizes.setdefault(size, count)
    if interleave:
        _interleaved(sweeps, sizes, args.trials)
        for sweep in sweeps:
            say("\n".join(sweep.lines))
            say(footer(sweep.rows))
    else:
        for sweep in sweeps:  # one backend after the other, each row printed as it is measured
            say(sweep.lines[0])
            for size, count in sizes.items():
                sweep.prepare(count, size)
                for _ in range(args.trials):
                    sweep.trial(size)
                say(sweep.finish(size))
            say(footer(sweep.rows))
    return [row for sweep in sweeps for row in sweep.rows]


def _interleaved(sweeps: Sequence[_Sweep], sizes: dict[int, int], trials: int) -> None:
    """`trials` rounds over every size (size -> count), one trial of every sweep at each: a
    slowdown of the machine then spoils one trial of a size, which the median rejects, rather
    than all of them. Buffers are made in the first round and freed after the last trial."""
    for rnd in range(trials):
        for size, count in sizes.items():
            for sweep in sweeps:
                if rnd == 0:
                    sweep.prepare(count, size)
                sweep.trial(size)
                if rnd == trials - 1:
                    sweep.finish(size)


def _make_store(rank: int, world_size: int, timeout: float) -> object:
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun already serves it
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=(rank == 0 and not agent),
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dist.PrefixStore("pycoll-bench", store)


def _run_header(runner: Runner, args: argparse.Namespace, ranks_info: list[str]) -> str:
    dname, _, tname = DTYPES[args.datatype]
    lines = [
        f"# pycollectives-bench  backend: {runner.name}  nranks: {runner.world_size}  "
        f"collectives: {','.join(args.coll)}",
        f"# minBytes {args.minbytes} maxBytes {args.maxbytes} step: {args.stepfactor}(factor) "
        f"warmup iters: {args.warmup_iters} iters: {args.iters} trials: {args.trials} "
        f"validation: {args.check}",
        f"# dtype: {dname} ({tname})  op: {args.op}  root: {args.root}",
        f"# time: median over {args.trials} trials of (max over ranks of the time per iteration); "
        "algbw = size / time; busbw = algbw * factor",
        *runner.describe(),
        "#",
        *ranks_info,
        "#",
    ]
    return "\n".join(lines)


def _rank_main(args: argparse.Namespace) -> int:
    """Body of one rank process (torchrun, the --nproc launcher, or mpirun for --backend mpi)."""
    joint = bool(os.environ.get(_JOINT_ENV))  # under mpirun, MPI beside the others
    if args.backend == "mpi" or joint:
        mpi = MpiRunner()
        rank, world = mpi.rank, mpi.world_size
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "mpi":
        runners_todo: list[str] = ["mpi"]
        store = None
    else:
        runners_todo = [args.backend] + [b for b in args.compare if b not in (args.backend, "mpi")]
        runners_todo += ["mpi"] if joint else []
        store = _make_store(rank, world, args.timeout)

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    if args.root >= world:
        if rank == 0:
            print(
                f"pycollectives-bench: error: --root {args.root} is not a rank (nranks {world})",
                file=sys.stderr,
            )
        return 2
    if args.nproc is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        say("# --nproc is ignored under torchrun (one process per rank)")
    if "mpi" in args.compare and args.backend != "mpi" and not os.environ.get(_RESULT_ENV):
        say(
            "# --compare mpi: only available when the benchmark spawns the ranks itself (--nproc); skipped"
        )

    info = f"#  Rank {rank:2d} Pid {os.getpid():6d} on {socket.gethostname()}"
    if (cpu := os.environ.get(_CPU_ENV)) is not None:
        os.sched_setaffinity(0, {int(cpu)})
    if hasattr(os, "sched_getaffinity"):
        info += f" cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}"
    args.cuda_device = None
    if getattr(args, "device", "cpu") == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        args.cuda_device = f"cuda:{local % torch.cuda.device_count()}"  # a str: JSON metadata
        torch.cuda.set_device(args.cuda_device)
        info += f" device {args.cuda_device} {torch.cuda.get_device_name(args.cuda_device)}"
    if store is not None:
        store.set(f"info/{rank}", info)
        ranks_info = [store.get(f"info/{r}").decode() for r in range(world)] if rank == 0 else []
    else:
        ranks_info = mpi.comm.gather(info, root=0) or []

    rows: list[Row] = []
    extra_meta: dict[str, str] = {}
    runners: list[Runner] = []
    for backend in runners_todo:
        if backend == "pycoll":
            cuda = args.cuda_device is not None
            runner: Runner = PycollRunner(
                rank, world, store, args.timeout, args.registered, cuda=cuda
            )
            extra_meta["pycollectives"] = pycoll_version()
            extra_meta["simd_level"] = (
                runner.pc.simd_level() if hasattr(runner.pc, "simd_level") else "?"
            )
            extra_meta["buffers"] = "registered" if args.registered else "plain"
            extra_meta["single_copy"] = "yes" if runner.comm.single_copy else "no"
        elif backend == "gloo":
            runner = GlooRunner(rank, world, store, args.timeout)
        elif backend == "nccl":
            runner = NcclRunner(rank, world, store, args.timeout)
        else:
            runner = mpi
            extra_meta["mpi"] = mpi_version()
            extra_meta["mpi4py"] = __import__("mpi4py").__version__
        say(_run_header(runner, args, ranks_info))
        runners.append(runner)
    for coll in args.coll:
        rows += bench_collective(runners, SPECS[coll], args, say)
    for runner in runners:
        runner.close()

    if store is not None:  # rank 0 serves the store: let it leave last
        store.add("done", 1)
        if rank == 0:
            deadline = time.monotonic() + 60
            while store.add("done", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)

    wrong = sum(r.wrong or 0 for r in rows)
    if rank == 0:
        meta = base_metadata()
        meta["command"] = _command_line(sys.argv[1:])
        meta["versions"].update(extra_meta)
        meta.update(nranks=world, backends=runners_todo, args=dict(vars(args)))
        result = os.environ.get(_RESULT_ENV)
        if result:
            write_json(result, meta, rows)
            return 0
        return finalize(args, meta, rows, runners_todo)
    if os.environ.get(_RESULT_ENV):
        return 0
    return 1 if wrong else 0


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


# --------------------------------------------------------------------------------------------
# launcher (--nproc)
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rank_cpus(args: argparse.Namespace, nproc: int) -> list[int] | None:
    """The CPU of each rank under --bind, or None when the ranks are not pinned."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus or args.bind == "none" or (args.bind == "auto" and nproc > len(cpus)):
        return None
    return [cpus[r % len(cpus)] for r in range(nproc)]


def _run_ranks(
    argv: Sequence[str], nproc: int, deadline: float, result_path: str, cpus: list[int] | None
) -> int:
    """Spawn nproc ranks (rank r pinned to cpus[r] when given), wait for all; on a failure or the
    deadline stop the others."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pycollectives.bench", *argv]
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            env = _child_env(
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(r),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    _RESULT_ENV: result_path,
                    **({_CPU_ENV: str(cpus[r])} if cpus else {}),
                }
            )
            procs.append(subprocess.Popen(cmd, env=env))
        while True:
            running = False
            for r, p in enumerate(procs):
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0:
                    print(
                        f"pycollectives-bench: rank {r} (pid {p.pid}) exited with status {rc}; "
                        "stopping the other ranks",
                        file=sys.stderr,
                        flush=True,
                    )
                    _stop(procs)
                    return rc if rc > 0 else 1
            if not running:
                return 0
            if time.monotonic() > deadline:
                print(
                    "pycollectives-bench: timeout; stopping the ranks", file=sys.stderr, flush=True
                )
                _stop(procs)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _mpi_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--backend",
        "mpi",
        "-b",
        str(args.minbytes),
        "-e",
        str(args.maxbytes),
        "-f",
        str(args.stepfactor),
        "-n",
        str(args.iters),
        "-w",
        str(args.warmup_iters),
        "-c",
        str(args.check),
        "-o",
        args.op,
        "-d",
        args.datatype,
        "-r",
        str(args.root),
        "--coll",
        ",".join(args.coll),
        "--trials",
        str(args.trials),
        "--timeout",
        str(args.timeout),
    ]


def _mpi_missing() -> list[str]:
    """What running MPI needs and this machine lacks (empty: nothing)."""
    return [
        w
        for w, ok in (
            ("mpi4py", find_spec("mpi4py") is not None),
            ("mpirun", shutil.which("mpirun") is not None),
        )
        if not ok
    ]


def _mpirun_binding(cpus: list[int] | None) -> list[str]:
    """mpirun's binding flags for ranks pinned to `cpus` (_rank_cpus; None: not pinned): one
    rank per core, or, with more ranks than cores, rank r on core r mod ncpus as _rank_cpus
    places them (plain --bind-to core refuses to overload a core)."""
    if cpus is None:
        return ["--bind-to", "none"]
    if len(set(cpus)) < len(cpus):
        return ["--map-by", "core:OVERSUBSCRIBE", "--bind-to", "core:overload-allowed"]
    return ["--bind-to", "core"]


def _mpirun(
    argv: Sequence[str],
    nproc: int,
    deadline: float,
    extra_env: dict[str, str],
    cpus: list[int] | None,
) -> int:
    """Runs the benchmark with `argv` as an mpirun job of nproc ranks, bound to cores as `cpus`
    says (_rank_cpus) or not; returns its status."""
    cmd = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        *_mpirun_binding(cpus),
        "-np",
        str(nproc),
        sys.executable,
        "-m",
        "pycollectives.bench",
        *argv,
    ]
    env = _child_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra_env)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop([proc])
        return 124
    except KeyboardInterrupt:
        _stop([proc])
        return 130


def _run_mpi(
    args: argparse.Namespace, nproc: int, deadline: float
) -> tuple[dict, list[Row]] | None:
    """Run the same benchmark under mpirun (--backend mpi) and return its metadata and rows."""
    if missing := _mpi_missing():
        print(
            f"# --compare mpi: {' and '.join(missing)} not found; skipping MPI "
            "(apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)",
            flush=True,
        )
        return None
    fd, path = tempfile.mkstemp(prefix="pycoll-bench-mpi-", suffix=".json")
    os.close(fd)
    rc = _mpirun(_mpi_argv(args), nproc, deadline, {_RESULT_ENV: path}, _rank_cpus(args, nproc))
    try:
        if rc == 0 and os.path.getsize(path) > 0:
            return read_json(path)
        print(
            f"# --compare mpi: the MPI job failed (status {rc}); comparing without it", flush=True
        )
        return None
    finally:
        os.unlink(path)


def _launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    nproc = args.nproc or 2
    if args.root >= nproc:
        build_parser().error(f"--root {args.root} is not a rank (--nproc {nproc})")
    deadline = time.monotonic() + args.timeout
    # --interleave 1 with MPI: one mpirun job whose ranks run every backend in turn.
    joint = args.interleave and "mpi" in args.compare and not _mpi_missing()
    cpus = _rank_cpus(args, nproc)
    trip = cpu_round_trip()
    if trip:
        a, b = trip["cpus"]
        print(f"# Cache-line round trip CPU {a} <-> CPU {b}: {trip['ns']:.0f} ns", flush=True)
    fd, result_path = tempfile.mkstemp(prefix="pycoll-bench-", suffix=".json")
    os.close(fd)
    try:
        if joint:
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
            env.update({_RESULT_ENV: result_path, _JOINT_ENV: "1"})
            rc = _mpirun(argv, nproc, deadline, env, cpus)
        else:
            rc = _run_ranks(argv, nproc, deadline, result_path, cpus)
        if rc != 0:
            return rc
        meta, rows = read_json(result_path)
    finally:
        os.unlink(result_path)
    meta["command"] = _command_line(argv)
    backends = list(meta.get("backends", []))
    if "mpi" in args.compare and args.backend != "mpi" and not joint:
        sys.stdout.flush()
        got = _run_mpi(args, nproc, deadline)
        if got is not None:
            mmeta, mrows = got
            rows += mrows
            backends.append("mpi")
            meta["backends"] = backends
            meta["versions"].update(
                {k: v for k, v in mmeta["versions"].items() if k.startswith("mpi")}
            )
    if trip:
        # the host may move the vCPUs during a run: the figures sit between these two
        after = (cpu_round_trip() or {}).get("ns")
        meta["cpu_round_trip_ns"] = {"cpus": trip["cpus"], "before": trip["ns"], "after": after}
        if after is not None:
            print(f"# Cache-line round trip after the run: {after:.0f} ns", flush=True)
    return finalize(args, meta, rows, backends)


def _command_line(argv: Sequence[str]) -> str:
    prog = os.path.basename(sys.argv[0])
    prog = "python -m pycollectives.bench" if prog in ("bench.py", "__main__.py", "-c") else prog
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


def _under_mpirun() -> bool:
    return any(
        k in os.environ
        for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    )


def _launch_mpi(args: argparse.Namespace) -> int:
    """--backend mpi outside mpirun: run the MPI job with --nproc ranks."""
    nproc = args.nproc or 2
    if args.root >= nproc:
        build_parser().error(f"--root {args.root} is not a rank (--nproc {nproc})")
    got = _run_mpi(args, nproc, time.monotonic() + args.timeout)
    if got is None:
        return 1
    meta, rows = got
    meta["command"] = _command_line(sys.argv[1:])
    return finalize(args, meta, rows, ["mpi"])


def _cuda_unavailable() -> str | None:
    """Why --device cuda cannot run here, or None."""
    from pycollectives import _C

    if not getattr(_C, "cuda_built", lambda: False)():
        return "pycollectives was built without CUDA"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pycollectives-bench`` / ``python -m pycollectives.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minbytes > args.maxbytes:
        parser.error(f"--minbytes {args.minbytes} is larger than --maxbytes {args.maxbytes}")
    if args.registered and args.device == "cuda":
        parser.error("-R 1: registered buffers are shared-memory windows, CPU only")
    if args.plot and (msg := check_matplotlib()):
        parser.error(msg)
    if args.device == "cuda" and (msg := _cuda_unavailable()):
        print(f"pycollectives-bench: --device cuda: {msg}", file=sys.stderr)
        return 2
    if "nccl" in args.compare + [args.backend] and args.device != "cuda":
        parser.error("nccl runs on CUDA tensors only: add --device cuda")
    if "mpi" in args.compare + [args.backend] and args.device == "cuda":
        parser.error("--device cuda: the mpi comparison runs on CPU buffers only")
    try:
        if args.backend == "mpi" and not _under_mpirun():
            return _launch_mpi(args)
        in_job = os.environ.get(_JOINT_ENV) or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        if args.backend == "mpi" or in_job:
            return _rank_main(args)
        return _launch(args, argv)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        rank = os.environ.get("RANK", "?")
        traceback.print_exc()
        print(
            f"pycollectives-bench: rank {rank}: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
