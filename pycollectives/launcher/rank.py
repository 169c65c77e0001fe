"""The rank side of the launcher: what runs in each process spawn() starts
(or any rank a user's launcher starts: run_rank), and what such a rank asks
of the launcher (launcher_store, replacing, took_place).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._base import _close_all_at_exit, abort_all_interrupted

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
STORE_ENV = "PYCOLL_LAUNCHER_STORE"  # "1": spawn() serves the store on MASTER_PORT
REPLACES_ENV = "PYCOLL_REPLACES"  # the rank a replacement process replaces
PLACE = "place"  # a rank's message to the launcher: (PLACE, the rank whose place it took)
_report_to: Any = None  # in a rank spawn() started: its Connection to the launcher


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
    ValueError or TimeoutError exception it says "<prog>: rank R: <error>" (R:
    RANK, or the place a replacement took: took_place()) and
    exits with status 1 (130 if the error is a peer's interrupt). Other
    exceptions propagate with their traceback. `report`, a multiprocessing
    Connection, receives (status, message) of a failure."""
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
    _say(f"{prog}: rank {os.environ.get('RANK', '?')}: {what}")  # took_place() may change it
    if report is not None:
        with contextlib.suppress(OSError):
            report.send((status, what))
    _exit_now(status)
    return status  # not reached


def _rank_entry(target: Callable[..., int | None], args: Sequence[Any], rank: int, world: int,
                port: int, prog: str, report: Any, env: dict[str, str],
                stdio: list[tuple[int, int]]) -> None:  # fmt: skip
    for fd, got in stdio:  # the launcher's stdout and stderr of when it started this rank
        if got != fd:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(got, fd)
            os.close(got)
    os.environ.clear()  # the launcher's environment (env), not the fork server's
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    global _report_to
    _report_to = report  # took_place() tells the launcher through it
    sys.exit(run_rank(lambda: target(*args), prog, report))


def launcher_store(timeout: float) -> Any | None:
    """In a rank that spawn(serve_store=True) or spawn(replace=N) started: a
    client of the store the launcher serves (MASTER_ADDR:MASTER_PORT; its
    operations wait up to `timeout` seconds), which outlives every rank: pass
    it to pycollectives.init(rank, world_size, store=...) and to what grows
    the job (Communicator.grow, pycollectives.join). None where the launcher
    serves no store. Raises ValueError for a malformed environment."""
    flag = os.environ.get(STORE_ENV)
    if flag is None:
        return None
    port = os.environ.get("MASTER_PORT", "")
    if flag != "1" or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pycollectives: launcher_store: {STORE_ENV}={flag!r}, "
                         f"MASTER_PORT={port!r}: expected 1 and a port")  # fmt: skip
    import datetime

    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    wait = datetime.timedelta(seconds=min(max(timeout, 1.0), 365 * 86400.0))
    return dist.TCPStore(addr, int(port), None, False, wait)


def replacing() -> int | None:
    """In a process that spawn(replace=N) started in a lost rank's place: that
    rank (the place it asks for; with several lost at once the first to join
    takes the lowest). None in a rank started at the beginning. Raises
    ValueError for a malformed environment."""
    value = os.environ.get(REPLACES_ENV)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"pycollectives: replacing: {REPLACES_ENV}={value!r} is not a rank")
    return int(value)


def took_place(rank: int) -> None:
    """In a replacement that spawn(replace=N) started: this process took
    world rank `rank`'s place (with several ranks lost at once, the first
    newcomer to join takes the lowest, whichever it was started for).
    From then on the launcher names it by `rank` (its loss, its failure,
    its replacement) and so does run_rank (RANK is set to it). Does nothing
    in any other process. Raises ValueError for a rank that is not an int
    >= 0."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"pycollectives: took_place: rank={rank!r} must be an int >= 0")
    if replacing() is None or _report_to is None:
        return
    os.environ["RANK"] = str(rank)
    with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
        _report_to.send((PLACE, rank))
