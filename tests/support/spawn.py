"""The one spawn helper of the multi-rank tests.

`run(fn, world_size, ...)` starts `world_size` fresh processes on a free port
(MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set, as torchrun does), calls
fn(rank, world_size, *args) in each, checks every exit code and kills all of
them at the timeout, so a hang fails the test instead of the run.

`RankPool` keeps one set of ranks alive with an open communicator and runs
jobs fn(comm, *args) on all of them, which saves the process start and the
torch import per test. A pool whose job failed or hung is torn down and
replaced by the fixture.

Ranks start from a fork server that imported torch once (`_CTX`): a rank
costs a fork and the test module's import instead of a fresh interpreter
importing torch (run(noop, 4) on 2 shared cores: 20 s with "spawn", 1 s).
The server also imports torch._dynamo, which torch imports when a rank
builds its first optimizer (~2 s of CPU a rank on the shared 2 cores, 800
modules, sympy among them), and pytest and pycollectives with the strategies
the tests use (~0.45 s more): importing them reads no PYCOLL_* setting (the
library reads those on first use, in the rank) and starts no thread.
Each rank takes the environment the test had when it started the rank, as a
spawned process would (not the fork server's), then `env`; the preloaded
torch read its own settings when the server started.

A rank that hangs past the timeout is reported with where it was: every
thread's Python stack (faulthandler, on STACK_SIGNAL) and, with
PYCOLL_TEST_NATIVE_STACKS=1 where gdb is installed, its native ones, in the
RankError's message.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from pycollectives import launcher

# PYCOLL_TEST_START_METHOD=spawn starts every rank as a fresh interpreter (to
# rule the fork server out when a rank misbehaves, or to time it against).
_CTX = mp.get_context(os.environ.get("PYCOLL_TEST_START_METHOD", "forkserver"))
# Modules only: pycollectives reads PYCOLL_* settings (PYCOLL_SIMD, fault
# points, PYCOLL_ALGO) on first use, which must be the rank's environment, not
# the server's; importing reads none (a module that fails to import here is
# skipped by the server, and imported by the rank as before).
PRELOAD = [
    *launcher.PRELOAD,  # torch, and torch._dynamo (torch.optim.Optimizer.__init__ imports it)
    "pytest",
    "pycollectives",
    "pycollectives.communicator",
    "pycollectives.rendezvous",
    "pycollectives.strategies.models.gpt",
    "pycollectives.strategies.data_parallel",
    "pycollectives.strategies.parallel3d",
]
if _CTX.get_start_method() == "forkserver":
    _CTX.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank dumps every thread's Python stack to its file in the run's stack folder
# on this signal: what the parent reads of a rank that hangs past the timeout.
STACK_SIGNAL = signal.SIGUSR1
_stack_file = None  # kept open for faulthandler


def _arm_stack_dump(stacks: str | None, rank: int) -> None:
    global _stack_file
    if stacks is None:
        return
    _stack_file = open(os.path.join(stacks, f"rank{rank}"), "w")  # noqa: SIM115 - kept open
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)


def _native_stacks(pids: list[int], budget: float = 30.0) -> dict[int, str]:
    """Every thread's native stack of each process (gdb, where installed, all at
    once within `budget` seconds): {pid: text}."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return {p: "(no gdb here)" for p in pids}
    cmd = [gdb, "-batch", "-nx", "-ex", "set print frame-arguments none", "-ex",
           "set print frame-info short-location", "-ex", "thread apply all bt 40", "-p"]  # fmt: skip
    procs = {p: subprocess.Popen([*cmd, str(p)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True) for p in pids}  # fmt: skip
    out, deadline = {}, time.monotonic() + budget
    for p, g in procs.items():
        try:
            text = g.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
            keep = [ln for ln in text.splitlines() if ln.startswith(("Thread ", "#"))]
            out[p] = "\n".join(keep[-300:])
        except subprocess.TimeoutExpired:
            g.kill()
            g.communicate()
            out[p] = f"(gdb took over {budget:.0f} s)"
    return out


def stacks_of(procs: list, ranks: list[int], stacks: str | None) -> str:
    """Where each of `ranks` (alive) is now: its Python stacks (faulthandler, every
    thread) and, with PYCOLL_TEST_NATIVE_STACKS=1, its native ones (gdb); "" without
    a stack folder."""
    if stacks is None:
        return ""
    live = [r for r in ranks if procs[r].exitcode is None]
    for r in live:
        with contextlib.suppress(OSError):  # gone since
            os.kill(procs[r].pid, STACK_SIGNAL)
    deadline = time.monotonic() + 2
    files = {r: os.path.join(stacks, f"rank{r}") for r in live}
    while time.monotonic() < deadline and not all(
        os.path.exists(f) and os.path.getsize(f) > 0 for f in files.values()
    ):
        time.sleep(0.05)
    time.sleep(0.1)  # the last lines
    # gdb takes 10-30 s a rank at CI's load (torch's libraries): asked for only
    native = {}
    if os.environ.get("PYCOLL_TEST_NATIVE_STACKS") == "1":
        native = _native_stacks([procs[r].pid for r in live])
    out = ""
    for r in live:
        try:
            with open(files[r]) as f:
                py = f.read().strip()
        except FileNotFoundError:  # hung before it armed the dump (in its start-up)
            py = "(no stack file: the rank hung before arming its dump)"
        py = py or "(none dumped: the rank is stopped, or never ran Python again)"
        out += f"\n--- rank {r} (pid {procs[r].pid}): Python stacks ---\n{py}"
        if native:
            out += f"\n--- rank {r}: native stacks ---\n{native[procs[r].pid]}"
    return out


def _set_env(
    rank: int, world_size: int, port: int, env: dict[str, str] | None, parent_env: dict[str, str]
) -> None:
    os.environ.clear()  # the starter's environment, not the fork server's
    os.environ.update(parent_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.update(env or {})
    # One compute thread per rank: several ranks share the 2 cores of CI.
    import torch

    torch.set_num_threads(1)


def _child(
    rank: int,
    world_size: int,
    port: int,
    env: dict | None,
    parent_env: dict,
    fn: Callable,
    args: tuple,
    results: Any,
    stacks: str | None = None,
) -> None:
    _set_env(rank, world_size, port, env, parent_env)
    _arm_stack_dump(stacks, rank)
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()  # os._exit skips the queue's flush: the traceback would be lost
        sys.stdout.flush()
        os._exit(1)
    _exit_quickly(results)


def _exit_quickly(results: Any) -> None:
    """Exits 0 after the result is sent and the atexit handlers ran (pycollectives'
    closes every open communicator), skipping the interpreter's teardown of torch's
    modules: ~0.7 s of CPU a process, for the hundreds of ranks a test session starts."""
    results.close()
    results.join_thread()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankError(AssertionError):
    """One or more ranks failed, exited badly or hung."""


def _collect(
    procs: list,
    results: Any,
    ranks: list[int],
    timeout: float,
    label: str,
    stacks: str | None = None,
) -> dict[int, Any]:
    """Waits for one report from each of `ranks`; raises RankError naming the
    ranks that raised, died without reporting, or hung past the timeout (with
    where each of those was: stacks_of)."""
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(out) + len(errors) < len(ranks):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(left, 0.2))
        except queue.Empty:
            dead = [
                r
                for r in ranks
                if r not in out and r not in errors and procs[r].exitcode is not None
            ]
            if dead:  # died without reporting: let the others report, then stop waiting
                deadline = min(deadline, time.monotonic() + 10)
            continue
        if ok:
            out[rank] = value
        else:
            errors[rank] = value
    if errors or len(out) < len(ranks):
        silent = sorted(set(ranks) - set(out) - set(errors))
        msg = f"{label}: ranks {sorted(errors)} raised"
        for r in silent:
            code = procs[r].exitcode
            msg += f"; rank {r} " + (
                "hung past the timeout" if code is None else f"exited with {code} without reporting"
            )
        hung = [r for r in silent if procs[r].exitcode is None]
        raise RankError(
            msg
            + "\n"
            + "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            + stacks_of(procs, hung, stacks)
        )
    return out


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def run(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    expect_exit: dict[int, int] | None = None,
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` fresh processes.

    Returns the ranks' return values in rank order. Ranks listed in
    `expect_exit` must exit with that code without reporting (fault tests);
    every other rank must return normally and exit 0. Raises RankError with
    every rank's traceback otherwise, or when the timeout passes.
    """
    expect_exit = expect_exit or {}
    port = free_port()
    results = _CTX.Queue()
    stacks = tempfile.mkdtemp(prefix="pycoll-stacks-")
    procs = [
        _CTX.Process(
            target=_child,
            args=(r, world_size, port, env, dict(os.environ), fn, args, results, stacks),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        live = [r for r in range(world_size) if r not in expect_exit]
        name = getattr(fn, "__name__", str(fn))
        values = _collect(procs, results, live, timeout, name, stacks)
        for p in procs:
            p.join(max(1.0, timeout / 4))
        bad = []
        for r, p in enumerate(procs):
            want = expect_exit.get(r, 0)
            if p.exitcode != want:
                bad.append(f"rank {r} exited with {p.exitcode}, expected {want}")
        if bad:
            raise RankError("; ".join(bad))
        return [values.get(r) for r in range(world_size)]
    finally:
        _stop(procs)
        shutil.rmtree(stacks, ignore_errors=True)


def _pool_worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict | None,
    parent_env: dict,
    jobs: Any,
    results: Any,
    stacks: str | None = None,
) -> None:
    _set_env(rank, world_size, port, env, parent_env)
    _arm_stack_dump(stacks, rank)
    import pycollectives as pc

    comm = pc.init(timeout=60)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(comm, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, traceback.format_exc()))
    comm.close()
    _exit_quickly(results)


class RankPool:
    """`world_size` long-lived ranks sharing one communicator."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.healthy = True
        port = free_port()
        self._results = _CTX.Queue()
        self._jobs = [_CTX.Queue() for _ in range(world_size)]
        self._stacks = tempfile.mkdtemp(prefix="pycoll-stacks-")
        env_now, stacks = dict(os.environ), self._stacks
        self._procs = [
            _CTX.Process(
                target=_pool_worker,
                args=(r, world_size, port, env, env_now, self._jobs[r], self._results, stacks),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Runs fn(comm, *args) on every rank; returns the results in rank order."""
        for q in self._jobs:
            q.put((fn, args))
        try:
            out = _collect(
                self._procs,
                self._results,
                list(range(self.world_size)),
                timeout,
                f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks",
                self._stacks,
            )
            return [out[r] for r in range(self.world_size)]
        except BaseException:
            self.healthy = False
            raise

    def close(self) -> None:
        """Stops the ranks (politely if healthy)."""
        if self.healthy:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(10)
        _stop(self._procs)
        shutil.rmtree(self._stacks, ignore_errors=True)
