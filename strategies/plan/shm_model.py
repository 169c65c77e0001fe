"""Shared-memory collective costs from what each algorithm does, with a few fitted constants.

On one host the communicator picks a path per call (csrc/comm/collectives.cc, dispatch.cc):

- one-shot (csrc/algo/oneshot.cc) where the message fits the one-shot areas
  (PYCOLL_ONESHOT_BYTES, default 32 KiB: an all-reduce's buffer, a reduce-scatter's whole
  input, an all-gather's block per rank); for an all-gather only where single copy is not
  taken;
- single copy (CMA, csrc/algo/cma.cc) inside the size bands of cma_band()
  (csrc/comm/cma_choice.cc) where the rank's tuner timed it faster than the slots on two
  trials each: a coin toss where the two are close, so the model prices both and takes the
  faster (`ShmModel.options` lists both), except where the ranks outnumber the cores and the
  fit run's tuners mostly ran the slots (`ShmModel.cma_past_cores`);
- else the ring over the shared slots (csrc/algo/ring.cc), chunked by the slot size
  (PYCOLL_SLOT_BYTES, default 256 KiB up to 4 ranks).

`work()` counts per rank, for a full buffer of S bytes over N ranks (all-gather: its
output, reduce-scatter: its input; B = S/N), the bytes that go through a user-space copy,
through a two-input reduction (an N-input one counts N-1 times its output) and through the
kernel's process_vm_readv/writev copy, and the handoffs (a flag raised and waited for, or a
system call per chunk and peer), from the primitives each algorithm runs:

    ring all-reduce       copy S      reduce (N-1)B   handoffs 2(N-1) ceil(S/(N slot))
    ring reduce-scatter   copy B      reduce (N-1)B   handoffs (N-1) ceil(B/slot)
    ring all-gather       copy S                      handoffs (N-1) ceil(B/slot)
    one-shot all-reduce   copy S      reduce (N-1)S   handoffs 1
    one-shot red.-scatter copy S      reduce (N-1)B   handoffs 1
    one-shot all-gather   copy S + B                  handoffs 1
    cma all-reduce        kernel 2(N-1)B, reduce (N-1)B, handoffs 2(N-1) ceil(B/chunk)
    cma reduce-scatter    kernel (N-1)B,  reduce (N-1)B, handoffs (N-1) ceil(B/chunk)
    cma all-gather        kernel (N-1)B,  copy B,        handoffs (N-1) ceil(B/chunk)

(single copy shares the chunks of every rank out among the ranks that run: per rank, its
n-th of the whole.) The time of a path is the longer of two:

- the cores': share x (alpha handoffs + copy/bw_copy + reduce/bw_reduce +
  kernel/bw_kernel) at the rates of data in the cache. `share` of N ranks on C cores is 1
  up to C ranks, else N/C (time-sharing) x (1 + contention (N-C)/C): a rank past the
  cores costs every rank a fitted `contention` / C more (a peer descheduled when a
  handoff waits for it, caches shared between ranks);
- the memory's, once the ranks' buffers together (footprint(): every rank's input and
  output) fill their share of the last-level cache: every rank's traffic (a copy reads
  and writes each byte, a reduction reads two and writes one) at one fitted memory
  bandwidth, which all ranks share. The share of the cache is fitted (1, 1/2 or 1/4): a
  VM's cache is shared with whatever else its host runs, and the slots, scratch and
  code take their part.

`shm_fit.fit_shm` fits the constants (alpha, three bandwidths, contention, memory
bandwidth, the cache's share, the busiest core's weight) to measured rows, each priced
by the path it took.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .units import PlanInputError

__all__ = [
    "ShmModel",
    "agreement",
    "agreement_text",
    "cma_band",
    "code_paths",
    "footprint",
    "last_level_cache_bytes",
    "share",
    "slot_bytes",
    "traffic",
    "work",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
PATHS = ("slots", "oneshot", "cma")
KIB, MIB = 1 << 10, 1 << 20
CMA_CHUNK = 256 * KIB  # csrc/comm/dispatch.cc, cma_view: kChunk
MAX_ONESHOT_RANKS = 64  # csrc/algo/algorithms.h: kMaxOneShotRanks


@dataclass(frozen=True)
class Work:
    """Per rank: bytes copied, reduced, copied by the kernel; handoffs (synchronisations)."""

    copy: float
    reduce: float
    kernel: float
    handoffs: float


def _check(collective: str, n: int, size: float) -> None:
    if collective not in COLLECTIVES:
        raise PlanInputError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")
    if n < 2 or size <= 0:
        raise PlanInputError(f"{collective}: n={n}, size={size}: need n >= 2 and size > 0")


def slot_bytes(n: int) -> int:
    """The slots' default size on `n` ranks (PYCOLL_SLOT_BYTES, docs/api.md): 256 KiB up to
    4 ranks, 128 KiB up to 8, 64 KiB beyond."""
    return 256 * KIB if n <= 4 else 128 * KIB if n <= 8 else 64 * KIB


def work(collective: str, path: str, n: int, size: float, slot: int | None = None) -> Work:
    """What one rank of `n` does in `collective` on a `size`-byte full buffer over `path`
    (the module docstring's table), with slots of `slot` bytes (default slot_bytes(n)).
    Raises PlanInputError for an unknown collective or path, n < 2 or size <= 0."""
    _check(collective, n, size)
    b = size / n
    slot = slot or slot_bytes(n)
    if path == "slots":
        if collective == "all_reduce":
            return Work(size, (n - 1) * b, 0.0, 2 * (n - 1) * math.ceil(b / slot))
        if collective == "reduce_scatter":
            return Work(b, (n - 1) * b, 0.0, (n - 1) * math.ceil(b / slot))
        return Work(size, 0.0, 0.0, (n - 1) * math.ceil(b / slot))
    if path == "oneshot":
        if collective == "all_reduce":
            return Work(size, (n - 1) * size, 0.0, 1)
        if collective == "reduce_scatter":
            return Work(size, (n - 1) * b, 0.0, 1)
        return Work(size + b, 0.0, 0.0, 1)
    if path == "cma":
        chunks = math.ceil(b / CMA_CHUNK)
        if collective == "all_reduce":
            return Work(0.0, (n - 1) * b, 2 * (n - 1) * b, 2 * (n - 1) * chunks)
        if collective == "reduce_scatter":
            return Work(0.0, (n - 1) * b, (n - 1) * b, (n - 1) * chunks)
        return Work(b, 0.0, (n - 1) * b, (n - 1) * chunks)
    raise PlanInputError(f"{collective}: path={path!r} is not one of {', '.join(PATHS)}")


def share(n: int, cores: int | None, contention: float = 0.0, busiest: float = 1.0) -> float:
    """How many times longer `n` ranks on `cores` cores take than on a core each: 1 up to
    `cores` ranks (or cores None), else the load of a core x (1 + contention (n - cores) /
    cores): each rank past the cores costs every rank `contention` / cores more (a peer
    descheduled at a handoff, caches shared between ranks; fitted). The load of a core is
    n / cores (time-sharing, the ranks spread evenly over time) moved by `busiest` (0 to 1,
    fitted: fit_busiest; 1 unless fitted) towards ceil(n / cores), the busiest core's where
    the ranks stay put and a lockstep collective waits for the slowest; the two agree where
    cores divides n. Unfitted, 1: measured 3-rank rows on 2 cores (two plan_costs runs of
    2026-12-07, fitted at 2 and 4 ranks) came out at a median 0.77-0.79 of the prediction
    under 0 and 1.03-1.05 under 1.
    Raises PlanInputError for cores < 1."""
    if cores is None or n <= cores:
        return 1.0
    if cores < 1:
        raise PlanInputError(f"share: n={n}, cores={cores}: need cores >= 1")
    load = n / cores + busiest * (math.ceil(n / cores) - n / cores)
    return load * (1 + contention * (n - cores) / cores)


def cma_band(collective: str, n: int, size: float) -> bool:
    """Whether the communicator tries single copy for `collective` of `size` bytes (its
    full buffer) on `n` ranks: csrc/comm/cma_choice.cc cma_band(), kept in step with it."""
    if n > 4:
        return False
    if collective == "all_reduce":
        return size >= MIB and (n < 4 or size < 32 * MIB)
    if collective == "reduce_scatter":
        if n == 2:
            return 256 * KIB <= size < 32 * MIB
        return size >= MIB if n == 3 else MIB <= size < 8 * MIB
    if n == 2:
        return 64 * KIB <= size < 32 * MIB
    return 256 * KIB <= size < 32 * MIB if n == 3 else MIB <= size < 32 * MIB


def code_paths(collective: str, n: int, size: float, oneshot_bytes: int = 32 * KIB) -> list[str]:
    """The paths the communicator may take for `collective` (csrc/comm/collectives.cc, no
    windows): one-shot where it fits (up to 64 ranks; an all-gather: unless single copy
    won), single copy inside its band where the tuner measures it faster, else the slots.
    Raises PlanInputError as work() does."""
    _check(collective, n, size)
    fits = {"all_reduce": size, "reduce_scatter": size, "all_gather": size / n}[collective]
    small = fits <= oneshot_bytes and n <= MAX_ONESHOT_RANKS
    if small and collective != "all_gather":
        return ["oneshot"]
    paths = ["cma"] if cma_band(collective, n, size) else []
    return paths + ["oneshot" if small else "slots"]


def footprint(collective: str, n: int, size: float) -> float:
    """Bytes of the `n` ranks' buffers together in `collective` on a `size`-byte full
    buffer: each rank's input and output (all-reduce S and S, reduce-scatter S and S/n,
    all-gather S/n and S). Raises PlanInputError as work() does."""
    _check(collective, n, size)
    per_rank = 2 * size if collective == "all_reduce" else size + size / n
    return n * per_rank


def last_level_cache_bytes(default: int = 32 * MIB) -> int:
    """This machine's largest cache (Linux sysfs, cpu0), or `default` where none is read."""
    best = 0
    for i in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(text[-1:].upper(), 1)
        try:
            best = max(best, int(text.rstrip("KMGkmg")) * mult)
        except ValueError:
            continue
    return best or default


