"""The launcher: ``pycollectives-bench --nproc N`` starts N rank processes on this host (pinned
one per CPU under ``--bind``), or one mpirun job of them when MPI is compared in the same ranks,
waits for them, runs the separate MPI job of ``--compare mpi``, and reports the rows that rank 0
handed back (``PYCOLL_BENCH_RESULT``).

A rank runs this same program (``python -m pycollectives.bench``) with the same arguments and the
variables of :mod:`pycollectives.bench.rank` in its environment; :func:`bench_command` keeps the
launcher's working directory off the rank's ``sys.path``."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.util import find_spec

import pycollectives
from pycollectives.bench.meta import command_line, cpu_round_trip
from pycollectives.bench.report import Row, finalize, read_json
from pycollectives.bench.specs import CPU_ENV, JOINT_ENV, RESULT_ENV

# The directory holding the pycollectives the launcher runs (site-packages, or a source checkout,
# which then goes first on the ranks' PYTHONPATH, so that they import the same one).
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pycollectives.__file__)))
# `python -P` (Python >= 3.11) leaves the working directory off sys.path; before, a bootstrap
# removes the entry that `-c` put there ('': the working directory) and runs the module.
_SAFE_PATH_FLAG = sys.version_info >= (3, 11)
_BOOTSTRAP = (
    "import runpy, sys; del sys.path[0]; "
    "runpy.run_module('pycollectives.bench', run_name='__main__', alter_sys=True)"
)


def bench_command(argv: Sequence[str]) -> list[str]:
    """This Python running ``pycollectives.bench`` with `argv`, with the working directory kept
    off ``sys.path``: the command of each rank, and of scripts that run the benchmark.

    ``python -m`` puts the working directory first on ``sys.path``, ahead of PYTHONPATH and
    site-packages; from the root of a clone (the README's quick start) the ranks would then import
    the source tree, which has no built ``_C``, instead of the installed package. ``-P`` (Python
    >= 3.11) leaves it off, and so does the bootstrap on 3.10, so that a rank finds pycollectives
    on its PYTHONPATH (:func:`_child_env`), then in site-packages, like the launcher did."""
    if _SAFE_PATH_FLAG:
        return [sys.executable, "-P", "-m", "pycollectives.bench", *argv]
    return [sys.executable, "-c", _BOOTSTRAP, *argv]


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the ranks' TCPStore."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_path() -> set[str]:
    """The directories this interpreter searches without PYTHONPATH (its site-packages among
    them): a package found there needs no PYTHONPATH entry, which would put those directories
    ahead of the standard library in the ranks."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return {os.path.abspath(d) for d in dirs}


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a rank (or mpirun): the package's parent directory first on
    PYTHONPATH where the interpreter would not find it by itself (a source checkout), so that the
    ranks import the same pycollectives as the launcher, OMP_NUM_THREADS=1 unless set, and
    `extra`."""
    env = os.environ.copy()
    if _PKG_PARENT not in _default_path():  # a source checkout: the ranks need it on their path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Terminates the processes still running, and kills those not gone within 5 s."""
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
    cmd = bench_command(argv)
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
                    RESULT_ENV: result_path,
                    **({CPU_ENV: str(cpus[r])} if cpus else {}),
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
    """The flags of the separate MPI job (--backend mpi) that measures what `args` asks for."""
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


MPI_INSTALL = "apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py"


def mpi_missing() -> list[str]:
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
        *bench_command(argv),
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
    if missing := mpi_missing():
        print(
            f"# --compare mpi: {' and '.join(missing)} not found; skipping MPI ({MPI_INSTALL})",
            flush=True,
        )
        return None
    fd, path = tempfile.mkstemp(prefix="pycoll-bench-mpi-", suffix=".json")
    os.close(fd)
    rc = _mpirun(_mpi_argv(args), nproc, deadline, {RESULT_ENV: path}, _rank_cpus(args, nproc))
    try:
        if rc == 0 and os.path.getsize(path) > 0:
            return read_json(path)
        print(
            f"# --compare mpi: the MPI job failed (status {rc}); comparing without it", flush=True
        )
        return None
    finally:
        os.unlink(path)


def launch_ranks(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs the benchmark `argv` (parsed: `args`) on --nproc local ranks (under one mpirun job
    with --interleave 1 --compare ...,mpi), then the separate MPI job of --compare mpi, and
    reports every row; returns the exit status (a failed rank's, 124 on the timeout, 1 when
    values were wrong). The caller has checked that --root is a rank."""
    nproc = args.nproc or 2
    deadline = time.monotonic() + args.timeout
    # --interleave 1 with MPI: one mpirun job whose ranks run every backend in turn.
    joint = args.interleave and "mpi" in args.compare and not mpi_missing()
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
            env.update({RESULT_ENV: result_path, JOINT_ENV: "1"})
            rc = _mpirun(argv, nproc, deadline, env, cpus)
        else:
            rc = _run_ranks(argv, nproc, deadline, result_path, cpus)
        if rc != 0:
            return rc
        meta, rows = read_json(result_path)
    finally:
        os.unlink(result_path)
    meta["command"] = command_line(argv)
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


def launch_mpi(args: argparse.Namespace) -> int:
    """--backend mpi outside mpirun: run the MPI job with --nproc ranks and report its rows;
    returns the exit status (1 when the job failed or values were wrong). The caller has checked
    that --root is a rank."""
    nproc = args.nproc or 2
    got = _run_mpi(args, nproc, time.monotonic() + args.timeout)
    if got is None:
        return 1
    meta, rows = got
    meta["command"] = command_line(sys.argv[1:])
    return finalize(args, meta, rows, ["mpi"])
