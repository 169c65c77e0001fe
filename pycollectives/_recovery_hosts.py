"""Recovery across hosts (docs/recovery.md): agree() and shrink() of a
communicator whose ranks span hosts, through the job's store (a
torch.distributed Store, TCPStore across hosts).

The agreement number k (each rank counts the agreements it enters; the ranks
alive after agreement k-1 take part in k), under `<key>/agree/<k>/`:
1. a rank sets `in/<rank>` to its flag;
2. it waits until every participant entered or is known gone (the core's
   why_gone: its robust mutex on this host, its TCP connections on another;
   a rank that learns one is gone writes `gone/<p>` for the others), or the
   timeout passes, or `decided` is there;
3. it proposes: each participant's verdict (alive: entered and not gone;
   died or closed: gone; unresponsive: neither at the timeout) and the AND of
   the alive ranks' flags;
4. one compare_set of `decided`, from absent to its proposal, makes the first
   proposal the decision that every rank adopts: the store's compare-and-swap
   is the consensus object, as the segment's CAS is on one host
   (csrc/comm/recovery.cc). A rank killed at any point leaves a whole
   proposal or none.
Each agreement leaves its decision in the store (a few bytes: a rank that
comes back reads it to learn it was fenced); a rank deletes its flag of
agreement k-2 when it enters k.
A rank that finds itself not alive in the decision (stopped past the timeout,
or cut off from the other hosts while it could still reach the store) is
fenced: it raises, and so does everything it tries on this communicator. A
rank that cannot reach the store (its host cut off, or the store's host gone)
raises within the store's timeout: the survivors need the store to go on.

shrink(): an agreement on the failed ranks, then the survivors make a new
communicator with `pycollectives.init` on the same store (new shared-memory
segments per host, new TCP connections, a fresh communicator id and key)
under `<key>/shrink<k>`, then a second agreement on whether every survivor
could; a rank that failed in between makes the second differ from the
first: every survivor drops what it built and starts a round without it.

Everything read from the store is checked before use (a malformed decision
raises naming its key)."""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from . import errors

DIED, CLOSED, UNRESPONSIVE = 1, 2, 3
_MAX_FLAG = 1 << 32

# What pycollectives.rendezvous lends recovery, registered when it is imported
# (it imports this module, not the reverse: no import circle in the package):
# "init" (rendezvous.init) and "grow" (rendezvous.grow.grow, the survivors' side).
_RENDEZVOUS: dict[str, Callable[..., Any]] = {}


def rendezvous(name: str) -> Callable[..., Any]:
    """The rendezvous function `name` (init or grow), as registered."""
    fn = _RENDEZVOUS.get(name)
    if fn is None:  # every communicator comes from rendezvous.init, which registers both
        raise RuntimeError(f"pycollectives: {name}: pycollectives.rendezvous is not imported")
    return fn


