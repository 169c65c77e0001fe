"""What the benchmark knows about its inputs: the collectives (:class:`CollSpec`, ``SPECS``), the
data types, reduction ops and backends the flags accept, the environment variables the launcher
sets for its ranks, and the sizes of a sweep (``-b``, ``-e``, ``-f``) with the element count of
each, as nccl-tests computes them. It does not import torch (the command line checks its flags
with it before anything imports torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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

#: accepted -d names -> (canonical name, which is torch's, nccl-tests type name); torch is imported
#: only by the ranks (:func:`torch_dtype`), so that ``--help`` and bad flags answer at once.
DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float"),
    "float": ("float32", "float"),
    "float64": ("float64", "double"),
    "double": ("float64", "double"),
    "float16": ("float16", "half"),
    "half": ("float16", "half"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "int8": ("int8", "int8"),
    "uint8": ("uint8", "uint8"),
    "int32": ("int32", "int32"),
    "int64": ("int64", "int64"),
}
OPS: tuple[str, ...] = ("sum", "prod", "min", "max", "avg")
BACKENDS: tuple[str, ...] = ("pycoll", "gloo", "mpi", "nccl")  # nccl: --device cuda only

# The environment variables through which the launcher talks to its ranks.
RESULT_ENV = "PYCOLL_BENCH_RESULT"  # set by the launcher: rank 0 writes its rows there
# Set by the launcher of --interleave 1 --compare ...,mpi: the ranks run under mpirun and take
# MPI's ranks, and MPI takes its turns in them beside pycollectives and gloo.
JOINT_ENV = "PYCOLL_BENCH_JOINT_MPI"
CPU_ENV = "PYCOLL_BENCH_CPU"  # set by the launcher under --bind: the CPU this rank pins itself to

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a -d name (a key of ``DTYPES``); raises KeyError for another name."""
    import torch

    return getattr(torch, DTYPES[name][0])


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
    """Byte sizes from minbytes, multiplied by ``factor`` each step, up to and
    including maxbytes: the end size is the last one even when the steps skip
    it (``-b 8 -e 64M -f 4``: 8, 32, ..., 32M, 64M)."""
    sizes, s = [], max(minbytes, 0)
    while s <= maxbytes:
        sizes.append(s)
        if s == 0:
            s = 1
            continue
        s *= factor
    if sizes and sizes[-1] < maxbytes:
        sizes.append(maxbytes)
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
