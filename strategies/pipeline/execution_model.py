"""Runs action lists in time: the execution model that verify proves and
simulate measures.

Each rank has a compute thread walking its list and a communication thread
(the communicator's progress thread) running its batches one at a time in
list order. A batch is issued when the compute thread reaches it, starts
when the communication thread is free, and each of its sends and receives
matches when its peer's batch has started too (rendezvous); it ends t_p2p
after its last match. With `overlap=False` the compute thread waits for each
batch to end before going on (a synchronous `batch_p2p`); with `overlap=True`
it waits only, before a compute, for the batch holding that compute's receive
(an asynchronous `batch_p2p` and `Work.wait()` where the data is needed). A
rank finishes when both threads have.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import NamedTuple

from .actions import COMPUTE, Action, Kind
from .schedule import Schedule, ScheduleError

__all__ = ["Record", "execute"]

Slot = tuple[int, int]  # (rank, step)


class Record(NamedTuple):
    """What ran when: `action` on `rank` from `start` to `end`. timeline.py
    draws these, from a simulation or measured by a runtime."""

    rank: int
    start: float
    end: float
    action: object


def execute(
    s: Schedule,
    pairs: dict[Slot, Slot],
    cost: Callable[[Action], float] | None,
    t_p2p: float = 0.0,
    *,
    overlap: bool = False,
) -> list[Record]:
    """Runs `s` under the model above; `pairs` maps each send or receive
    (rank, step) to its peer's (verify.pair_messages). Compute costs
    `cost(action)` (None: no times, no records, only the deadlock check).
    Returns a record per action: computes from start to end, sends and
    receives from their match to their end.

    Raises ScheduleError on a deadlock, naming every blocked rank and step
    and the cycle of waits.
    """
    ops = [s.ops(r) for r in range(s.p)]
    op_at = [[k for k, op in enumerate(rops) for _ in op.actions] for rops in ops]
    batches = [[k for k, op in enumerate(rops) if op.is_batch] for rops in ops]
    need: list[dict[int, list[tuple[int, int]]]] = []  # batch op -> its peers' (rank, op)
    for r, rops in enumerate(ops):
        need.append({})
        for k in batches[r]:
            op = rops[k]
            peers = [pairs[(r, i)] for i in range(op.step, op.step + len(op.actions))]
            need[r][k] = [(q, op_at[q][j]) for q, j in peers]
    if cost is None and not overlap:
        _run_blocking(s, ops, pairs, need)
        return []
    waits: list[dict[int, int]] = []  # op -> the batch it must wait for first
    for r, rops in enumerate(ops):
        if not overlap:  # every op after a batch waits for it
            waits.append({k + 1: k for k in batches[r]})
            continue
        recv_op = {(a.kind, a.stage, a.microbatch): k for k in batches[r] for a in rops[k].actions}
        waits.append({})
        for k, op in enumerate(rops):
            a = op.actions[0]
            if a.kind in COMPUTE:
                recv = Kind.RECV_F if a.kind is Kind.FORWARD else Kind.RECV_B
                if (w := recv_op.get((recv, a.stage, a.microbatch))) is not None:
                    waits[r][k] = w
    records: list[Record] = []
    pc, now = [0] * s.p, [0.0] * s.p  # compute thread: next op, clock
    nb, free = [0] * s.p, [0.0] * s.p  # communication thread: next batch (index in batches), clock
    issued: list[dict[int, float]] = [{} for _ in range(s.p)]
    started: list[dict[int, float]] = [{} for _ in range(s.p)]  # what peers wait for
    ended: list[dict[int, float]] = [{} for _ in range(s.p)]
    waiting: dict[tuple[int, int], list[int]] = defaultdict(list)  # (rank, batch) -> ranks
    work = deque(range(s.p))

    def advance(r: int) -> None:
        """Runs rank r as far as it goes."""
        rops, mine, moved = ops[r], batches[r], True
        while moved:
            moved = False
            while nb[r] < len(mine) and mine[nb[r]] < pc[r]:  # next batch issued
                k = mine[nb[r]]
                if k not in started[r]:
                    started[r][k] = max(issued[r][k], free[r])
                    work.extend(waiting.pop((r, k), ()))
                t0, times = started[r][k], []
                for q, kq in need[r][k]:
                    if kq not in started[q]:
                        waiting[(q, kq)].append(r)
                        break
                    times.append(max(t0, started[q][kq]))
                else:
                    ended[r][k] = free[r] = max(times) + t_p2p
                    if cost is not None:
                        for a, t in zip(rops[k].actions, times, strict=True):
                            records.append(Record(r, t, t + t_p2p, a))
                    nb[r] += 1
                    moved = True
                    continue
                break
            while pc[r] < len(rops):  # the compute thread
                k = pc[r]
                w = waits[r].get(k)
                if w is not None:
                    if w not in ended[r]:
                        break
                    now[r] = max(now[r], ended[r][w])
                if k in need[r]:
                    issued[r][k] = now[r]
                elif cost is not None:
                    a = rops[k].actions[0]
                    records.append(Record(r, now[r], now[r] + cost(a), a))
                    now[r] += cost(a)
                pc[r] += 1
                moved = True

    while work:
        advance(work.popleft())
    if any(nb[r] < len(batches[r]) or pc[r] < len(ops[r]) for r in range(s.p)):
        cc = [batches[r][nb[r]] if nb[r] < len(batches[r]) else len(ops[r]) for r in range(s.p)]
        raise _deadlock(s, ops, pairs, need, cc, lambda q, kq: kq in started[q])
    return records


def _run_blocking(
    s: Schedule, ops: list, pairs: dict[Slot, Slot], need: list[dict[int, list[tuple[int, int]]]]
) -> None:
    """The deadlock check alone, without times: a rank passes a batch once
    every peer has reached its side of it.

    Raises ScheduleError on a deadlock.
    """
    pc = [0] * s.p
    waiting: dict[tuple[int, int], list[int]] = defaultdict(list)  # (rank, op) -> ranks
    work = deque(range(s.p))
    while work:
        r = work.popleft()
        rneed, n = need[r], len(ops[r])
        while pc[r] < n:
            late = next(((q, kq) for q, kq in rneed.get(pc[r], ()) if pc[q] < kq), None)
            if late is not None:
                waiting[late].append(r)
                break
            pc[r] += 1
            work.extend(waiting.pop((r, pc[r]), ()))
    if any(pc[r] < len(ops[r]) for r in range(s.p)):
        raise _deadlock(s, ops, pairs, need, pc, lambda q, kq: pc[q] >= kq)


def _deadlock(
    s: Schedule,
    ops: list,
    pairs: dict[Slot, Slot],
    need: list[dict[int, list[tuple[int, int]]]],
    cc: list[int],
    posted: Callable[[int, int], bool],
) -> ScheduleError:
    """The error for a run whose communication threads stopped at `cc`;
    `posted(q, k)`: whether rank q has posted its batch k."""
    waits: dict[int, tuple[int, int, int]] = {}  # rank -> (step, peer, peer step)
    for r in range(s.p):
        if cc[r] < len(ops[r]):
            op = ops[r][cc[r]]
            for i, (q, kq) in enumerate(need[r][cc[r]]):
                if not posted(q, kq):
                    waits[r] = (op.step + i, *pairs[(r, op.step + i)])
                    break
    lines = []
    for r, (i, q, j) in sorted(waits.items()):
        there = ops[q][cc[q]].step if cc[q] < len(ops[q]) else len(s.actions[q])
        lines.append(
            f"rank {r} step {i} ({s.actions[r][i]}) waits for rank {q} to post "
            f"{s.actions[q][j]} at its step {j}; rank {q} is blocked at step {there}"
        )
    r = min(waits)
    seen: list[int] = []
    while r not in seen and r in waits:
        seen.append(r)
        r = waits[r][1]
    cycle = seen[seen.index(r) :] if r in seen else seen
    first = min(cycle)
    reason = (
        f"deadlock, cycle of ranks {' -> '.join(map(str, cycle + cycle[:1]))}:\n  "
        + "\n  ".join(lines)
    )
    return ScheduleError(s, first, waits[first][0], reason)
