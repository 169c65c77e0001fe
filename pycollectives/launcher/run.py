"""The launcher side: spawn() starts the ranks of a program on this host
(from a fork server, _context), watches them, replaces or leaves behind
lost ones under `survive`, and ends the run (package docstring: the whole).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..rendezvous.bootstrap import _stat_fields
from .rank import INTERRUPTED, PLACE, REPLACES_ENV, STORE_ENV, _rank_entry, _say

# What a rank the survivors left out raises (csrc/comm/recovery.cc).
FENCED = "was fenced out of its communicator"
# What the ranks' fork server imports once (_context): torch, and torch._dynamo, which a
# process's first optimizer imports (3-5 s of CPU on a 2-core machine).
PRELOAD = ("torch", "torch._dynamo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    """The ranks' start method: a fork server that imported torch (and torch._dynamo, which
    a process's first optimizer imports) once. A rank, and a replacement above all (the
    survivors wait for it), then costs a fork and the program's own imports instead of a
    fresh interpreter importing torch (seconds on a loaded machine). Each rank takes the
    launcher's environment of when it was started (_rank_entry), not the server's; the
    preloaded torch read its own settings when the server started.
    PYCOLL_LAUNCHER_START_METHOD=spawn starts fresh interpreters instead (ValueError for
    anything else)."""
    method = os.environ.get("PYCOLL_LAUNCHER_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"pycollectives: spawn: PYCOLL_LAUNCHER_START_METHOD={method!r}: "
                         "expected forkserver or spawn")  # fmt: skip
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Stdio:
    """The launcher's stdout and stderr (fds 1 and 2) as they are when a rank starts, sent
    with the rank (multiprocessing passes the fds): a rank forked by the server would write
    where the server's went, its fds of when it started (a redirection made since, as
    pytest's capture or a notebook's, would not see the rank's lines)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        open_fds = [fd for fd in (1, 2) if _is_open(fd)]
        return _Stdio._received, (tuple(open_fds), tuple(DupFd(fd) for fd in open_fds))

    @staticmethod
    def _received(fds: tuple[int, ...], dups: tuple[Any, ...]) -> list[tuple[int, int]]:
        """In the rank: (fd, the launcher's file for it, received here) pairs."""
        return [(fd, dup.detach()) for fd, dup in zip(fds, dups, strict=True)]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _serve_store(port: int) -> Any:
    """A TCPStore served by this process on 127.0.0.1:`port` (listening
    there only, as pycollectives.init's rank 0 does), for the ranks it spawns."""
    import datetime

    import torch.distributed as dist

    from ..rendezvous import _listen

    return dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60),
                         wait_for_workers=False, master_listen_fd=_listen("127.0.0.1", port))  # fmt: skip


def _drain(conn: Any) -> tuple[int | None, str | None]:
    """What rank's `conn` holds so far: the latest place it took
    (took_place) and its failure's message (run_rank), each None if none."""
    place, failure = None, None
    try:
        while conn.poll():
            kind, value = conn.recv()
            if kind == PLACE:
                place = int(value)
            else:
                failure = str(value)
    except (EOFError, OSError, ValueError, TypeError):
        pass
    return place, failure


def _report(failure: str | None, code: int) -> str:
    """What a rank reported of its failure; for a rank killed by a signal,
    which; '' for one that exited with a status of its own choice (it said
    why itself)."""
    if failure is not None:
        return failure
    return _describe(code) if code < 0 else ""


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP or a tracer's stop: /proc's state T or t)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def _kill_stopped(procs: dict[int, Any], running: set[int], since: dict[int, float],
                  stopped: float | None, finished: float | None, prog: str,
                  name: Callable[[int], str]) -> None:  # fmt: skip
    """spawn(survive=True): SIGKILLs each running process (by slot) stopped for `stopped`
    seconds, or for `finished` seconds when the others finished (None: no such limit),
    naming it (name(slot)); `since` holds when each was first seen stopped."""
    now = time.monotonic()
    for r in sorted(running):
        if not _is_stopped(procs[r].pid):
            since.pop(r, None)
            continue
        for limit, why in ((stopped, "past the survivors' timeout"),
                           (finished, "after the others finished")):  # fmt: skip
            if limit is not None and now - since.setdefault(r, now) >= limit:
                _say(f"{prog}: {name(r)} stopped (SIGSTOP) for {now - since.pop(r):.0f} s, "
                     f"{why}: killed")  # fmt: skip
                procs[r].kill()  # its exit is a lost rank's: replaced, or left behind
                break


