"""Fitting the shared-memory cost model (shm_model.ShmModel) to measured bench rows.

Each row (collective, ranks, size, time, the paths its calls took) is priced by the path
it took. The cores' constants (alpha and the three per-byte costs) are linear in the rows
within the cache for a given contention, which is searched; the memory's cost per byte of
traffic comes from the rows past the cache; the share of the cache the ranks' buffers get
is the one of 1, 1/2, 1/4 whose fit leaves the least error over all rows; the busiest
core's weight from the rows it alone moves (rank counts past the cores, not a multiple);
whether single copy is priced past the cores from the path the rows' tuners took there.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .fitted import row_path
from .shm_model import (
    COLLECTIVES,
    KIB,
    PATHS,
    ShmModel,
    Work,
    agreement,
    code_paths,
    last_level_cache_bytes,
    share,
    traffic,
    work,
)
from .units import PlanInputError

__all__ = ["cma_past_cores", "fit_busiest", "fit_shm", "lstsq_nonneg", "solve_linear"]

CACHE_SHARES = (1.0, 0.5, 0.25)  # fit_shm's candidates, the largest first (kept on a tie)
Point = tuple[str, int, float, Work, str, float]  # collective, ranks, size, work, path, seconds


def lstsq_nonneg(a: list[list[float]], b: list[float]) -> list[float]:
    """x >= 0 minimizing |a x - b|^2 (active set: a negative coefficient leaves and the
    rest are solved again); a column of zeros gets 0."""
    k = len(a[0])
    active = [j for j in range(k) if any(row[j] for row in a)]
    while active:
        m = [[sum(r[i] * r[j] for r in a) for j in active] for i in active]
        v = [sum(r[i] * y for r, y in zip(a, b, strict=True)) for i in active]
        sol = solve_linear(m, v)
        if sol is not None and min(sol) >= 0:
            x = [0.0] * k
            for j, s in zip(active, sol, strict=True):
                x[j] = s
            return x
        worst = active[min(range(len(active)), key=lambda i: sol[i] if sol else 0.0)]
        active.remove(worst)
    return [0.0] * k


def solve_linear(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(v)
    aug = [row[:] + [y] for row, y in zip(m, v, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(aug[r][c]))
        if abs(aug[p][c]) < 1e-300:
            return None
        aug[c], aug[p] = aug[p], aug[c]
        for r in range(n):
            if r != c:
                f = aug[r][c] / aug[c][c]
                aug[r] = [x - f * y for x, y in zip(aug[r], aug[c], strict=True)]
    return [aug[i][n] / aug[i][i] for i in range(n)]


def _usable(r: dict[str, Any], min_bytes: int) -> bool:
    """A pycoll all_reduce, reduce_scatter or all_gather row of >= min_bytes on >= 2 ranks."""
    return (
        r.get("backend", "pycoll") == "pycoll"
        and r.get("collective") in COLLECTIVES
        and r["size"] >= min_bytes
        and r["nranks"] >= 2
    )


def _points(rows: list[dict[str, Any]], min_bytes: int) -> list[Point]:
    """The usable rows (_usable, with a time), each with the work of the path it took."""
    pts = []
    for r in rows:
        if not _usable(r, min_bytes) or not r.get("time_us"):
            continue
        coll, n, size, path = r["collective"], r["nranks"], r["size"], row_path(r)
        if path not in PATHS:  # a row without paths: the path the code takes outside the bands
            path = code_paths(coll, n, size)[-1]
        pts.append((coll, n, size, work(coll, path, n, size), path, r["time_us"] * 1e-6))
    return pts


def _fit_at(pts: list[Point], cores: int | None, cache: int, cache_share: float,
            source: str, least_inside: int = 4) -> ShmModel | None:  # fmt: skip
    """The model fitted to `pts` with the memory regime past cache_share x cache: the
    cores' constants from the rows within it, the memory's from those past it; None where
    fewer than `least_inside` rows are within (four: the cores' constants)."""
    probe = ShmModel(0, 0, 0, 0, 0, 0, cores, cache, cache_share=cache_share)
    inside = [p for p in pts if not probe.past_cache(p[0], p[1], p[2])]
    past = [p for p in pts if probe.past_cache(p[0], p[1], p[2])]
    if len(inside) < least_inside:
        return None
    best: tuple[float, float, list[float]] = (math.inf, 0.0, [0.0] * 4)
    for i in range(41):  # contention 0, then 1/16 .. 16 log-spaced
        cont = 0.0 if i == 0 else 16 ** ((i - 20) / 20)
        a = [
            [share(n, cores, cont) / t * x for x in (w.handoffs, w.copy, w.reduce, w.kernel)]
            for _, n, _, w, _, t in inside
        ]
        if not a:
            break
        x = lstsq_nonneg(a, [1.0] * len(a))
        err = sum((sum(ai * xi for ai, xi in zip(r, x, strict=True)) - 1) ** 2 for r in a)
        if err < best[0] - 1e-12:
            best = (err, cont, x)
    # The memory's cost per byte of traffic: t = n traffic p, least relative squares.
    xs = [n * traffic(w) / t for _, n, _, w, _, t in past]
    per_traffic = sum(xs) / sum(x * x for x in xs) if xs else 0.0
    _, cont, (alpha, pc, pr, pk) = best
    # A cost the rows leave unresolved (no rows of it, or noise): a copy's, never free.
    pr, pk = pr or pc, pk or pc
    what = f"{source}: shm, per algorithm, {len(pts)} rows"
    return ShmModel(alpha, pc, pr, pk, cont, per_traffic, cores, cache, what, len(pts),
                    cache_share=cache_share)  # fmt: skip


def _error(model: ShmModel, pts: list[Point]) -> float:
    """Sum of squared relative errors of `model` on `pts`, each by the path it took."""
    return sum((model.path_time(c, p, n, s) / t - 1) ** 2 for c, n, s, _, p, t in pts)


def fit_shm(
    rows: list[dict[str, Any]],
    cores: int | None,
    cache_bytes: int | None = None,
    min_bytes: int = 64 * KIB,
    source: str = "fit",
) -> ShmModel:
    """A ShmModel fitted to bench rows (collective, nranks, size, time_us, paths: each row
    priced by the path its calls took, fitted.row_path) of all_reduce, reduce_scatter,
    all_gather at >= min_bytes on >= 2 ranks, minimizing squared relative errors (the
    module docstring): per share of the cache in CACHE_SHARES the cores' and the memory's
    constants, and the share whose model errs least on all rows; then the busiest core's
    weight from the rows at rank counts past the cores and not a multiple of them
    (fit_busiest), which the other constants are fitted without where the rest suffice.
    cores: the machine's (None: no sharing). cache_bytes: its last-level cache (default:
    this machine's). The model's `agreement` says how it prices every usable row, each by
    the path it took (in-sample: a floor on its error elsewhere). Raises PlanInputError
    with fewer than two usable rows."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    pts = every = _points(rows, min_bytes)
    # Rank counts past the cores and not a multiple of them are fit_busiest's (share()'s
    # weight of the busiest core moves them alone), where the other rows suffice.
    even = [p for p in pts if not (cores and p[1] > cores and p[1] % cores)]
    if len(even) >= 2:
        pts = even
    if len(pts) < 2:
        raise PlanInputError(
            f"fit_shm: {len(pts)} usable rows (pycoll all_reduce/reduce_scatter/"
            f"all_gather of >= {min_bytes} bytes on >= 2 ranks)"
        )
    fits = [_fit_at(pts, cores, cache, CACHE_SHARES[0], source, least_inside=0)]
    fits += [m for s in CACHE_SHARES[1:] if (m := _fit_at(pts, cores, cache, s, source))]
    model = min(fits, key=lambda m: _error(m, pts))  # the first of equals: the largest share
    model = fit_busiest(model, rows, min_bytes)
    model = replace(model, cma_past_cores=cma_past_cores(rows, cores, min_bytes))
    priced = [(_label(c, n, s), model.path_time(c, p, n, s) / t) for c, n, s, _, p, t in every]
    return replace(model, agreement=agreement(priced))


def cma_past_cores(
    rows: list[dict[str, Any]], cores: int | None, min_bytes: int = 64 * KIB
) -> bool:
    """Whether the rows' tuners took single copy in at least half of their calls where the
    ranks outnumber the cores and it was in the running (code_paths); True without such
    rows. Past the cores the two paths' order moves with the moment on a shared machine
    (docs/benchmarks.md, "Single copy against the slots in turn"), and a kernel-copy rate
    fitted where ranks had cores of their own prices single copy low there: the model
    prices what the tuner mostly ran."""
    cma = every = 0
    for r in rows:
        n, paths = r["nranks"], r.get("paths")
        if not _usable(r, min_bytes) or not cores or n <= cores or not isinstance(paths, dict):
            continue
        if "cma" not in code_paths(r["collective"], n, r["size"]):
            continue
        calls = {k: v for k, v in paths.items() if isinstance(v, int)}
        cma += calls.get("cma", 0)
        every += sum(calls.values())
    return every == 0 or 2 * cma >= every


def _label(collective: str, n: int, size: float) -> str:
    """A row as the agreement names it: "all_gather, 4 ranks, 1024 KiB"."""
    return f"{collective}, {n} ranks, {size / KIB:.0f} KiB"


def fit_busiest(model: ShmModel, rows: list[dict[str, Any]], min_bytes: int = 64 * KIB) -> ShmModel:
    """`model` with its `busiest` (share()) fitted to the rows (as fit_shm takes them, each
    priced by the path it took) whose rank count exceeds model.cores and is not a multiple
    of it, the only ones it moves: the weight in 0, 0.05, .., 1 of least squared relative
    error; the model unchanged (its busiest: 1 unless set) where there is no such row."""
    c = model.cores
    pts = [p for p in _points(rows, min_bytes) if c and p[1] > c and p[1] % c]
    if not pts:
        return model

    def err(w: float) -> float:
        return _error(replace(model, busiest=w), pts)

    w = min((i / 20 for i in range(21)), key=err)
    return replace(model, busiest=w, source=f"{model.source}; busiest: {len(pts)} rows")
