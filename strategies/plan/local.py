"""The planner for this machine: its ranks sharing the CPU cores (strategies/plan/host.py) and
memory, the shared-memory link fitted from a `pycollectives-bench --json` run (or, without
one, half the copy bandwidth measured now: a collective through shared memory copies every
byte in and out), a core's throughput and the cost per block call fitted to a block's
forward and backward timed now at the layouts' shapes, the optimizer's step timed now, and
what a collective costs where ranks share cores (collective_costs, run on the ranks). What
`examples/train_gpt.py --plan` uses to pick its layout.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pycollectives import ReduceOp

from .costs import LinkCost, load_bench_json
from .fitted import CostModel, _solve
from .inputs import ModelSpec, Request, parse_request
from .layout import Layout, Priced
from .shm_fit import fit_shm
from .shm_model import ShmModel, agreement_text
from .units import PlanInputError

__all__ = [
    "available_memory",
    "block_flops",
    "choose",
    "copy_bandwidth",
    "cpu_flops",
    "block_call_flops",
    "block_seconds",
    "collective_costs",
    "fit_block_costs",
    "local_request",
    "measure_collective_costs",
    "optimizer_seconds_per_param",
    "tp_block",
    "usable_cores",
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


def tp_block(hidden: int, heads: int, seq: int, tp: int = 1) -> torch.nn.Module:
    """A reference-GPT block holding one of `tp` tensor-parallel ranks' share of the
    matmuls, as Megatron splits them (qkv and fc by output features, the two output
    projections by input features; the layer norms and the row-parallel biases whole):
    what a tp rank computes, on one process, without the tp collectives. Raises
    PlanInputError unless tp divides the heads."""
    from torch import nn

    from pycollectives.strategies.models.gpt import Block, GPTConfig

    if tp < 1 or heads % tp:
        raise PlanInputError(f"tp_block: tp={tp} must divide heads={heads}")
    block = Block(GPTConfig(d_model=hidden, n_head=heads, seq_len=seq, n_layer=1))
    f = block.mlp.fc.out_features
    block.attn.qkv = nn.Linear(hidden, 3 * hidden // tp)
    block.attn.proj = nn.Linear(hidden // tp, hidden)
    block.mlp.fc = nn.Linear(hidden, f // tp)
    block.mlp.proj = nn.Linear(f // tp, hidden)
    return block


def block_seconds(
    hidden: int, heads: int, seq: int, batch: int, tp: int = 1, repeats: int = 12
) -> float:
    """CPU seconds of one tp rank's share of a block's forward and backward (tp_block) on
    a (batch, seq, hidden) micro-batch with one torch thread, the least of `repeats`: the
    calling thread's CPU time (time.thread_time), which other processes taking the core
    for a while do not add to as they add to the wall time."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = tp_block(hidden, heads, seq, tp)
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            block(x).sum().backward()
            best = min(best, time.thread_time() - t0)
        return best
    finally:
        torch.set_num_threads(old)


def block_call_flops(hidden: int, heads: int, seq: int, batch: int, tp: int = 1) -> float:
    """The FLOPs the planner counts for one tp rank's block forward and backward on a
    (batch, seq) micro-batch (layout.price: 3 x (2 x parameters + 4 x hidden x seq) a
    token, over tp)."""
    params = ModelSpec(1, hidden, heads, 1, seq).block_params()
    return 3 * (2 * params + 4 * hidden * seq) * batch * seq / tp


