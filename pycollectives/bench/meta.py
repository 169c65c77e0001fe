"""What a run records about where it ran: the command line, host, CPU model, date, library
versions and the PYCOLL_* settings (the JSON's metadata, the header lines), and the cache-line
round trip between two CPUs that the launcher measures before and after the ranks run."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import socket
import sys
from collections.abc import Sequence


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
    import torch

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


def command_line(argv: Sequence[str]) -> str:
    """How this benchmark was invoked with `argv`, for the metadata: the program name (``python -m
    pycollectives.bench`` when run as a module) and the arguments, shell-quoted."""
    prog = os.path.basename(sys.argv[0])
    prog = "python -m pycollectives.bench" if prog in ("__main__.py", "-c") else prog
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


def pycoll_version() -> str:
    """pycollectives' version (``__version__``, else the installed distribution's), or
    ``"unknown"``: it is informative only, so nothing here raises."""
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
    """The MPI library's version line (``MPI.Get_library_version()``). Raises ImportError
    without mpi4py."""
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip().rstrip(",")
