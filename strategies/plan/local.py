"""The planner for this machine: its ranks sharing the CPU cores and memory, the shared-memory
link fitted from a `pycollectives-bench --json` run (or, without one, half the copy bandwidth
measured now: a collective through shared memory copies every byte in and out), the
throughput of one block's forward and backward measured now. What
`examples/train_gpt.py --plan` uses to pick its layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .costs import LinkCost, load_bench_json
from .fitted import CostModel, fit_model
from .inputs import Request, parse_request
from .layout import Layout, Priced
from .units import PlanInputError

__all__ = [
    "available_memory",
    "block_flops",
    "choose",
    "copy_bandwidth",
    "cpu_flops",
    "local_request",
]

# train_gpt.py's schedule names <-> the planner's (pipeline.build's)
SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zb-h1": "zbh1"}


def cpu_flops(threads: int = 1, n: int = 384, seconds: float = 0.2) -> float:
    """fp32 FLOP/s of `threads` torch threads on an n x n matmul, best of the repetitions
    that fit in `seconds`."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(old)


def block_flops(hidden: int, heads: int, seq: int, batch: int, threads: int = 1) -> float:
    """Effective fp32 FLOP/s of one reference-GPT block's forward and backward on a
    (batch, seq, hidden) micro-batch with `threads` torch threads: the FLOPs the planner
    counts for it (3 x (2 x parameters + 4 x hidden x seq) per token) over the best time
    of 5 runs. On a CPU with small layers this folds in the per-operation overheads that
    FLOPs alone miss."""
    from pycollectives.strategies.models.gpt import Block, GPTConfig

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        block = Block(GPTConfig(d_model=hidden, n_head=heads, seq_len=seq, n_layer=1))
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        params = sum(p.numel() for p in block.parameters())
        best = float("inf")
        for _ in range(6):
            t0 = time.perf_counter()
            block(x).sum().backward()
            best = min(best, time.perf_counter() - t0)
        return 3 * (2 * params + 4 * hidden * seq) * batch * seq / best
    finally:
        torch.set_num_threads(old)


def copy_bandwidth(nbytes: int = 32 << 20, seconds: float = 0.2) -> float:
    """Bytes per second of one large copy in memory (best of the repetitions)."""
    src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes. Raises PlanInputError where it is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError) as e:
        raise PlanInputError(f"/proc/meminfo: cannot read MemAvailable ({e})") from None
    raise PlanInputError("/proc/meminfo: no MemAvailable line")


def local_request(
    model: dict[str, int], global_batch: int, ranks: int, microbatches: int,
    bench_json: str | None = None,
) -> tuple[Request, dict[str, LinkCost | CostModel], list[str]]:  # fmt: skip
    """The planner's request for `ranks` local ranks training `model` (layers, hidden,
    heads, vocab, seq), fp32 without recomputation, any dp x tp x pp, ZeRO 0-3 or FSDP,
    every schedule, `microbatches` per step; its links; and lines saying what was
    measured. Raises PlanInputError as parse_request does."""
    cores = os.cpu_count() or 1
    b = max(1, global_batch // microbatches)  # the micro-batch of dp = 1
    rate = block_flops(model["hidden"], model["heads"], model["seq"], b)
    flops = rate * min(cores, ranks) / ranks  # the ranks share the cores
    mem = available_memory() // ranks
    copy = copy_bandwidth()
    req = parse_request({
        **model, "global_batch": global_batch, "hosts": 1, "devices_per_host": ranks,
        "memory_per_device": f"{mem}B", "intra_host": f"{copy / 2:.0f}B/s,10us",
        "inter_host": f"{copy / 2:.0f}B/s,10us", "flops": f"{flops:.0f}FLOP/s",
        "sharding": ["none", "zero1", "zero2", "zero3", "fsdp"],
        "schedules": list(SCHEDULE_NAMES), "microbatches": [microbatches],
        "recompute": ["none"], "dtype": "fp32",
    })  # fmt: skip
    c = req.cluster
    links: dict[str, LinkCost | CostModel] = {
        "intra": LinkCost(
            c.intra.latency, 1 / c.intra.bandwidth, f"copy {copy / 1e9:.1f} GB/s / 2"
        ),
        "inter": LinkCost(c.inter.latency, 1 / c.inter.bandwidth, "one host: unused"),
    }
    if bench_json:
        links["intra"] = fit_model(load_bench_json(bench_json), "shm", source=bench_json)
    said = [
        f"{ranks} ranks on {cores} cores: {flops / 1e9:.2f} GFLOP/s fp32 per rank (a block's "
        f"forward and backward on a {b} x {model['seq']} micro-batch, timed now)",
        f"memory per rank {mem / 2**30:.2f} GiB (MemAvailable / ranks)",
        f"intra-host link: {links['intra'].source}",
    ]
    return req, links, said


def choose(fits: list[Priced], accept: Callable[[Layout], Any]) -> Priced | None:
    """The fastest of `fits` (plan()'s order) that `accept` takes (falsy: refused)."""
    for p in fits:
        if accept(p.layout):
            return p
    return None
