"""Collective costs fitted per path to a `pycollectives-bench --json` run on one transport.

On one host the communicator picks a path per call (docs/api.md): the one-shot areas for
small messages, then the shared slots (ring, chain or pairwise schedules) or single copy
(CMA), the latter chosen by timing both on the first calls of each size class; across
hosts it runs hierarchically. Each bench row records the paths its timed calls took
(`paths`, from comm.stats()), so the model keeps, per transport:

- per (collective, path, regime) a latency alpha and inverse bandwidth beta of the ring
  formulas (costs.ring_time), fitted to the rows that took that path; the regime is
  "cached" when the full buffer fits the cache level given (default: this CPU's L2,
  where a buffer of both the caller and the peers stays), "memory" above it, as the
  bandwidth per byte drops by several times past it;
- which path the code chose at each measured (ranks, size), so that a prediction takes
  the path of the nearest measured point of the same collective (nearest rank count,
  then nearest size on a log scale), the choice the code made there.

A (collective, path, regime) with no rows falls back to the collective's rows of that
regime, then to every row of the collective, then to every row. One whose rows resolve no
latency (only large sizes, whose intercept is lost in the noise) takes the latency of the
same path's other regime and refits its bandwidth with it: a ring over thousands of ranks
pays that latency at each of its steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .costs import COLLECTIVES, LinkCost, _terms, core_share
from .units import PlanInputError

__all__ = ["CostModel", "fit_model", "local_cache_bytes", "row_path"]


def local_cache_bytes(default: int = 1 << 20) -> int:
    """This machine's per-core L2 size (Linux sysfs), or `default` where it cannot be read."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        value = int(text.rstrip("KMGkmg")) * mult
        return value if value > 0 else default
    except (OSError, ValueError):
        return default


