"""Where each rank's buddy copy goes (redundancy.py's BuddyCopy): a
permutation of the ranks, rank r's state copied to rank buddies[r], which
holds that one copy besides its own.

- "ring": rank r + 1 (mod n). On one host every placement is this one: no
  placement survives the loss of the host itself.
- "hosts": every rank's buddy on another host, so that losing any one whole
  host leaves each lost shard's copy on a survivor. The hosts are listed
  largest first (ties by their lowest rank), each host's ranks in order, and
  rank r's buddy is the rank m places after it in that list, m the largest
  host's rank count (cyclically): a host's ranks lie within m consecutive
  places, so the buddy is on another host whenever no host holds more than
  half of the ranks. Where one does (or all are on one host) no permutation
  can do it, and "hosts" raises ValueError.
- "auto" (the default): "ring" on one host; across hosts the "hosts" shift,
  which where a host holds more than half of the ranks still puts the most
  buddies possible on another host (all but 2m - n of that host's ranks').

The hosts are the communicator's (Communicator.hosts, from the core's
rendezvous: the same on every rank), so every rank computes the same
placement; BuddyCopy checks at setup that the ranks agree (an all-gather of
each rank's buddy), since a rank given another `placement` would otherwise
exchange with the wrong peers.
"""

from __future__ import annotations

import torch

from pycollectives import Communicator

__all__ = ["PLACEMENTS", "buddy_ranks", "check_placement", "survives_host_loss"]

PLACEMENTS = ("auto", "hosts", "ring")


def buddy_ranks(hosts: list[int], placement: str, who: str) -> list[int]:
    """Each rank's buddy under `placement` ("auto", "hosts" or "ring") for
    ranks on `hosts` (rank r on host hosts[r]). Raises ValueError starting
    with `who` (the operation and rank) for an unknown placement, or
    "hosts" where no host-disjoint placement exists."""
    if placement not in PLACEMENTS:
        raise ValueError(f"{who}: placement={placement!r} must be one of {PLACEMENTS}")
    n = len(hosts)
    groups: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    m = max((len(g) for g in groups.values()), default=0)
    if placement == "hosts" and (len(groups) < 2 or 2 * m > n):
        counts = sorted((len(g) for g in groups.values()), reverse=True)
        raise ValueError(
            f"{who}: placement='hosts': every rank's buddy on another host needs ranks on two "
            f"hosts or more, none holding more than half of them; these {n} ranks are on "
            f"{len(groups)} host(s) holding {counts}: no placement survives the loss of the "
            "largest (placement='auto' takes the best there is)"
        )
    if placement == "ring" or len(groups) < 2:
        return [(r + 1) % n for r in range(n)]
    order = [r for g in sorted(groups.values(), key=lambda g: (-len(g), g[0])) for r in g]
    place = {r: i for i, r in enumerate(order)}
    return [order[(place[r] + m) % n] for r in range(n)]


def survives_host_loss(hosts: list[int], buddies: list[int]) -> bool:
    """Whether every rank's buddy is on another host (losing any one host
    leaves every lost rank's copy on a survivor)."""
    return len(set(hosts)) > 1 and all(hosts[b] != hosts[r] for r, b in enumerate(buddies))


def check_placement(comm: Communicator, buddies: list[int], what: str) -> None:
    """Collective over `comm`: every rank's buddy, gathered, is the one
    `buddies` (this rank's placement) gives it. Raises ValueError naming
    this rank, `what` (the operation) and the ranks that differ (they were
    given another placement)."""
    every = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(every, torch.tensor([buddies[comm.rank]], dtype=torch.int64))
    theirs = every.tolist()
    differ = [r for r, b in enumerate(theirs) if b != buddies[r]]
    if differ:
        raise ValueError(
            f"{what}: rank {comm.rank}: ranks {differ} placed their copies on "
            f"{[theirs[r] for r in differ]}, not on {[buddies[r] for r in differ]} as this "
            "rank's placement does: pass every rank the same placement="
        )