class HostRecovery:
    """One communicator's agreements across hosts: its key in the store (the
    same on every rank), the store (init's, or the one agree/shrink is given),
    the agreements entered, the verdicts of the latest and why this rank was
    fenced."""

    def __init__(self, key: str, store: Any) -> None:
        self.key = key
        self.store = store
        self.number = 0
        self.verdicts: list[int] | None = None
        self.fenced: str | None = None
        self.lost = False  # a store call failed: close() then lets the store go without a word
        self._calls: queue.SimpleQueue | None = None  # _Store's thread, once started
        self._last: threading.Event | None = None  # set once the latest call is answered

    def call(self, fn: str, args: tuple, seconds: float) -> Any:
        """store.fn(*args) on this communicator's store thread, waited for at
        most `seconds`: a TCPStore call on a cut link waits for the kernel's
        retransmissions, for many minutes, and cannot be interrupted. Raises
        TimeoutError past that (the thread stays blocked: the next call
        raises at once), or what the call raised."""
        if self._last is not None and not self._last.is_set():
            # An earlier call gave up waiting and is still blocked on the thread: this one
            # would queue behind it and wait its whole bound again (a store on a cut link).
            raise TimeoutError("an earlier call is still unanswered")
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._calls,), daemon=True).start()
        box: list = []
        done = self._last = threading.Event()
        self._calls.put((getattr(self.store, fn), args, box, done))
        if not done.wait(seconds):
            raise TimeoutError(f"no answer within {seconds:.1f} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while True:
            fn, args, box, done = calls.get()
            try:
                box.append((True, fn(*args)))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()


class _Store:
    """The store's calls (each bounded by `seconds`), each raising
    PyCollectivesError naming the rank and the operation if the store fails
    (its host gone or cut off)."""

    def __init__(self, rec: HostRecovery, rank: int, what: str, seconds: float) -> None:
        self.rec, self.rank, self.what, self.seconds = rec, rank, what, seconds

    def __call__(self, name: str, *args: Any) -> Any:
        try:
            return self.rec.call(name, args, self.seconds)
        except Exception as e:  # noqa: BLE001 - the store's errors vary by kind and version
            self.rec.lost = True
            raise errors.PyCollectivesError(
                f"pycollectives: rank {self.rank}: {self.what}: the store failed ({e}): across "
                "hosts the survivors agree through it; with its host gone or cut off from "
                "this rank, this rank cannot go on (the survivors, if they reach it, do)"
            ) from e


@contextlib.contextmanager
def _store_timeout(store: Any, seconds: float) -> Any:
    """Bounds the store's waits by `seconds` meanwhile (where it can say)."""
    old = getattr(store, "timeout", None)
    try:
        store.set_timeout(datetime.timedelta(seconds=max(seconds, 1.0)))
    except Exception:  # noqa: BLE001 - a store without a timeout of its own
        old = None
    try:
        yield
    finally:
        if old is not None:
            with contextlib.suppress(Exception):
                store.set_timeout(old)


def _parse_decision(raw: bytes, n: int, rank: int, key: str) -> tuple[int, int, list[int]]:
    """(proposer, value, verdicts) of a decision read from the store, checked."""
    try:
        proposer, value, codes = raw.decode().split(";")
        p, v = int(proposer), int(value)
        verdicts = [int(c) for c in codes]
    except (UnicodeDecodeError, ValueError):
        p, v, verdicts = -1, -1, []
    if not 0 <= p < n or not 0 <= v < _MAX_FLAG or len(verdicts) != n or max(verdicts) > 3:
        raise errors.PyCollectivesError(
            f"pycollectives: rank {rank}: agree: the store's {key} holds a malformed decision "
            f"{raw[:80]!r}"
        )
    return p, v, verdicts


def _verdict_of_gone(why: str) -> int:
    return CLOSED if why.startswith("closed") else DIED


def agree(comm: Any, rec: HostRecovery, flag: int, timeout_s: float) -> tuple[int, list[int]]:
    """One fault-tolerant agreement across hosts (the module's steps 1-4);
    returns (value, verdict by rank), alike on every survivor. Raises
    CommunicatorAborted on a fenced rank, PyCollectivesError if the store
    fails."""
    core, rank, n = comm._c, comm.rank, comm.world_size
    if rec.fenced:
        raise errors.CommunicatorAborted(rec.fenced)
    rec.number += 1
    k = rec.number
    base = f"{rec.key}/agree/{k}"
    st = _Store(rec, rank, f"agree #{k}", timeout_s + 5.0)
    prev = rec.verdicts or [0] * n
    others = [p for p in range(n) if p != rank and prev[p] == 0]
    with _store_timeout(rec.store, timeout_s):
        st("set", f"{base}/in/{rank}", str(flag))
        if k > 2:  # every participant of k-1 is past k-2: its flag may go (its decision stays)
            with contextlib.suppress(Exception):  # a store without delete_key keeps it
                rec.call("delete_key", (f"{rec.key}/agree/{k - 2}/in/{rank}",), timeout_s + 5.0)
        deadline = time.monotonic() + timeout_s
        pending, gone = set(others), {}
        sleep = 0.0005
        while not st("check", [f"{base}/decided"]):
            if pending and st("check", [f"{base}/in/{p}" for p in pending]):  # 1 round trip
                pending.clear()
            for p in sorted(pending):
                why = core.why_gone(p)
                if why:
                    gone[p] = why
                    st("set", f"{base}/gone/{p}", why)
                if why or st("check", [f"{base}/in/{p}"]) or st("check", [f"{base}/gone/{p}"]):
                    pending.discard(p)
            if not pending or time.monotonic() >= deadline:
                _propose(core, st, base, rank, n, flag, prev, others, gone)
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.01)
        raw = st("get", f"{base}/decided")
    proposer, value, verdicts = _parse_decision(raw, n, rank, f"{base}/decided")
    if verdicts[rank] != 0:
        from ._recovery import VERDICTS

        why = (
            f"pycollectives: rank {rank} was fenced out of its communicator: agreement #{k} "
            f"(rank {proposer}'s proposal) declared it {VERDICTS[verdicts[rank]]} (it did not "
            "take part within the timeout, or the others lost it); its operations on this "
            "communicator raise from now on: leave the job (exit), the survivors go on without "
            "this rank"
        )
        rec.fenced = why
        core.fence(why)
        raise errors.CommunicatorAborted(why)
    rec.verdicts = verdicts
    failed = [p for p in range(n) if verdicts[p] != 0]
    if failed:
        with contextlib.suppress(Exception):  # closed: nothing left to revoke
            core.revoke(
                f"pycollectives: the communicator was revoked: agreement #{k} found ranks "
                f"{failed} failed"
            )
    return value, verdicts