def _solve(pts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(alpha, beta) minimizing sum over (steps, wire, t) of ((alpha steps + beta wire)/t - 1)^2;
    bandwidth alone (alpha 0) when no positive latency can be resolved (one point, or a
    negative intercept)."""
    xs = [(s / t, w / t) for s, w, t in pts]
    sxx = sum(x * x for x, _ in xs)
    syy = sum(y * y for _, y in xs)
    sxy = sum(x * y for x, y in xs)
    sx = sum(x for x, _ in xs)
    sy = sum(y for _, y in xs)
    det = sxx * syy - sxy * sxy
    if len(xs) >= 2 and det > 1e-12 * sxx * syy:
        alpha = (sx * syy - sy * sxy) / det
        beta = (sy * sxx - sx * sxy) / det
        if alpha >= 0 and beta > 0:
            return alpha, beta
    return 0.0, sy / syy


def _solve_beta(pts: list[tuple[float, float, float]], alpha: float) -> float:
    """beta minimizing sum over (steps, wire, t) of ((alpha steps + beta wire)/t - 1)^2 for a
    given alpha (<= 0 where alpha alone overshoots the times)."""
    num = sum(w / t * (1 - alpha * s / t) for s, w, t in pts)
    den = sum((w / t) ** 2 for _, w, t in pts)
    return num / den if den else 0.0


@dataclass
class CostModel:
    """Fitted costs of one transport (see the module docstring). `time(coll, n, size)` is the
    predicted seconds; `alpha`, `beta`, `bandwidth` are those of the fit over every row (what
    a point-to-point message is priced with)."""

    transport: str
    cache_bytes: int
    overall: LinkCost
    links: dict[tuple[str, str, str], LinkCost] = field(default_factory=dict)
    choices: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        return self.overall.alpha

    @property
    def beta(self) -> float:
        return self.overall.beta

    @property
    def bandwidth(self) -> float:
        return self.overall.bandwidth

    @property
    def source(self) -> str:
        return self.overall.source

    def regime(self, size: float) -> str:
        """ "cached" when a `size`-byte buffer fits cache_bytes, else "memory"."""
        return "cached" if size <= self.cache_bytes else "memory"

    def path(self, collective: str, n: int, size: float) -> str:
        """The path the code took at the measured point of `collective` nearest to (n, size)."""
        pts = self.choices.get(collective)
        if not pts:
            return "any"
        best = min(pts, key=lambda p: (abs(p[0] - n), abs(math.log(p[1]) - math.log(size))))
        return best[2]

    def link(self, collective: str, path: str, regime: str) -> LinkCost:
        """The fitted costs of (collective, path, regime), or the nearest fallback."""
        for key in ((collective, path, regime), (collective, "any", regime), (collective, path, "any"), (collective, "any", "any")):  # fmt: skip
            if key in self.links:
                return self.links[key]
        return self.overall

    def time(self, collective: str, n: int, size: float, path: str | None = None) -> float:
        """Predicted seconds of `collective` over `n` ranks of this transport on a
        `size`-byte full buffer (all-gather: the output), by the costs fitted to `path`
        where given (the path a schedule is known to take; link()'s fallbacks where that
        path has no rows), else to the path the code took at the nearest measured point.
        Raises PlanInputError for a collective other than all_reduce, reduce_scatter,
        all_gather."""
        if n <= 1 or size <= 0:
            _terms(collective, 2, 1.0)  # names an unknown collective
            return 0.0
        steps, wire = _terms(collective, n, size)
        lk = self.link(collective, path or self.path(collective, n, size), self.regime(size))
        return steps * lk.alpha + wire * lk.beta

    def describe(self) -> list[dict[str, Any]]:
        """Every fitted (collective, path, regime): alpha (us), bandwidth (GB/s), rows."""
        return [
            {
                "collective": c,
                "path": p,
                "regime": r,
                "alpha_us": lk.alpha * 1e6,
                "bandwidth_GBps": lk.bandwidth / 1e9,
                "source": lk.source,
            }
            for (c, p, r), lk in sorted(self.links.items())
        ]


def row_path(row: dict[str, Any]) -> str:
    """The path most of a bench row's timed calls took ("any" for a row without paths)."""
    paths = row.get("paths")
    if not isinstance(paths, dict) or not paths:
        return "any"  # a run from before rows recorded their paths
    return max(paths.items(), key=lambda kv: kv[1] if isinstance(kv[1], int) else -1)[0]


def fit_model(
    rows: list[dict[str, Any]],
    transport: str = "shm",
    min_bytes: int = 64 * 1024,
    cache_bytes: int | None = None,
    source: str = "bench",
    cores: int | None = None,
) -> CostModel:
    """A CostModel of `transport` fitted to the pycoll rows (all_reduce, reduce_scatter,
    all_gather at >= min_bytes on >= 2 ranks, with a time) of a `pycollectives-bench --json`
    run (costs.load_bench_json). cache_bytes: where the "memory" regime starts (default:
    local_cache_bytes()). cores: the cores of the one machine every row's ranks ran on
    (each row's time is divided by costs.core_share(its ranks, cores): the model prices a
    core per rank, and its callers multiply the share of the machine they price back; None:
    rows taken as they are). Raises PlanInputError when no usable row remains."""
    cache = local_cache_bytes() if cache_bytes is None else cache_bytes
    if cache < 1:
        raise PlanInputError(f"fit_model: cache_bytes={cache} must be >= 1")
    groups: dict[tuple[str, str, str], list[tuple[float, float, float]]] = defaultdict(list)
    choices: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for r in rows:
        if r.get("backend", "pycoll") != "pycoll" or r["collective"] not in COLLECTIVES:
            continue
        if r["size"] < min_bytes or not r.get("time_us") or r["nranks"] < 2:
            continue
        coll, path = r["collective"], row_path(r)
        regime = "cached" if r["size"] <= cache else "memory"
        steps, wire = _terms(coll, r["nranks"], r["size"])
        pt = (steps, wire, r["time_us"] * 1e-6 / core_share(r["nranks"], cores))
        for key in ((coll, path, regime), (coll, "any", regime), (coll, path, "any"), (coll, "any", "any"), ("any", "any", "any")):  # fmt: skip
            if key not in groups or pt not in groups[key]:
                groups[key].append(pt)
        choices[coll].append((r["nranks"], r["size"], path))
    if not groups:
        raise PlanInputError(
            f"fit_model: no usable rows (pycoll all_reduce/reduce_scatter/all_gather of "
            f">= {min_bytes} bytes on >= 2 ranks); run pycollectives-bench with -e 16M or more"
        )
    links = {}
    for key, pts in groups.items():
        alpha, beta = _solve(pts)
        links[key] = LinkCost(alpha, beta, f"{source}: {'/'.join(key)}, {len(pts)} rows")
    for (coll, path, regime), lk in list(links.items()):
        # A regime whose rows resolve no latency (large sizes only: the intercept is lost in
        # their noise) takes the per-step latency of the same path's other rows: a flat ring
        # over thousands of ranks pays it at every one of its steps, whatever the size.
        if lk.alpha > 0 or regime == "any":
            continue
        for other in ("cached" if regime == "memory" else "memory", "any"):
            if (sib := links.get((coll, path, other))) is not None and sib.alpha > 0:
                beta = _solve_beta(groups[(coll, path, regime)], sib.alpha)
                if beta > 0:
                    links[(coll, path, regime)] = LinkCost(
                        sib.alpha, beta, f"{lk.source}, latency of the {other} rows"
                    )
                break
    overall = links.pop(("any", "any", "any"))
    overall = LinkCost(overall.alpha, overall.beta, f"{source}: {transport}, per path and regime")
    return CostModel(transport, cache, overall, links, dict(choices))
