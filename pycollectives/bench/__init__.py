"""pycollectives-bench: nccl-tests style benchmark of pycollectives (and of gloo / MPI for comparison).

Let it spawn the local ranks itself::

    pycollectives-bench --nproc 2 -b 1K -e 16M --compare gloo,mpi --json out.json

or run it under torchrun (one process per rank)::

    torchrun --nproc-per-node 2 --no-python pycollectives-bench -b 8 -e 64M -f 2 --coll all

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

The modules, from the bottom up (each imports only modules above it in this list):

- :mod:`~pycollectives.bench.specs`: the collectives, dtypes, ops, backends; sizes and counts.
- :mod:`~pycollectives.bench.check`: ``-c 1``'s inputs, expected results and wrong counts.
- :mod:`~pycollectives.bench.meta`: the run's metadata (host, CPU, versions, cache-line round trip).
- :mod:`~pycollectives.bench.report`: rows, the tables, the comparison tables, JSON, plot.
- :mod:`~pycollectives.bench.runners`: the backends a rank runs (pycollectives, gloo, nccl, MPI).
- :mod:`~pycollectives.bench.sweep`: the timing loop over sizes and trials.
- :mod:`~pycollectives.bench.rank`: the body of one rank process.
- :mod:`~pycollectives.bench.launch`: ``--nproc``: spawning the ranks (or mpirun), binding them.
- :mod:`~pycollectives.bench.cli`: the flags and :func:`main`; ``__main__`` runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pycollectives.bench.cli import build_parser, main
from pycollectives.bench.specs import COLLECTIVES, SPECS, CollSpec, parse_size

if TYPE_CHECKING:
    from pycollectives.bench.report import Row
    from pycollectives.bench.runners import Runner
    from pycollectives.bench.sweep import bench_collective

# Names whose modules import torch, imported on first use (PEP 562): `python -m
# pycollectives.bench --help` imports this package and must not wait for torch.
_LAZY = {"Row": "report", "Runner": "runners", "bench_collective": "sweep"}


def __getattr__(name: str) -> Any:
    """Imports the module of a public name on its first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "COLLECTIVES",
    "SPECS",
    "CollSpec",
    "Row",
    "Runner",
    "bench_collective",
    "build_parser",
    "main",
    "parse_size",
]