def _propose(
    core: Any,
    st: _Store,
    base: str,
    rank: int,
    n: int,
    flag: int,
    prev: list[int],
    others: list[int],
    gone: dict[int, str],
) -> None:
    """Writes this rank's proposal as the decision unless one is there."""
    verdicts, value = list(prev), flag
    for p in others:
        why = gone.get(p) or core.why_gone(p)
        if not why and st("check", [f"{base}/gone/{p}"]):
            why = st("get", f"{base}/gone/{p}").decode(errors="replace")
        if why:
            verdicts[p] = _verdict_of_gone(why)
        elif st("check", [f"{base}/in/{p}"]):
            raw = st("get", f"{base}/in/{p}")
            try:
                f = int(raw.decode())
            except (UnicodeDecodeError, ValueError):
                f = -1
            if not 0 <= f < _MAX_FLAG:
                raise errors.PyCollectivesError(
                    f"pycollectives: rank {rank}: agree: the store's {base}/in/{p} holds a "
                    f"malformed flag {raw[:40]!r}"
                )
            value &= f
        else:
            verdicts[p] = UNRESPONSIVE
    proposal = f"{rank};{value};{''.join(str(v) for v in verdicts)}"
    st("compare_set", f"{base}/decided", "", proposal)


def shrink(comm: Any, rec: HostRecovery, timeout_s: float) -> tuple[Any, list[int], list[int]]:
    """The survivors' new communicator across hosts (the module's shrink);
    returns (communicator, survivors' ranks here, verdict by rank). Raises as
    agree(), and PyCollectivesError on every survivor alike if they could not
    build it."""
    init = rendezvous("init")
    rank, n = comm.rank, comm.world_size
    errs: list[str] = []
    for _ in range(n):
        _, a = agree(comm, rec, 1, timeout_s)
        survivors = [p for p in range(n) if a[p] == 0]
        prefix = f"{rec.key}/shrink{rec.number}"
        child, ok = None, 1
        try:
            child = init(survivors.index(rank), len(survivors), rec.store, timeout_s, prefix)
            child._c.set_default_timeout(comm._c.default_timeout)  # the parent's, as on one host
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - every survivor learns it in the agreement
            ok = 0
            errs.append(str(e))
        all_ok, b = agree(comm, rec, ok, timeout_s)
        same = b == a
        if same and all_ok:
            return child, survivors, b
        if child is not None:
            child.close()
        if same:
            failed = [p for p in range(n) if a[p] != 0]
            raise errors.PyCollectivesError(
                f"pycollectives: rank {rank}: shrink: with ranks {failed} failed, the survivors "
                f"could not build the new communicator: {'; '.join(errs) or 'another rank could not'}"
            )
    raise errors.PyCollectivesError(
        f"pycollectives: rank {rank}: shrink: ranks kept failing while the survivors rebuilt; "
        f"last errors: {'; '.join(errs)}"
    )
