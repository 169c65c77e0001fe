"""The check of ``-c 1``: inputs of small integers, so that every dtype holds every result exactly
(tolerance 0), the result each rank must hold after one call, and the count of wrong elements."""

from __future__ import annotations

import torch

from pycollectives.bench.specs import CollSpec


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
