"""Collective costs across hosts (TCP) from what each algorithm does, with a few fitted constants.

Across hosts the communicator runs (csrc/algo/hierarchical.cc):

- hierarchical (the default where every host has as many ranks, p each, h hosts): an
  all-reduce is a ring reduce-scatter within each host over the shared slots, a ring
  all-reduce of each rank's 1/p of the buffer across the hosts along its rail (all rails
  at once) and a ring all-gather within the host; a reduce-scatter is its within-host half
  then its across-host half, an all-gather the reverse. With one rank per host only the
  across-host ring runs;
- flat (PYCOLL_ALGO=ring, or hosts of unequal rank counts): one ring over all n = h p
  ranks, host by host: h of its n links cross hosts.

A TCP link (csrc/transport/tcp/tcp_conn.h) moves frames of one slot (PYCOLL_SLOT_BYTES,
shm_model.slot_bytes) over one socket per direction (PYCOLL_SOCKET_NSOCKS, default 1): the
sender copies into its slot and send() has the kernel copy it into the socket; the receiver's
recv() has the kernel copy it into its one slot, from which the ring copies or reduces it.
A ring of k steps over blocks of B bytes (all-reduce: k = 2(n-1), reduce-scatter and
all-gather: k = n-1, B = S/n) costs each rank, per `link_work`:

    copy     as over the shared slots (shm_model.work: csrc/algo/prims.cc fuses each
    reduce   step's receive, reduction or copy, and send into one pass: all-reduce
             copies S and reduces (n-1)B, reduce-scatter B and (n-1)B, all-gather S and 0)
    net      2 k B: the kernel's work for the link's bytes at both of its ends. With one
             rank per host that is the rank's own send and receive. In a flat ring over
             hosts of several ranks, where a rank's send or its receive crosses hosts,
             the busiest rank is the sender: its send() of a frame over loopback or veth
             also runs the receiving stack (softirq, in the sender's context), so it bears
             most of the link's work; the model charges it all (the upper bound; half,
             the lower, priced the flat ring's rows of the 2026-12-07 record worse:
             5/27 rows within 20% against 12/27)
    frames   k ceil(B / slot) x sides: a send() or recv() and a wake-up each (sides 2
             with one rank per host, 1 in the flat ring over hosts of several ranks)
    steps    k: a round trip through the link each (the ring waits for its predecessor)
    handoffs k ceil(B / slot): chunks received, over either kind of link

Where more ranks share the cores than there are (C cores, m ranks), a rank's time is
shm_model.share(m, C, contention) x its busy time, plus per_wait x (m - C) / C per
handoff: the peer a handoff waits for may be waiting for a core. `fit_sharing` fits these
two to rows with more ranks than cores (fit_tcp takes the shared-memory model's contention
and no wait).

The within-host rings of the hierarchical schedules are priced with shm_model.work and the
shared-memory model's constants; past its last-level cache, where the buffers of the ranks
on a machine together fill its share of it (ShmModel.past_cache), the time is the memory's for their traffic if that is longer (as in
shm_model, at its fitted bandwidth; fit_tcp then leaves those rows out where others suffice). The time is the ranks' CPU work (busy time) times
shm_model.share() of the ranks that share the cores: on a cluster a host's own ranks on
its cores; on one machine holding every "host" (network namespaces over veth, the test
bed) all ranks, whose kernels' copies for TCP take the same cores.

`fit_tcp` fits the link's constants (per step, per frame, per byte the kernel copies) to
the rows of a run across hosts; the copy and reduction rates are the shared-memory model's
where one is given (the same memcpy and reduction kernels on the same cores), else fitted
as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .shm_fit import lstsq_nonneg
from .shm_model import COLLECTIVES, ShmModel, agreement, share, slot_bytes, traffic, work
from .units import PlanInputError

__all__ = ["LinkWork", "TcpModel", "fit_sharing", "fit_tcp", "link_work", "tcp_agreement"]

KIB = 1 << 10


@dataclass(frozen=True)
class LinkWork:
    """Per rank: bytes copied, reduced, copied by the kernel for TCP; frames; steps;
    handoffs (a chunk received from the ring's predecessor, over whichever link)."""

    copy: float
    reduce: float
    net: float
    frames: float
    steps: float
    handoffs: float


def _ring_steps(collective: str, n: int) -> int:
    """The steps of a ring `collective` over n ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1)
    if collective in ("reduce_scatter", "all_gather"):
        return n - 1
    raise PlanInputError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")


def link_work(
    collective: str, hosts: int, per_host: int, size: float, slot: int | None = None
) -> LinkWork:
    """What the busiest rank does in a flat ring `collective` over hosts x per_host ranks
    (host by host) on a `size`-byte full buffer, slots of `slot` bytes (default
    shm_model.slot_bytes(ranks)): the module docstring's table. One host: no net bytes
    (its links are shared memory). Raises PlanInputError for an unknown collective,
    hosts or per_host < 1, fewer than 2 ranks or size <= 0."""
    n = hosts * per_host
    if hosts < 1 or per_host < 1 or n < 2 or size <= 0:
        raise PlanInputError(
            f"{collective}: hosts={hosts}, per_host={per_host}, size={size}: need >= 2 ranks "
            "and size > 0"
        )
    k = _ring_steps(collective, n)
    b = size / n
    slot = slot or slot_bytes(n)
    sides = 0 if hosts == 1 else 2 if per_host == 1 else 1
    net = 0 if hosts == 1 else 2 * k * b  # module docstring: the busiest rank's share
    w = work(collective, "slots", n, size, slot)  # the ring's copies and reductions
    chunks = k * math.ceil(b / slot)
    return LinkWork(w.copy, w.reduce, net, chunks * sides, k, chunks)


@dataclass
class TcpModel:
    """Fitted constants: seconds per ring step (a round trip through a TCP link), per frame
    (a send() or recv() and its wake-up), per byte the kernel copies for TCP, per byte
    copied and reduced in user space; the shared-memory model of the within-host steps
    (None: priced as a flat ring's); the cores the fit's rows shared."""

    per_step: float
    per_frame: float
    per_net: float
    per_copy: float
    per_reduce: float
    shm: ShmModel | None
    cores: int | None
    source: str = "fit"
    rows: int = 0
    contention: float = 0.0
    per_wait: float = 0.0
    agreement: dict[str, Any] | None = None  # shm_model.agreement(): the fit on its own rows

    transport = "tcp"

    @property
    def alpha(self) -> float:
        """Seconds of a point-to-point message's latency: a step and a frame each side."""
        return self.per_step + 2 * self.per_frame

    @property
    def beta(self) -> float:
        """Seconds per byte of a point-to-point message: the sender's copy and the
        kernel's two."""
        return self.per_copy + 2 * self.per_net

    @property
    def bandwidth(self) -> float:
        """Bytes per second of a point-to-point message."""
        return 1.0 / self.beta if self.beta else math.inf

    def busy(self, w: LinkWork) -> float:
        """Seconds of a rank's CPU for `w` on a core of its own."""
        return (
            w.steps * self.per_step + w.frames * self.per_frame + w.net * self.per_net
            + w.copy * self.per_copy + w.reduce * self.per_reduce
        )  # fmt: skip

    def _intra(self, collective: str, per_host: int, size: float) -> float:
        """Busy seconds of a within-host ring over the shared slots (shm_model's work and
        constants; this model's copy and reduce rates where no shared-memory model)."""
        if per_host < 2:
            return 0.0
        if self.shm is None:
            return self.busy(link_work(collective, 1, per_host, size))
        w, s = work(collective, "slots", per_host, size), self.shm
        return s.alpha * w.handoffs + w.copy * s.per_copy + w.reduce * s.per_reduce

    def _shared(self, busy: float, waits: float, sharing: int) -> float:
        """Seconds of `busy` CPU seconds and `waits` handoffs of a rank when `sharing` ranks
        share the cores: share() x busy, plus per_wait per handoff x the ranks past the
        cores per core (a handoff to a peer that is not running waits for its turn)."""
        over = max(0.0, (sharing - self.cores) / self.cores) if self.cores else 0.0
        return share(sharing, self.cores, self.contention) * busy + over * self.per_wait * waits

    def parts(
        self, collective: str, hosts: int, per_host: int, size: float, flat: bool
    ) -> tuple[float, float]:
        """(busy seconds, handoffs) of the busiest rank in the flat ring or the hierarchical
        schedule (module docstring) over hosts x per_host ranks. Raises PlanInputError as
        link_work does."""
        if flat or hosts < 2:
            w = link_work(collective, hosts, per_host, size)
            return self.busy(w), w.handoffs
        w = link_work(collective, hosts, 1, size / per_host)
        busy, waits = self.busy(w), w.handoffs
        for half in ("reduce_scatter", "all_gather"):
            if per_host > 1 and (collective == "all_reduce" or collective == half):
                busy += self._intra(half, per_host, size)
                waits += work(half, "slots", per_host, size).handoffs
        return busy, waits

    def memory_time(
        self, collective: str, hosts: int, per_host: int, size: float, flat: bool, sharing: int
    ) -> float:
        """Seconds the memory takes for the traffic (shm_model.traffic: a copy 2 bytes per
        byte, a reduction 3, a kernel copy 2) of the `sharing` ranks that share it, at the
        shared-memory model's bandwidth past its cache, once their buffers together fill its
        share of it (ShmModel.past_cache); 0 within it or without a shared-memory model."""
        shm = self.shm
        n = hosts * per_host
        if shm is None or not shm.per_traffic or not shm.past_cache(collective, n, size, sharing):
            return 0.0
        per_rank = 0.0
        parts = [link_work(collective, hosts, per_host, size)] if flat or hosts < 2 else [
            link_work(collective, hosts, 1, size / per_host)]  # fmt: skip
        if not flat and hosts > 1 and per_host > 1:
            for half in ("reduce_scatter", "all_gather"):
                if collective in ("all_reduce", half):
                    per_rank += traffic(work(half, "slots", per_host, size))
        per_rank += sum(2 * w.copy + 3 * w.reduce + 2 * w.net for w in parts)
        return sharing * per_rank * shm.per_traffic

    def flat_time(
        self, collective: str, hosts: int, per_host: int, size: float, sharing: int | None = None
    ) -> float:
        """Seconds of one ring over hosts x per_host ranks on `sharing` ranks' cores
        (default per_host: a host's own): the cores' time or the memory's, the longer.
        Raises PlanInputError as link_work does."""
        busy, waits = self.parts(collective, hosts, per_host, size, True)
        m = sharing or per_host
        cpu = self._shared(busy, waits, m)
        return max(cpu, self.memory_time(collective, hosts, per_host, size, True, m))

    def hierarchical_time(
        self, collective: str, hosts: int, per_host: int, size: float, sharing: int | None = None
    ) -> float:
        """Seconds of the hierarchical `collective` (module docstring) over hosts x per_host
        ranks on `sharing` ranks' cores (default per_host). Raises PlanInputError as
        link_work does."""
        busy, waits = self.parts(collective, hosts, per_host, size, False)
        m = sharing or per_host
        cpu = self._shared(busy, waits, m)
        return max(cpu, self.memory_time(collective, hosts, per_host, size, False, m))

    def time(self, collective: str, n: int, size: float, path: str | None = None) -> float:
        """Seconds of a ring `collective` over `n` ranks joined by TCP links (one per host),
        each on a core of its own; 0 for n <= 1 or size <= 0 (the costs.ring_time
        interface; `path` is ignored). Raises PlanInputError for an unknown collective."""
        if n <= 1 or size <= 0:
            _ring_steps(collective, 2)
            return 0.0
        return self.busy(link_work(collective, n, 1, size))

    def describe(self) -> list[dict[str, Any]]:
        """The fitted constants as rows: constant, value, unit."""

        def gbps(x: float) -> float:
            return 1 / x / 1e9 if x else math.inf

        return [
            {"constant": "per ring step (round trip)", "value": self.per_step * 1e6, "unit": "us"},
            {"constant": "per frame (syscall + wake-up)", "value": self.per_frame * 1e6, "unit": "us"},
            {"constant": "kernel TCP copy bandwidth", "value": gbps(self.per_net), "unit": "GB/s"},
            {"constant": "copy bandwidth", "value": gbps(self.per_copy), "unit": "GB/s"},
            {"constant": "reduce bandwidth", "value": gbps(self.per_reduce), "unit": "GB/s"},
            {"constant": "contention per rank past the cores", "value": self.contention, "unit": ""},
            {"constant": "wait per handoff per rank past the cores", "value": self.per_wait * 1e6, "unit": "us"},
        ]  # fmt: skip


def _layout(row: dict[str, Any]) -> tuple[int, int, bool]:
    """(hosts, ranks per host, flat ring) of a row: its "HxP" layout where it has one
    ("ring" after it: the flat ring), else one rank per host, hierarchical."""
    words = str(row.get("layout") or "").split()
    if words and "x" in words[0]:
        h, p = words[0].split("x", 1)
        if h.isdigit() and p.isdigit():
            return int(h), int(p), "ring" in words[1:]
    return row["nranks"], 1, False


def fit_tcp(
    rows: list[dict[str, Any]],
    shm: ShmModel | None = None,
    cores: int | None = None,
    min_bytes: int = 64 * KIB,
    source: str = "fit",
    sharing: str = "host",
) -> TcpModel:
    """A TcpModel fitted to bench rows across hosts (collective, nranks, size, time_us; a
    "layout" of "HxP" where not one rank per host; "ring" in it: the flat ring, else the
    hierarchical schedule) of all_reduce, reduce_scatter, all_gather at >= min_bytes,
    minimizing squared relative errors (non-negative constants). The copy and reduce rates
    are `shm`'s where given, else fitted; rows past shm's cache are the memory's (left out
    where two others remain). cores: the cores the rows' ranks shared (None: a
    core each); sharing "host": a host's ranks share them, "all": every rank of a row (one
    machine). Raises PlanInputError with fewer than two usable rows or another sharing."""
    if sharing not in ("host", "all"):
        raise PlanInputError(f"fit_tcp: sharing={sharing!r} is not 'host' or 'all'")
    cont = shm.contention if shm is not None else 0.0
    probe = TcpModel(0, 0, 0, 0, 0, shm, cores)
    a: list[list[float]] = []
    b: list[float] = []
    usable = _usable(rows, min_bytes)
    if shm is not None and shm.per_traffic:  # rows past the cache: the memory's (shm's) time
        inside = [r for r in usable if not shm.past_cache(
            r["collective"], r["nranks"], r["size"], _ranks(r, sharing))]  # fmt: skip
        usable = inside if len(inside) >= 2 else usable
    for r in usable:
        hosts, per, flat = _layout(r)
        coll, size, t = r["collective"], r["size"], r["time_us"] * 1e-6
        w = link_work(coll, hosts, per, size) if flat else link_work(coll, hosts, 1, size / per)
        fixed = 0.0 if flat else probe.parts(coll, hosts, per, size, False)[0]  # within hosts
        sh = share(_ranks(r, sharing), cores, cont)
        cols = [w.steps, w.frames, w.net]
        cols += [0.0, 0.0] if shm is not None else [w.copy, w.reduce]
        known = (w.copy * shm.per_copy + w.reduce * shm.per_reduce) if shm is not None else 0.0
        # relative error: (sh (known + fixed + cols . x) - t) / t
        a.append([sh * c / t for c in cols])
        b.append(1.0 - sh * (known + fixed) / t)
    if len(a) < 2:
        raise PlanInputError(
            f"fit_tcp: {len(a)} usable rows (pycoll all_reduce/reduce_scatter/all_gather of "
            f">= {min_bytes} bytes across >= 2 hosts)"
        )
    x = lstsq_nonneg(a, b)
    step, frame, net, pc, pr = x
    if shm is not None:
        pc, pr = shm.per_copy, shm.per_reduce
    pr = pr or pc
    what = f"{source}: tcp, per algorithm, {len(a)} rows"
    model = TcpModel(step, frame, net, pc, pr, shm, cores, what, len(a), cont)
    return replace(model, agreement=tcp_agreement(model, rows, min_bytes, sharing))


def tcp_agreement(
    model: TcpModel, rows: list[dict[str, Any]], min_bytes: int = 64 * KIB, sharing: str = "host"
) -> dict[str, Any]:
    """shm_model.agreement() of `model` on the usable rows across hosts (as fit_tcp takes
    them, past the cache too), each by its schedule (_layout) on `sharing`'s ranks."""
    priced = []
    for r in _usable(rows, min_bytes):
        hosts, per, flat = _layout(r)
        coll, size, m = r["collective"], r["size"], _ranks(r, sharing)
        t = (model.flat_time if flat else model.hierarchical_time)(coll, hosts, per, size, m)
        what = f"{coll}, {hosts}x{per}{' ring' if flat else ''}, {size / KIB:.0f} KiB"
        priced.append((what, t / (r["time_us"] * 1e-6)))
    return agreement(priced)


def _ranks(row: dict[str, Any], sharing: str) -> int:
    """The ranks that share the cores with a row's: all of them ("all") or its host's."""
    return row["nranks"] if sharing == "all" else _layout(row)[1]


def _usable(rows: list[dict[str, Any]], min_bytes: int) -> list[dict[str, Any]]:
    """The pycoll all_reduce/reduce_scatter/all_gather rows of >= min_bytes with a time,
    across >= 2 hosts (_layout)."""
    out = []
    for r in rows:
        if r.get("backend", "pycoll") != "pycoll" or r.get("collective") not in COLLECTIVES:
            continue
        if r["size"] < min_bytes or not r.get("time_us") or r["nranks"] < 2:
            continue
        if _layout(r)[0] >= 2:
            out.append(r)
    return out


def fit_sharing(
    model: TcpModel, rows: list[dict[str, Any]], min_bytes: int = 64 * KIB, sharing: str = "all"
) -> TcpModel:
    """`model` with its contention and per_wait (module docstring) fitted to the rows whose
    ranks outnumber model.cores (sharing "all": a row's ranks share them; "host": a host's),
    minimizing squared relative errors (non-negative), its agreement then on `rows`; the
    model itself where no such row. Raises PlanInputError for another sharing."""
    if sharing not in ("host", "all"):
        raise PlanInputError(f"fit_sharing: sharing={sharing!r} is not 'host' or 'all'")
    c = model.cores
    a: list[list[float]] = []
    b: list[float] = []
    for r in _usable(rows, min_bytes):
        hosts, per, flat = _layout(r)
        m = r["nranks"] if sharing == "all" else per
        if not c or m <= c:
            continue
        busy, waits = model.parts(r["collective"], hosts, per, r["size"], flat)
        t = r["time_us"] * 1e-6
        # t = m/c busy (1 + cont (m-c)/c) + (m-c)/c wait waits: linear in cont and wait
        a.append([m / c * busy * (m - c) / c / t, (m - c) / c * waits / t])
        b.append(1.0 - m / c * busy / t)
    if not a:
        return model
    cont, wait = lstsq_nonneg(a, b)
    what = f"{model.source}; sharing: {len(a)} rows"
    model = replace(model, contention=cont, per_wait=wait, source=what)
    return replace(model, agreement=tcp_agreement(model, rows, min_bytes, sharing))
