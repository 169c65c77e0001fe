"""The cost of a collective: latency alpha (s per step) and inverse bandwidth beta (s per
byte) per transport, and the algorithms' step counts (S = the full buffer's bytes, N ranks):

    ring all-reduce            2(N-1) alpha + 2(N-1)/N S beta
    reduce-scatter, all-gather (N-1) alpha  + (N-1)/N S beta

Across hosts the communicator runs hierarchically (its stats() path "hierarchical"):
within each host, then across hosts by the hosts' ranks in parallel, then within each host
again; `hierarchical_time` prices that, `ring_time` a flat ring over every rank.

On one host the code picks the one-shot areas for small messages, single copy (CMA) or the
shared slots for large ones (docs/api.md); `fit` does not model those paths separately: it
fits the alpha and beta of the ring formulas to what `pycollectives-bench --json` measured,
so they are the effective latency and bandwidth of whatever ran at those sizes.

The transports of a host copy with its CPU cores (the slots, single copy, the kernel's TCP
stack): where a machine runs more ranks than it has cores, the ranks time-share them and a
collective takes about `core_share(ranks, cores)` times as long as on a core each. The fits
divide that factor out of their rows and the callers that know how many ranks share a
machine's cores multiply it back (on a cluster with a core or more per rank it is 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .units import PlanInputError

__all__ = [
    "COLLECTIVES",
    "INTRA_PATH",
    "LinkCost",
    "across_hosts_time",
    "core_share",
    "fit",
    "hierarchical_time",
    "load_bench_json",
    "ring_time",
    "ring_vs_hierarchical",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class LinkCost:
    """A transport's latency per step (s) and seconds per byte, and where they came from."""

    alpha: float
    beta: float
    source: str

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta if self.beta else math.inf


def core_share(ranks: int, cores: int | None) -> float:
    """How many times slower a CPU-bound transfer runs when `ranks` busy ranks time-share
    `cores` cores than with a core each: max(1, ranks / cores); 1 where cores is None
    (unknown: no sharing modelled). Raises PlanInputError for cores < 1 or ranks < 0."""
    if cores is None:
        return 1.0
    if cores < 1 or ranks < 0:
        raise PlanInputError(f"core_share: ranks={ranks}, cores={cores}: need cores >= 1")
    return max(1.0, ranks / cores)


def _terms(collective: str, n: int, size: float) -> tuple[float, float]:
    """(steps, bytes per rank on the wire) of the ring algorithm."""
    if collective == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * size
    if collective in ("reduce_scatter", "all_gather"):
        return n - 1, (n - 1) / n * size
    raise PlanInputError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")


def ring_time(
    collective: str, n: int, size: float, link: LinkCost, path: str | None = None
) -> float:
    """Seconds of a ring `collective` over `n` ranks of a `size`-byte (full) buffer; `link`
    may also be a fitted.CostModel, whose per-path costs then price it: those of `path`
    where given (the path a schedule is known to take), else of the path the code chose at
    the nearest measured point."""
    if hasattr(link, "time"):
        return link.time(collective, n, size, path)
    if n <= 1 or size <= 0:
        return 0.0
    steps, wire = _terms(collective, n, size)
    return steps * link.alpha + wire * link.beta


# The path of the hierarchical schedules' steps within a host: rings over the shared slots
# (csrc/algo/hierarchical.cc), whatever a one-host collective of that size would take.
INTRA_PATH = "slots"


def hierarchical_time(
    collective: str, n: int, per_host: int, size: float, intra: LinkCost, inter: LinkCost
) -> float:
    """Seconds of `collective` over `n` ranks, `per_host` on each host, as the communicator
    runs it across hosts (csrc/algo/hierarchical.cc): an all-reduce is a reduce-scatter
    within each host, an all-reduce across hosts of each rank's 1/per_host (the hosts' ranks
    in parallel, one rail per local rank) and an all-gather within each host; a
    reduce-scatter is its within-host half then its across-host half, an all-gather the
    reverse. The within-host steps are rings over the shared slots (INTRA_PATH) of the
    whole buffer. One host: the ring on `intra`, by the path the code chose there."""
    if n % per_host:
        raise PlanInputError(f"hierarchical_time: n={n} is not a multiple of per_host={per_host}")
    hosts = n // per_host
    if hosts == 1:
        return ring_time(collective, n, size, intra)
    rs = ring_time("reduce_scatter", per_host, size, intra, INTRA_PATH)
    ag = ring_time("all_gather", per_host, size, intra, INTRA_PATH)
    across = ring_time(collective, hosts, size / per_host, inter)
    if collective == "all_reduce":
        return rs + across + ag
    return (rs if collective == "reduce_scatter" else ag) + across