def spawn(target: Callable[..., int | None], nprocs: int, args: Sequence[Any] = (), *,
          prog: str, grace: float = 5.0, survive: bool = False, replace: int | None = None,
          serve_store: bool = False, stopped: float | None = None) -> int:  # fmt: skip
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
    with an error of its own (status > 0) still ends the others as above.

    `replace` (with `survive`; for programs whose survivors take in a new
    process, as ElasticTrainer3D's do): such a rank is replaced instead, at
    most `replace` times in all: a new process runs `target(*args)` with the
    lost rank's RANK and `replacing()` returning it ("rank R killed by
    SIGKILL: a new process takes its place (replacement 1 of 3)"); once it
    calls took_place(P) (ParallelDims.join does) it is rank P to the
    launcher ("rank P (a replacement started for rank R)" where they
    differ), which a later loss or failure of it names. Once they
    are used up, the next lost rank fails the run as a rank failure does,
    the message saying so. A replacement that is lost in turn is replaced
    the same way (the survivors fail, and so the run, if it was lost while
    they took it in). A rank lost once another has finished is not replaced
    (the training is over), and a replacement still running `grace` seconds
    after every other rank finished is ended (its rank was lost after the
    last step: no recovery comes for it to join); neither fails the run.
    With `survive`, a rank stopped (SIGSTOP, a debugger's stop) for `stopped`
    seconds (the time after which its survivors declare it dead and fence it
    out; None: never), or for `grace` seconds once every other rank finished,
    is killed (SIGKILL), named ("rank R stopped (SIGSTOP) for 10 s, past the
    survivors' timeout: killed"), and then counts as lost as above: replaced,
    or left behind. A stopped process never exits by itself: without this the
    survivors would wait in vain for its replacement, and the launcher for it.
    `serve_store` (implied by `replace`): this process
    serves the job's TCPStore on MASTER_PORT, which then outlives every rank;
    the ranks connect with launcher_store() (their pycollectives.init must be
    given it: on its own, rank 0 would serve one on the same port).

    Raises ValueError for `replace` < 0 or without `survive`, or for `stopped`
    not > 0."""
    if replace is not None and (replace < 0 or not survive):
        raise ValueError(f"spawn: replace={replace!r} needs survive=True and must be >= 0")
    if stopped is not None and not stopped > 0:
        raise ValueError(f"spawn: stopped={stopped!r} must be > 0 seconds (or None)")
    ctx = _context()
    port = _free_port()
    store = _serve_store(port) if serve_store or replace is not None else None
    env = {STORE_ENV: "1"} if store is not None else {}
    # Every process started, replacements included, has a slot (its index in `every`);
    # rank_of[slot] is the rank it holds: the one it was started for, or the place it took.
    every: list[Any] = []
    reports: list[Any] = []
    started_for: list[int] = []
    rank_of: list[int] = []

    def start(r: int, replaces: bool) -> None:
        recv_end, send_end = ctx.Pipe(duplex=False)
        extra = {**os.environ, **env, **({REPLACES_ENV: str(r)} if replaces else {})}
        name = f"{prog} rank {r}" + (" (replacement)" if replaces else "")
        p = ctx.Process(target=_rank_entry, args=(target, args, r, nprocs, port, prog, send_end,
                                                  extra, _Stdio()), name=name)  # fmt: skip
        p.start()
        send_end.close()
        every.append(p)
        reports.append(recv_end)
        started_for.append(r)
        rank_of.append(r)
        running.add(len(every) - 1)

    def name(slot: int) -> str:
        r, was = rank_of[slot], started_for[slot]
        return f"rank {r}" + (f" (a replacement started for rank {was})" if r != was else "")

    said: dict[int, str] = {}  # each slot's failure, as it reported it

    def hear(slot: int) -> None:
        """The slot's messages so far: the place it took, its failure's message."""
        place, failure = _drain(reports[slot])
        if place is not None:
            rank_of[slot] = place
        if failure is not None:
            said[slot] = failure

    running: set[int] = set()  # slots
    for r in range(nprocs):
        start(r, replaces=False)
    first: tuple[int, int, str] | None = None  # (slot, status, message)
    interrupted, deadline, cause = False, None, ""
    lost: set[int] = set()  # survive: slots killed by a signal, the others went on
    used = 0  # replacements started
    fresh: set[int] = set()  # slots of replacements
    finished: set[int] = set()  # slots whose process exited 0
    idle_since: float | None = None  # since when only replacements run, the others done
    stopped_at: dict[int, float] = {}  # survive: since when a running slot is stopped
    while running:
        try:
            mp.connection.wait([every[r].sentinel for r in running], timeout=0.2)
        except KeyboardInterrupt:  # the ranks got it too (one process group)
            if interrupted:  # twice: no more grace
                deadline = time.monotonic()
            interrupted = True
            if deadline is None:
                deadline, cause = time.monotonic() + grace, "Ctrl-C"
        for r in sorted(fresh & running):  # the places the replacements took meanwhile
            hear(r)
        for r in sorted(running):
            code = every[r].exitcode
            if code is None:
                continue
            running.discard(r)
            if code == 0:
                finished.add(r)
            hear(r)
            msg = _report(said.get(r), code) if code != 0 else ""
            if survive and not interrupted and deadline is None and (code < 0 or FENCED in msg):
                why = _describe(code) if code < 0 else "was fenced out (stopped past the timeout)"
                if replace is None or finished:  # finished: the training is over
                    _say(f"{prog}: {name(r)} {why}: the others "
                         f"{'finished' if finished else 'go on'}")  # fmt: skip
                    lost.add(r)
                    continue
                if used < replace:
                    used += 1
                    _say(f"{prog}: {name(r)} {why}: a new process takes its place (replacement "
                         f"{used} of {replace})")  # fmt: skip
                    start(rank_of[r], replaces=True)
                    fresh.add(len(every) - 1)
                    continue
                msg = f"{why}, and no replacement is left ({used} of {replace} used)"
                _say(f"{prog}: {name(r)} {msg}: the run ends")
            if code != 0 and first is None and not interrupted:
                first = (r, code if code > 0 else 128 - code, msg)
                deadline, cause = time.monotonic() + grace, f"{name(r)} failed"
        if survive and deadline is None:
            _kill_stopped(dict(enumerate(every)), running, stopped_at, stopped,
                          grace if finished else None, prog, name)  # fmt: skip
        # The others finished (a grid steps together: a replacement that joined
        # finished with them): a replacement still running waits for a recovery
        # that will not come (its rank was lost after the last step).
        if finished and running and running <= fresh and deadline is None:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= grace:
                for r in sorted(running):
                    _say(f"{prog}: {name(r)}'s replacement still running {grace:g} s after the "
                         "others finished (nothing left to join): ended")  # fmt: skip
                    every[r].kill()
                    every[r].join(5)
                running.clear()
        if deadline is not None and running and time.monotonic() >= deadline:
            for r in sorted(running):
                _say(f"{prog}: {name(r)} still running {grace:g} s after {cause}: killed")
                every[r].kill()
            for r in sorted(running):
                every[r].join(5)
            running.clear()
    for p in every:
        p.join()
    del store  # its server stops: every rank has ended
    if interrupted:
        return INTERRUPTED
    if first is None and len(lost) < nprocs:
        return 0
    if first is None:  # survive, and every rank was killed
        return 128 - every[min(lost)].exitcode
    slot, status, msg = first
    if msg:
        _say(f"{prog}: {name(slot)} failed first: {msg}")
    return status
