"""A replacement process joins the survivors (docs/recovery.md, "Growing back"):
the survivors call `comm.grow(store, new_ranks)`, each newcomer
`pycollectives.join(store)`, with the same store and prefix; together they
make a new communicator of the survivors (ranks 0..n-1, as in `comm`) and
the newcomers (n..n+new_ranks-1, in the order they took a place), with
pycollectives.init on the store (new segments, and across hosts new TCP
connections).

Under `<prefix>/`: the survivors' rank 0 takes the next grow number g
(`gen`, an add) and publishes `open` = "g,n,new_ranks"; each newcomer waits
for `open`, takes a place with an add of `<g>/place` (a place past new_ranks
belongs to no one: it waits for a later grow, until its timeout); then
everyone runs init under `<prefix>/<g>`. Survivors that will not grow
(the lost ranks' state is lost too) say why in `refused` (refuse()): a
newcomer waiting in join raises GrowRefused at once instead of waiting out
its timeout. What the store holds is checked before use."""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import _recovery_hosts, errors
from ..work import Timeout, to_seconds

_POLL_S = 0.005


def _seconds(timeout: Timeout) -> float:
    s = to_seconds(timeout)
    return 600.0 if s < 0 else s


def _parse_open(raw: bytes, key: str, who: str) -> tuple[int, int, int]:
    """(grow number, survivors, new ranks) of an `open` value, checked."""
    try:
        g, n, new = (int(v) for v in raw.decode().split(","))
    except (UnicodeDecodeError, ValueError):
        g = n = new = -1
    if g < 1 or n < 1 or new < 1 or n + new > 1 << 20:
        raise errors.PyCollectivesError(
            f"pycollectives: {who}: the store's {key} is malformed: {raw[:60]!r}"
        )
    return g, n, new


def grow(comm: Any, store: Any, new_ranks: int, timeout: Timeout, prefix: str) -> Any:
    """The survivors' side (Communicator.grow): returns the grown communicator."""
    init = _recovery_hosts.rendezvous("init")
    who = f"rank {comm.rank}: grow"
    if not isinstance(new_ranks, int) or isinstance(new_ranks, bool) or new_ranks < 1:
        raise ValueError(f"pycollectives: {who}: new_ranks={new_ranks!r} must be an int >= 1")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"pycollectives: {who}: prefix must be a non-empty str")
    seconds = _seconds(timeout)
    n = comm.world_size
    number = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        number.fill_(int(store.add(f"{prefix}/gen", 1)))
        store.set(f"{prefix}/open", f"{int(number.item())},{n},{new_ranks}")
    comm.broadcast(number, 0, timeout=seconds)  # every survivor: the same grow number
    g = int(number.item())
    grown = init(comm.rank, n + new_ranks, store, seconds, f"{prefix}/{g}")
    grown._c.set_default_timeout(comm._c.default_timeout)  # comm's, not the wait's bound
    grown.parent_ranks = tuple(range(n)) + (-1,) * new_ranks
    return grown


_MAX_REASON = 4096  # bytes of a refusal a newcomer reads


def refuse(
    store: Any, reason: str, *, failed: tuple[int, ...] = (), prefix: str = "pycoll-grow"
) -> None:
    """The survivors' side when they will not grow (one of them calls it):
    every newcomer waiting, or coming later, in join(store) under `prefix`
    raises GrowRefused with `reason` and the lost ranks `failed`. Raises
    what the store raises."""
    ranks = ",".join(str(int(r)) for r in failed)
    store.set(f"{prefix}/refused", f"{ranks};{reason}".encode()[:_MAX_REASON])


def _refusal(raw: bytes, prefix: str) -> errors.GrowRefused:
    """The GrowRefused of a `refused` value (checked: its ranks, ASCII digits of
    at most 9 each, else none named; the reason cut to _MAX_REASON bytes)."""
    text = bytes(raw)[:_MAX_REASON].decode(errors="replace")
    ranks, _, reason = text.partition(";")
    parts = ranks.split(",") if ranks else []
    ok = all(r.isascii() and r.isdigit() and len(r) <= 9 for r in parts)
    failed = tuple(int(r) for r in parts) if ok else ()
    return errors.GrowRefused(
        f"pycollectives: join: the survivors under {prefix!r} take in no newcomer "
        f"(store key {prefix}/refused): {reason}",
        reason,
        failed,
    )


def join(store: Any, *, timeout: Timeout = 600.0, prefix: str = "pycoll-grow") -> Any:
    """A newcomer's side: waits (bounded by `timeout`) for the survivors'
    comm.grow(store, new_ranks) with the same `prefix`, takes a place and
    returns the grown communicator, its rank n + place.

    Raises ValueError for a bad prefix, CollectiveTimeout if no grow with a
    free place opened within `timeout`, PyCollectivesError for a malformed
    store value, GrowRefused where the survivors refused (refuse()), and
    init's errors."""
    init = _recovery_hosts.rendezvous("init")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("pycollectives: join: prefix must be a non-empty str")
    seconds = _seconds(timeout)
    deadline = time.monotonic() + seconds
    full = 0  # the latest grow this newcomer found without a free place
    while True:
        if store.check([f"{prefix}/refused"]):
            raise _refusal(store.get(f"{prefix}/refused"), prefix)
        if store.check([f"{prefix}/open"]):
            raw = store.get(f"{prefix}/open")
            g, n, new = _parse_open(raw, f"{prefix}/open", "join")
            if g != full:
                place = int(store.add(f"{prefix}/{g}/place", 1))
                if place <= new:
                    left = max(deadline - time.monotonic(), 1.0)
                    grown = init(n + place - 1, n + new, store, left, f"{prefix}/{g}")
                    grown.parent_ranks = tuple(range(n)) + (-1,) * new
                    return grown
                full = g
        if time.monotonic() > deadline:
            raise errors.CollectiveTimeout(
                f"pycollectives: join: no grow with a free place opened under {prefix!r} "
                f"within {seconds} s (the survivors call comm.grow(store, new_ranks))"
            )
        time.sleep(_POLL_S)