@dataclass
class ShmModel:
    """Fitted constants (the module docstring): alpha (s per handoff), seconds per byte
    copied, reduced, copied by the kernel; the lockstep paths' contention per rank past the
    cores; seconds per byte of memory traffic past the cache; the machine's cores and
    last-level cache, and the share of it the ranks' buffers get (fitted)."""

    alpha: float
    per_copy: float
    per_reduce: float
    per_kernel: float
    contention: float
    per_traffic: float
    cores: int | None
    cache_bytes: int
    source: str = "fit"
    rows: int = 0
    busiest: float = 1.0  # share(): 1 unless fit_busiest has rows to fit it
    cache_share: float = 1.0  # past_cache(): 1 unless fit_shm's rows say less
    # Whether single copy is priced where the ranks outnumber the cores (options()):
    # fit_shm clears it where the fit run's tuner mostly ran the slots there.
    cma_past_cores: bool = True
    agreement: dict[str, Any] | None = None  # agreement(): how the fit prices its own rows

    transport = "shm"

    @property
    def beta(self) -> float:
        """Seconds per byte of a plain copy (a point-to-point message's)."""
        return self.per_copy

    @property
    def bandwidth(self) -> float:
        """Bytes per second of a plain copy."""
        return 1.0 / self.per_copy if self.per_copy else math.inf

    def cpu_time(self, collective: str, path: str, n: int, size: float) -> float:
        """Seconds the ranks' cores take: share() x (handoffs and bytes at the rates of data
        in the cache)."""
        w = work(collective, path, n, size)
        busy = w.copy * self.per_copy + w.reduce * self.per_reduce + w.kernel * self.per_kernel
        return share(n, self.cores, self.contention, self.busiest) * (
            self.alpha * w.handoffs + busy
        )

    def past_cache(self, collective: str, n: int, size: float, sharing: int | None = None) -> bool:
        """Whether the buffers (footprint()) of `sharing` of the `n` ranks (default all:
        those on this machine's cache) fill their share of the last-level cache
        (cache_share x cache_bytes)."""
        held = footprint(collective, n, size) * (sharing or n) / n
        return held >= self.cache_share * self.cache_bytes

    def memory_time(self, collective: str, path: str, n: int, size: float) -> float:
        """Seconds the memory takes for every rank's traffic (traffic()) once the ranks'
        buffers fill their share of the cache (past_cache()); 0 within it."""
        if not self.past_cache(collective, n, size):
            return 0.0
        return n * traffic(work(collective, path, n, size)) * self.per_traffic

    def path_time(self, collective: str, path: str, n: int, size: float) -> float:
        """Seconds of `collective` over `path` on `n` ranks: the cores' time or the
        memory's, whichever is longer."""
        return max(
            self.cpu_time(collective, path, n, size), self.memory_time(collective, path, n, size)
        )

    def options(self, collective: str, n: int, size: float) -> dict[str, float]:
        """Seconds per path the code may take at (n, size) (code_paths), without single copy
        where the ranks outnumber the cores and cma_past_cores is off."""
        paths = code_paths(collective, n, size)
        if not self.cma_past_cores and self.cores and n > self.cores and len(paths) > 1:
            paths = [p for p in paths if p != "cma"]
        return {p: self.path_time(collective, p, n, size) for p in paths}

    def path(self, collective: str, n: int, size: float) -> str:
        """The path priced at (n, size): the faster of those the code may take."""
        opts = self.options(collective, n, size)
        return min(opts, key=opts.__getitem__)

    def time(self, collective: str, n: int, size: float, path: str | None = None) -> float:
        """Predicted seconds of `collective` over `n` ranks on a `size`-byte full buffer, by
        `path` where given, else the faster path the code may take; 0 for n <= 1 or size 0.
        Raises PlanInputError for an unknown collective or path."""
        if n <= 1 or size <= 0:
            _check(collective, 2, 1.0)
            return 0.0
        if path is not None and path in PATHS:
            return self.path_time(collective, path, n, size)
        return min(self.options(collective, n, size).values())

    def describe(self) -> list[dict[str, Any]]:
        """The fitted constants as rows: constant, value, unit."""

        def gbps(x: float) -> float:
            return 1 / x / 1e9 if x else math.inf

        return [
            {"constant": "alpha (per handoff)", "value": self.alpha * 1e6, "unit": "us"},
            {"constant": "copy bandwidth", "value": gbps(self.per_copy), "unit": "GB/s"},
            {"constant": "reduce bandwidth", "value": gbps(self.per_reduce), "unit": "GB/s"},
            {"constant": "kernel copy bandwidth", "value": gbps(self.per_kernel), "unit": "GB/s"},
            {"constant": "contention per rank past the cores", "value": self.contention, "unit": ""},
            {"constant": "memory bandwidth past the cache", "value": gbps(self.per_traffic), "unit": "GB/s"},
            {"constant": "share of the last-level cache the buffers get", "value": self.cache_share, "unit": ""},
            {"constant": "busiest core's weight (ranks not a multiple of the cores)", "value": self.busiest, "unit": ""},
            {"constant": "single copy priced past the cores (1 yes, 0 the slots)", "value": float(self.cma_past_cores), "unit": ""},
        ]  # fmt: skip


