"""Spawning local ranks for the benchmarks: run(fn, world, *args) starts
`world` fresh processes (spawn), calls fn(rank, world, port, *args) in each
with one torch thread, and returns their results in rank order; a rank that
fails or a run past `timeout` kills them all and raises RuntimeError with the
failing rank's traceback (never a hang)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from _doc import free_port

__all__ = ["run", "rss_kib", "reset_peak_rss"]


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, q: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch

    torch.set_num_threads(1)  # the ranks share the cores
    try:
        q.put((rank, True, fn(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 900.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """fn(rank, world, port, *args) on `world` fresh ranks; their results by rank.
    `env` is set in the children's environment (read at their start).
    Raises RuntimeError when a rank fails, exits or the timeout passes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, q)) for r in range(world)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, value = q.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{fn.__name__}: no result after {timeout:g} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(30 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


def rss_kib() -> dict[str, int]:
    """This process's resident set now (VmRSS) and at its peak (VmHWM), KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1])
    return out


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS (Linux: 5 into /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
