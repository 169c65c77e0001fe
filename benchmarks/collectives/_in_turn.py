"""What the benchmarks that time communicators in turn share (yield_budget.py,
paths_in_turn.py): the cases' buffers and calls."""

from __future__ import annotations

import torch

import pycollectives as pc


def buffers(coll: str, size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) float32 of `coll` at `size` bytes (nccl-tests' sizes: the all-reduce
    buffer, the reduce-scatter input, the all-gather output) on `n` ranks, the count a
    multiple of n and at least n."""
    count = max(size // 4, n)
    count -= count % n
    if coll == "all_gather":
        return torch.ones(count // n), torch.empty(count)
    return torch.ones(count), torch.empty(count // n)


def call(comm: pc.Communicator, coll: str, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One `coll` on `bufs` (buffers()): all-reduce in place on the input."""
    inp, out = bufs
    if coll == "all_reduce":
        comm.all_reduce(inp)
    elif coll == "reduce_scatter":
        comm.reduce_scatter(out, inp)
    else:
        comm.all_gather(out, inp)
