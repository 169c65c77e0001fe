"""What the ranks tell each other through the bootstrap store while they set up
a communicator, besides the segment's name: who they are (to tell a rank
that died before it attached) and the error that stopped one of them (so
every rank raises its cause at once, instead of waiting out the timeout).

What the store is trusted with (docs/api.md, "Security"): on one host, only
to deliver (whoever writes to it can make init fail, or hand the ranks the
name of another segment, which the core refuses unless this user owns it).
Across hosts it also carries, by default, the job's secret for the TCP
handshakes, from rank 0 to every rank: `take` deletes it once every rank has
read it; PYCOLL_AUTH_KEY keeps it out of the store (auth.py)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from typing import Any

from .. import errors

_CLASSES: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (
        ValueError,
        TypeError,
        KeyboardInterrupt,
        errors.CollectiveTimeout,
        errors.PeerFailure,
        errors.CollectiveMismatch,
        errors.CommunicatorAborted,
    )
}
_CHECK_EVERY_S = 0.02  # the core calls check() every ~10 ms while it waits


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """This host, as the core tells hosts apart (a digest of its host id)."""
    from .. import _C

    return hashlib.sha1(_C.host_id().encode()).hexdigest()[:16]


def identity() -> str:
    """This process as peers can tell it: pid namespace, pid, start time, host."""
    fields = _stat_fields("self") or ["?"] * 20
    return f"{_pid_namespace()}:{os.getpid()}:{fields[19]}:{_host()}"


def alive(ident: str) -> bool | None:
    """Whether the process `identity()` described runs; None where this
    process cannot tell (another pid namespace, another host: its pid means
    nothing here)."""
    ns, pid, start, host = ident.split(":")
    if not ns or ns != _pid_namespace() or host != _host():
        return None
    fields = _stat_fields(pid)
    return fields is not None and fields[19] == start and fields[0] not in ("Z", "X")


class Bootstrap:
    """One init's keys under `key` in `store`. Each rank publishes its
    identity; check() raises the error another rank published, or PeerFailure
    for a rank that died; fail() publishes this rank's error."""

    def __init__(
        self, store: Any, key: str, rank: int, world_size: int, store_server: int | None
    ) -> None:
        self._store, self._key, self.rank, self.n = store, key, rank, world_size
        self._server = store_server  # the rank whose process serves the store (pc.init's TCPStore)
        self._peers: dict[int, str] = {}  # rank -> identity, once published
        self._next_check = 0.0
        self.segment: str | None = None  # the segment's name, once known
        self.set(f"id/{rank}", identity())

    def set(self, name: str, value: str) -> None:
        self._store.set(f"{self._key}/{name}", value)

    def wait_for(self, name: str, seconds: float, what: str | None = None) -> str:
        """The value of `name` once a rank published it; checks meanwhile.
        `what` names it in the timeout's message (default: rank 0's segment name)."""
        what = what or "rank 0 did not publish the shared-memory segment's name"
        deadline = time.monotonic() + seconds
        while not self._store_call(self._store.check, [f"{self._key}/{name}"]):
            self.check()
            if time.monotonic() > deadline:
                raise errors.CollectiveTimeout(
                    f"pycollectives: rank {self.rank}: init: {what} within {seconds} s"
                )
            time.sleep(0.005)
        return self._store_call(self._store.get, f"{self._key}/{name}").decode()

    def get(self, name: str) -> str:
        """The value of `name`, which rank 0 set before a key this rank waited
        for (one round trip to the store, not wait_for's two)."""
        return self._store_call(self._store.get, f"{self._key}/{name}").decode()

    def take(self, name: str) -> str:
        """get(name), for a value that must not outlive the set-up (the job's
        secret): the last rank to read it deletes it from the store."""
        value = self.get(name)
        if self._store_call(self._store.add, f"{self._key}/{name}-read", 1) == self.n:
            self.delete(name)
        return value

    def delete(self, name: str) -> None:
        """Removes `name` from the store (or, for a store that cannot delete a
        key, overwrites its value)."""
        key = f"{self._key}/{name}"
        try:
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without delete_key (or a failed one)
            self._store_call(self._store.set, key, "")

    def check(self) -> None:
        """Raises the error a rank published, or PeerFailure naming a rank that
        died; at most every 20 ms (the core calls it more often)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _CHECK_EVERY_S
        err = f"{self._key}/error"
        if self._store_call(self._store.check, [err]):
            rank, cls, msg = self._store_call(self._store.get, err).decode().split("\n", 2)
            exc_cls = _CLASSES.get(cls, errors.PyCollectivesError)
            raise self._derived(
                exc_cls(f"{msg} [reported by rank {rank}; raised on rank {self.rank}]")
            )
        for r in range(self.n):
            if r == self.rank:
                continue
            ident = self._peers.get(r)
            if ident is None:
                key = f"{self._key}/id/{r}"
                if not self._store_call(self._store.check, [key]):
                    continue
                ident = self._peers[r] = self._store_call(self._store.get, key).decode()
            if alive(ident) is False:
                raise self._derived(
                    errors.PeerFailure(
                        f"pycollectives: rank {r} (pid {ident.split(':')[1]}) died while rank "
                        f"{self.rank} was setting up a communicator with it"
                    )
                )

    def finish(self, seconds: float) -> None:
        """This rank is connected and done with the store. The rank serving it
        waits (bounded) for every rank to be done too, so that no rank's last
        check() finds the store gone."""
        done = f"{self._key}/connected"
        self._store_call(self._store.add, done, 1)
        if self._server != self.rank:
            return
        deadline = time.monotonic() + seconds
        while self._store_call(self._store.add, done, 0) < self.n and time.monotonic() < deadline:
            self.check()  # a rank that died after connecting: its peers find out in its place
            time.sleep(0.001)

    def release(self, seconds: float) -> None:
        """For a store the caller passed: waits (bounded, checking for errors
        and dead peers) until every rank is done with it (finish), then lets
        it go. The caller may have passed it inline, keeping no reference,
        and this process may serve it: dropping it while a peer's last call
        is on its way fails that peer's init (Communicator.close calls this)."""
        done = f"{self._key}/connected"
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):
            while self._store.add(done, 0) < self.n and time.monotonic() < deadline:
                self.check()
                time.sleep(0.002)
        self._store = None

    def fail(self, exc: BaseException, wait_s: float) -> None:
        """This rank's init failed with `exc`: its segment's name goes, and its
        error is published (the first rank's wins) unless it came from a peer.
        The rank serving the store keeps it up until every peer has seen the
        published error or failed on its own (they would have waited as long
        for the store), or has died, or `wait_s` passed. A store the caller
        passed may be served by any rank: every rank waits so, for at most
        10 s."""
        if self.segment is not None:
            from .. import _C

            with contextlib.suppress(Exception):
                _C.unlink_segment(self.segment)
        with contextlib.suppress(Exception):  # the job's secret, if it is still there
            if self._store.check([f"{self._key}/authkey"]):
                self.delete("authkey")
        if not getattr(exc, "_pycoll_from_peer", False):
            value = f"{self.rank}\n{type(exc).__name__}\n{exc}"
            with contextlib.suppress(Exception):
                if self._store.compare_set(f"{self._key}/error", "", value) != value.encode():
                    self._store.add(f"{self._key}/error-seen", 1)  # another's is published
        if self._server is None:
            wait_s = min(wait_s, 10.0)
        elif self._server != self.rank:
            return
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(Exception):
            while self._store.add(f"{self._key}/error-seen", 0) < self.n - 1:
                if time.monotonic() > deadline or self._all_peers_dead():
                    break
                time.sleep(0.01)

    def _all_peers_dead(self) -> bool:
        for r in range(self.n):
            key = f"{self._key}/id/{r}"
            if r != self.rank and r not in self._peers and self._store.check([key]):
                self._peers[r] = self._store.get(key).decode()
        return len(self._peers) == self.n - 1 and all(
            alive(i) is False for i in self._peers.values()
        )

    def _derived(self, exc: BaseException) -> BaseException:
        """Marks an error that another rank caused (fail() does not republish it)
        and tells the rank serving the store that this one has seen it."""
        exc._pycoll_from_peer = True  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            self._store.add(f"{self._key}/error-seen", 1)
        return exc

    def _store_call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the store's errors vary by kind and version
            msg = f"pycollectives: rank {self.rank}: init: the bootstrap store failed: {e}"
            if self._server is None:
                raise self._derived(errors.PyCollectivesError(msg)) from e
            ident = self._peers.get(self._server)
            dead = ident is not None and alive(ident) is False
            raise self._derived(
                errors.PeerFailure(
                    f"{msg} (rank {self._server}, which serves it, "
                    f"{'died' if dead else 'may have died'})"
                )
            ) from e