def across_hosts_time(
    collective: str,
    ranks_per_host: Sequence[int],
    size: float,
    intra: LinkCost,
    inter: LinkCost,
    algo: str = "auto",
) -> tuple[float, str]:
    """Seconds of `collective` on a `size`-byte buffer over hosts holding ranks_per_host[h]
    ranks each, as the communicator runs it, and which algorithm that is. The code's rule
    (csrc/algo/hierarchical.cc): on one host, its own choice ("one host", the ring formulas
    on `intra`); across hosts, "hierarchical" where every host has as many ranks and
    PYCOLL_ALGO (`algo`) is not "ring", else "flat": one ring over every rank, host by host,
    whose steps the inter-host link paces. Raises PlanInputError for an empty host list or
    a host without ranks."""
    counts = list(ranks_per_host)
    if not counts or min(counts) < 1:
        raise PlanInputError(f"across_hosts_time: ranks_per_host={counts} needs >= 1 rank per host")
    n = sum(counts)
    if len(counts) == 1:
        return ring_time(collective, n, size, intra), "one host"
    if algo == "ring" or len(set(counts)) > 1:
        return ring_time(collective, n, size, inter), "flat"
    return hierarchical_time(collective, n, counts[0], size, intra, inter), "hierarchical"


def load_bench_json(path: str) -> list[dict[str, Any]]:
    """The rows of a `pycollectives-bench --json` file: dicts with backend, collective,
    nranks, size (full buffer bytes) and time_us. Raises PlanInputError naming the file
    for anything that is not such a file (it is read as untrusted input)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanInputError(f"bench json {path}: cannot be read as JSON ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise PlanInputError(
            f"bench json {path}: no 'rows' list (write it with pycollectives-bench --json)"
        )
    out = []
    for i, r in enumerate(rows):
        ok = isinstance(r, dict) and isinstance(r.get("collective"), str)
        ok = ok and isinstance(r.get("nranks"), int) and isinstance(r.get("size"), int)
        t = r.get("time_us") if isinstance(r, dict) else None
        if not ok or not (t is None or isinstance(t, int | float)):
            raise PlanInputError(f"bench json {path}: row {i} is not a bench row: {str(r)[:120]}")
        out.append(r)
    return out


def fit(rows: list[dict[str, Any]], min_bytes: int = 64 * 1024, source: str = "bench") -> LinkCost:
    """alpha and beta of the ring formulas fitted to the rows (all_reduce, reduce_scatter,
    all_gather of the pycoll backend at >= min_bytes with a time), minimizing the sum of
    squared relative errors. Raises PlanInputError when fewer than two usable rows remain."""
    pts = []
    for r in rows:
        if r.get("backend", "pycoll") != "pycoll" or r["collective"] not in COLLECTIVES:
            continue
        if r["size"] < min_bytes or not r.get("time_us") or r["nranks"] < 2:
            continue
        steps, wire = _terms(r["collective"], r["nranks"], r["size"])
        t = r["time_us"] * 1e-6
        pts.append((steps / t, wire / t))
    if len(pts) < 2:
        raise PlanInputError(
            f"fit: {len(pts)} usable rows (pycoll all_reduce/reduce_scatter/all_gather of "
            f">= {min_bytes} bytes on >= 2 ranks); run pycollectives-bench with -e 16M or more"
        )
    # Minimize sum (a x + b y - 1)^2: the normal equations of a 2 x 2 system.
    sxx = sum(x * x for x, _ in pts)
    syy = sum(y * y for _, y in pts)
    sxy = sum(x * y for x, y in pts)
    sx = sum(x for x, _ in pts)
    sy = sum(y for _, y in pts)
    det = sxx * syy - sxy * sxy
    alpha = (sx * syy - sy * sxy) / det if det else -1.0
    beta = (sy * sxx - sx * sxy) / det if det else 0.0
    if alpha < 0 or beta <= 0:  # no latency resolvable: bandwidth alone
        alpha, beta = 0.0, sy / syy
    return LinkCost(alpha, beta, f"{source}: fitted to {len(pts)} rows >= {min_bytes} B")


def ring_vs_hierarchical(
    collective: str,
    size: float,
    per_host: int,
    intra: LinkCost,
    inter: LinkCost,
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
) -> list[dict[str, Any]]:
    """Per rank count (a multiple of per_host), the seconds of a flat ring over every rank
    (its slowest link: inter-host as soon as it spans hosts; PYCOLL_ALGO=ring) and of the
    hierarchical algorithm, which is faster, and what the communicator runs by default
    (across_hosts_time: "hierarchical" across hosts, every host holding per_host ranks)."""
    out = []
    for n in ranks:
        if n % per_host:
            raise PlanInputError(
                f"ring_vs_hierarchical: {n} ranks not a multiple of per_host={per_host}"
            )
        hosts = [per_host] * (n // per_host)
        ring = across_hosts_time(collective, hosts, size, intra, inter, "ring")[0]
        hier = hierarchical_time(collective, n, per_host, size, intra, inter)
        runs = across_hosts_time(collective, hosts, size, intra, inter)[1]
        out.append(
            {
                "ranks": n,
                "ring_s": ring,
                "hierarchical_s": hier,
                "faster": "ring" if ring < hier else "hierarchical",
                "runs": runs,
            }
        )
    return out