def fit_block_costs(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds per call, FLOP/s) of t = call + flops / rate fitted to (flops, seconds)
    samples, minimizing the squared relative errors (fitted._solve); the call cost 0 where
    the samples resolve none. Raises PlanInputError without a sample."""
    if not samples or any(f <= 0 or t <= 0 for f, t in samples):
        raise PlanInputError(f"fit_block_costs: samples={samples!r} need flops > 0, seconds > 0")
    call, per_flop = _solve([(1.0, f, t) for f, t in samples])
    return call, 1.0 / per_flop


def optimizer_seconds_per_param(hidden: int, heads: int, seq: int, repeats: int = 5) -> float:
    """CPU seconds of torch's AdamW step (Trainer3D's optimizer, its default implementation)
    per parameter, on one block's parameters with gradients, one thread: the least of
    `repeats` (the calling thread's CPU time, time.thread_time)."""
    from pycollectives.strategies.models.gpt import Block, GPTConfig

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = Block(GPTConfig(d_model=hidden, n_head=heads, seq_len=seq, n_layer=1))
        params = list(block.parameters())
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()  # creates the state
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            opt.step()
            best = min(best, time.thread_time() - t0)
        return best / sum(q.numel() for q in params)
    finally:
        torch.set_num_threads(old)


def collective_costs(
    comm: Any, chunk: int = 128, iters: int = 100, nbytes: int = 4096, rounds: int = 3
) -> tuple[float, float]:
    """Collective over `comm` (the ranks of one host, all of them): what a collective costs
    where the ranks outnumber the cores. Every rank times (wall and its process's CPU)
    `iters` repetitions of a chunk of compute (a chunk x chunk matmul), then of the same
    chunk each followed by an all-reduce of `nbytes` bytes over `comm`, `rounds` times.
    Returns, the same on every rank, the medians over the rounds of: the CPU seconds a rank
    spends per collective (the ranks' added CPU / iters / ranks) and the seconds of wall
    time a collective loses beyond that CPU (the slowest rank's added wall / iters less the
    added CPU / iters over min(cores, ranks), at least 0), the cores being usable_cores().
    One torch thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(chunk, chunk), torch.randn(chunk, chunk)
        small = torch.zeros(max(1, nbytes // 4))
        a @ b
        n, cores = comm.world_size, min(usable_cores(), comm.world_size)
        per_call, lost = [], []
        for _ in range(rounds):
            walls, cpus = [], []
            for phase in ("compute", "both"):
                comm.all_reduce(small)  # start together
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    a @ b
                    if phase == "both":
                        comm.all_reduce(small)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            wall = torch.tensor(walls, dtype=torch.float64)
            cpu = torch.tensor(cpus, dtype=torch.float64)
            comm.all_reduce(wall, ReduceOp.MAX)
            comm.all_reduce(cpu, ReduceOp.SUM)
            added_cpu = max(0.0, float(cpu[1] - cpu[0]) / iters)
            per_call.append(added_cpu / n)
            lost.append(max(0.0, float(wall[1] - wall[0]) / iters - added_cpu / cores))
        return statistics.median(per_call), statistics.median(lost)
    finally:
        torch.set_num_threads(old)


def _wait_rank(rank: int, ranks: int, port: int, results: Any) -> None:
    """One rank of measure_collective_costs: joins the others, runs collective_costs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))  # fmt: skip
    import pycollectives as pc

    try:
        with pc.init(timeout=60) as comm:
            results.put((rank, collective_costs(comm)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, f"{type(e).__name__}: {e}"))


