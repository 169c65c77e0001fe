"""What the benchmarks that time communicators in turn share (yield_budget.py,
paths_in_turn.py): the cases' sizes, buffers and calls, and the run's note."""

from __future__ import annotations

import time

import torch

import pycollectives as pc


def parse_size(text: str) -> int:
    """Bytes of "16", "64K" or "2M"."""
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMkm")) * mult


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


def run_note(load0: tuple, load1: tuple, t0: float, busy0: float | None) -> str:
    """The load averages at start and end, the run's seconds and the other processes' CPU
    use before it (busy_cores), as a note line."""
    busy = (
        f"; other processes kept {busy0:.2f} of the CPUs busy before it."
        if busy0 is not None
        else "."
    )
    return (
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all{busy}"
    )
