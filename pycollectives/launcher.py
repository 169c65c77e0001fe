"""Runs the ranks of a program on this host, as the examples do when they are
not started by torchrun, and ends a rank's run the way a user expects.

`run_rank(main, prog)` runs one rank: Ctrl-C prints one line and exits 130
(its communicators aborted, so the peers say that this rank was interrupted);
a pycollectives or strategies error prints one line naming the rank and
exits 1. `spawn(target, n, prog=...)` starts n ranks as spawned processes (as
`torchrun --nproc-per-node n` does) and, once a rank has failed, ends the
others after a grace period, so that a stopped or hung rank cannot hold the
launcher; it returns the first failure's exit status and prints its message.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ._base import _close_all_at_exit, abort_all_interrupted

__all__ = ["run_rank", "spawn"]

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
# What a rank the survivors left out raises (csrc/comm/recovery.cc).
FENCED = "was fenced out of its communicator"


def _say(line: str) -> None:
    """One whole line on stderr at once (the ranks share the terminal)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _ours(e: BaseException) -> bool:
    """Whether `e` is an error pycollectives or its strategies raise to a user
    (said in one line), rather than a bug (kept with its traceback)."""
    return isinstance(e, ValueError | TimeoutError) or type(e).__module__.startswith(
        "pycollectives"
    )


def _exit_now(status: int) -> None:
    """Ends the process at once after a failure: output flushed, communicators
    closed (their peers learn why), no interpreter teardown (seconds with torch
    on a loaded machine, while a launcher waits)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with warnings.catch_warnings():  # the pending operations' errors: said already
        warnings.simplefilter("ignore")
        _close_all_at_exit()
    os._exit(status)


def run_rank(main: Callable[[], int | None], prog: str, report: Any = None) -> int:
    """Runs one rank's `main()`. Returns what `main` returns (0 for None).
    After Ctrl-C it says "<prog>: rank R: interrupted" and exits with status
    130, every communicator of the process aborted first (the peers raise
    "rank R was interrupted (SIGINT)"); after a pycollectives, strategies,
    ValueError or TimeoutError exception it says "<prog>: rank R: <error>" and
    exits with status 1 (130 if the error is a peer's interrupt). Other
    exceptions propagate with their traceback. `report`, a multiprocessing
    Connection, receives (status, message) of a failure."""
    rank = os.environ.get("RANK", "?")
    stopping = False

    def on_sigint(signum: int, frame: Any) -> None:
        if not stopping:  # once failing, a Ctrl-C (or the peers') changes nothing
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            code = main()
            return 0 if code is None else int(code)
        except BaseException as e:
            stopping = True
            error = e
    except KeyboardInterrupt as e:  # between the error and `stopping` (rare)
        stopping, error = True, e
    if isinstance(error, KeyboardInterrupt):
        abort_all_interrupted()
        what, status = "interrupted", INTERRUPTED
    elif isinstance(error, Exception) and _ours(error):
        # A peer's Ctrl-C reached this rank as an abort before its own did.
        if " was interrupted (" in str(error):  # (SIGINT), or (signal) in a wait
            what, status = f"interrupted: {error}", INTERRUPTED
        else:
            what, status = f"{type(error).__name__}: {error}", 1
    else:
        raise error
    _say(f"{prog}: rank {rank}: {what}")
    if report is not None:
        with contextlib.suppress(OSError):
            report.send((status, what))
    _exit_now(status)
    return status  # not reached


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target: Callable[..., int | None], args: Sequence[Any], rank: int, world: int,
                port: int, prog: str, report: Any) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    sys.exit(run_rank(lambda: target(*args), prog, report))


def _report(conn: Any, code: int) -> str:
    """What rank's `conn` reported of its failure; for a rank killed by a
    signal, which; '' for one that exited with a status of its own choice
    (it said why itself)."""
    try:
        if conn.poll():
            return conn.recv()[1]
    except (EOFError, OSError):
        pass
    return _describe(code) if code < 0 else ""


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def spawn(target: Callable[..., int | None], nprocs: int, args: Sequence[Any] = (), *,
          prog: str, grace: float = 5.0, survive: bool = False) -> int:  # fmt: skip
    """Runs `target(*args)` in `nprocs` spawned processes with RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, each under
    run_rank, and returns the exit status for the launcher: 0 when every rank
    succeeded, 130 after Ctrl-C, else the first failed rank's status (128 + the
    signal for a rank killed by one), after printing "<prog>: rank R failed
    first: <its message>". Once a rank has failed or Ctrl-C came, the ranks
    still running after `grace` seconds are killed (SIGKILL: it ends stopped
    ones too), each named.

    `survive` (for programs that recover from a lost rank, as
    ElasticDataParallel does): a rank killed by a signal, or one that failed
    because the survivors fenced it out (it was stopped past the timeout), is
    named ("rank R killed by SIGKILL: the others go on") and the others are
    left running;
    the status is then 0 when the ranks left all succeeded. A rank that fails
    with an error of its own (status > 0) still ends the others as above."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, reports = [], []
    for r in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_entry, args=(target, args, r, nprocs, port, prog, send_end),
                        name=f"{prog} rank {r}")  # fmt: skip
        p.start()
        send_end.close()
        procs.append(p)
        reports.append(recv_end)
    first: tuple[int, int, str] | None = None  # (rank, status, message)
    interrupted, deadline, cause = False, None, ""
    running = set(range(nprocs))
    lost: set[int] = set()  # survive: ranks killed by a signal, the others went on
    while running:
        try:
            mp.connection.wait([procs[r].sentinel for r in running], timeout=0.2)
        except KeyboardInterrupt:  # the ranks got it too (one process group)
            if interrupted:  # twice: no more grace
                deadline = time.monotonic()
            interrupted = True
            if deadline is None:
                deadline, cause = time.monotonic() + grace, "Ctrl-C"
        for r in sorted(running):
            code = procs[r].exitcode
            if code is None:
                continue
            running.discard(r)
            msg = _report(reports[r], code) if code != 0 else ""
            if survive and not interrupted and deadline is None and (code < 0 or FENCED in msg):
                why = _describe(code) if code < 0 else "was fenced out (stopped past the timeout)"
                _say(f"{prog}: rank {r} {why}: the others go on")
                lost.add(r)
                continue
            if code != 0 and first is None and not interrupted:
                first = (r, code if code > 0 else 128 - code, msg)
                deadline, cause = time.monotonic() + grace, f"rank {r} failed"
        if deadline is not None and running and time.monotonic() >= deadline:
            for r in sorted(running):
                _say(f"{prog}: rank {r} still running {grace:g} s after {cause}: killed")
                procs[r].kill()
            for r in sorted(running):
                procs[r].join(5)
            running.clear()
    for p in procs:
        p.join()
    if interrupted:
        return INTERRUPTED
    if first is None and len(lost) < nprocs:
        return 0
    if first is None:  # survive, and every rank was killed
        rank = min(lost)
        return 128 - procs[rank].exitcode
    rank, status, msg = first
    if msg:
        _say(f"{prog}: rank {rank} failed first: {msg}")
    return status