def measure_collective_costs(ranks: int, timeout: float = 120.0) -> tuple[float, float]:
    """collective_costs on `ranks` ranks of this host started for it (spawned processes).
    Raises PlanInputError naming the rank that failed, or when they do not finish within
    `timeout` seconds (killed)."""
    import multiprocessing as mp
    import queue
    import socket

    ctx = mp.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=_wait_rank, args=(r, ranks, port, results), daemon=True)
             for r in range(ranks)]  # fmt: skip
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    end = time.monotonic() + timeout
    try:
        while len(got) < ranks:
            try:
                rank, value = results.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise PlanInputError(
                    f"measure_collective_costs: {ranks - len(got)} of {ranks} ranks did not "
                    f"finish in {timeout:g} s"
                ) from None
            if isinstance(value, str):
                raise PlanInputError(f"measure_collective_costs: rank {rank} failed: {value}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(5 if len(got) == ranks else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return got[0]


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


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: taskset, a cgroup's
    cpuset), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    bench_json: str | None = None, collective: tuple[float, float] | None = None,
) -> tuple[Request, dict[str, LinkCost | CostModel | ShmModel], list[str]]:  # fmt: skip
    """The planner's request for `ranks` local ranks training `model` (layers, hidden,
    heads, vocab, seq), fp32 without recomputation, any dp x tp x pp, ZeRO 0-3 or FSDP,
    every schedule, `microbatches` per step; its links; and lines saying what was
    measured. Measured now, one thread: one tp rank's block forward and backward at every
    (micro-batch, tp) a layout of `ranks` runs, to which the compute rate of one core and a
    cost per block call are fitted (fit_block_costs), and AdamW's step per parameter; the
    cores are those this process may run on (usable_cores). `collective`: what a collective costs where the ranks
    outnumber the cores (CPU per rank, wall lost beyond it), as collective_costs measured it
    on such ranks (None: measured now on `ranks` ranks started for it,
    measure_collective_costs, where they outnumber the cores; else none).
    Raises PlanInputError as parse_request does."""
    cores = usable_cores()
    h, heads, seq = model["hidden"], model["heads"], model["seq"]
    shapes = sorted({
        (global_batch // (dp * microbatches), tp)
        for dp in range(1, ranks + 1) for tp in range(1, ranks // dp + 1)
        if ranks % (dp * tp) == 0 and heads % tp == 0 and global_batch >= dp * microbatches
    })  # fmt: skip
    # No layout splits the batch: one shape still gives the rates, and plan() says why
    # each layout is rejected.
    shapes = shapes or [(1, 1)]
    samples = [(block_call_flops(h, heads, seq, b, tp), block_seconds(h, heads, seq, b, tp))
               for b, tp in shapes]  # fmt: skip
    call, flops = fit_block_costs(samples)
    optimizer = optimizer_seconds_per_param(h, heads, seq)
    measured_here = collective is None and ranks > cores
    if measured_here:  # ranks that outnumber the cores: what their collectives lose
        collective = measure_collective_costs(ranks)
    sync_cpu, wait = collective or (0.0, 0.0)
    mem = available_memory() // ranks
    copy = copy_bandwidth()
    req = parse_request({
        **model, "global_batch": global_batch, "hosts": 1, "devices_per_host": ranks,
        "memory_per_device": f"{mem}B", "intra_host": f"{copy / 2:.0f}B/s,10us",
        "inter_host": f"{copy / 2:.0f}B/s,10us", "flops": f"{flops:.0f}FLOP/s",
        "cores_per_host": cores, "block_call": f"{call * 1e6:.4f}us",
        "optimizer_per_param": f"{optimizer * 1e9:.4f}ns",
        "collective_cpu": f"{sync_cpu * 1e6:.3f}us", "collective_wait": f"{wait * 1e6:.3f}us",
        "sharding": ["none", "zero1", "zero2", "zero3", "fsdp"],
        "schedules": list(SCHEDULE_NAMES), "microbatches": [microbatches],
        "recompute": ["none"], "dtype": "fp32",
    })  # fmt: skip
    c = req.cluster
    links: dict[str, LinkCost | CostModel | ShmModel] = {
        "intra": LinkCost(
            c.intra.latency, 1 / c.intra.bandwidth, f"copy {copy / 1e9:.1f} GB/s / 2"
        ),
        "inter": LinkCost(c.inter.latency, 1 / c.inter.bandwidth, "one host: unused"),
    }
    if bench_json:
        links["intra"] = fit_shm(load_bench_json(bench_json), None, source=bench_json)
    worst = max(abs((call + f / flops) / t - 1) for f, t in samples)
    said = [
        f"{ranks} ranks on {cores} cores: a core {flops / 1e9:.2f} GFLOP/s fp32 and "
        f"{call * 1e6:.0f} us per block call (fitted to a tp rank's block forward and "
        f"backward at {len(samples)} (micro-batch, tp) shapes "
        f"{', '.join(f'{b}x{tp}' for b, tp in shapes)}, timed now; worst fit "
        f"{worst:.0%})",
        f"AdamW's step {optimizer * 1e9:.2f} ns per parameter (timed now)",
        (
            f"a collective costs {sync_cpu * 1e6:.0f} us of CPU per rank and loses {wait * 1e6:.0f} "
            f"us of wall beyond it where the ranks share the cores (collective_costs on {ranks} "
            f"ranks, {'started for it' if measured_here else 'given'})"
            if ranks > cores
            else "as many cores as ranks: no collective costs for shared cores"
        ),
        f"memory per rank {mem / 2**30:.2f} GiB (MemAvailable / ranks)",
        f"intra-host link: {links['intra'].source}"
        + (
            f" (priced against those rows: {agreed})"
            if (agreed := agreement_text(getattr(links["intra"], "agreement", None)))
            else ""
        ),
    ]
    return req, links, said


def choose(fits: list[Priced], accept: Callable[[Layout], Any]) -> Priced | None:
    """The fastest of `fits` (plan()'s order) that `accept` takes (falsy: refused)."""
    for p in fits:
        if accept(p.layout):
            return p
    return None