def agreement(priced: list[tuple[str, float]]) -> dict[str, Any]:
    """How a model prices measured rows, from (what, predicted / measured) per row: rows,
    within_20pct (rows within 20%), median_abs_error, worst (what, ratio: the row farthest
    from 1 by |log|). Empty rows: {"rows": 0}."""
    if not priced:
        return {"rows": 0}
    errs = sorted(abs(x - 1) for _, x in priced)
    mid = len(errs) // 2
    med = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    what, worst = max(priced, key=lambda p: abs(math.log(p[1])) if p[1] > 0 else math.inf)
    return {"rows": len(priced), "within_20pct": sum(e <= 0.2 for e in errs),
            "median_abs_error": med, "worst": {"row": what, "ratio": worst}}  # fmt: skip


def agreement_text(a: dict[str, Any] | None) -> str:
    """One line of agreement(): "k/n rows within 20%, median |error| e%, worst r x (row)",
    or "" for none."""
    if not a or not a.get("rows"):
        return ""
    w = a["worst"]
    return (f"{a['within_20pct']}/{a['rows']} rows within 20%, median |error| "
            f"{a['median_abs_error']:.0%}, worst {w['ratio']:.2f}x ({w['row']})")  # fmt: skip


def traffic(w: Work) -> float:
    """Bytes through memory of one rank's work: a copy reads and writes each byte, a
    two-input reduction reads two and writes one."""
    return 2 * w.copy + 3 * w.reduce + 2 * w.kernel
