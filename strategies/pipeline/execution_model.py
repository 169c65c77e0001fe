"""The execution model of a pipeline schedule and its proof: `execute` runs
action lists in time under the model (simulate.py measures with it),
`verify(schedule)` proves that a schedule runs to the end under it and
computes what it should, or names the rank and step where it does not.

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

`verify` runs the model with `overlap=False` (docs/pipeline.md says what a
runtime must do), which reads:

- A rank runs its list in order. A compute action runs when reached; each
  maximal run of sends and receives is one batch, posted when reached, and the
  rank goes on only when every operation of the batch has completed.
- A send is a rendezvous: it completes when its receive has been posted, and
  a receive when its send has. Messages between two ranks carry no tag: the
  k-th send from rank a to rank b pairs with the k-th receive on b from a.

Rendezvous is the most blocking a send can be, and waiting for a whole batch
is the most a rank can wait; a schedule that runs to the end so runs under any
buffering of sends (pycollectives buffers up to its slots, 1 MiB) and under a
runtime that issues batches asynchronously and waits only for the receives a
compute needs: both only drop waits from this model, and the waits form a
max-plus system whose pairing no timing changes, so no event comes later.

Checks, each failing with a `ScheduleError` that names the rank, the step and
the action, with the table around it:

1. per rank, in list order: every action's stage is held by the rank (and its
   micro-batch < m); a send's or receive's peer is the rank holding the peer
   stage, never the rank itself; F of stage s > 0 after its input is received
   (or, with stage s - 1 on the same rank, after F of s - 1); B or I after F
   of the same stage and micro-batch and after its output gradient is
   received (or B/I of s + 1 ran here); W after I (never with B); a send after
   the compute that produces its data; nothing twice; every receive used; at
   the end, every held stage has run F and a full backward (B, or I and W)
   of every micro-batch and sent whatever its neighbour needs;
2. the k-th send from a to b is the send of what the k-th receive on b from a
   expects (same kind, stage pair and micro-batch), counts equal;
3. no deadlock: the model above, simulated, runs every list to its end; else
   the error names every blocked rank, its step, and the cycle of waits.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import NamedTuple

from .actions import COMPUTE, COUNTERPART, RECVS, SENDS, Action, Kind
from .schedule import Schedule, ScheduleError

__all__ = ["Record", "ScheduleError", "check_static", "execute", "pair_messages", "verify"]

Slot = tuple[int, int]  # (rank, step)
F, B, I_, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


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
    (rank, step) to its peer's (pair_messages). Compute costs
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


def verify(schedule: Schedule) -> None:
    """Proves `schedule` free of deadlock and of broken dependencies under the
    model in this module's docstring.

    Raises ScheduleError naming the first failing rank and step.
    """
    execute(schedule, check_static(schedule), None, 0.0)


def check_static(schedule: Schedule) -> dict[Slot, Slot]:
    """Checks 1 and 2 (everything but deadlock); returns `pair_messages`.

    Raises ScheduleError naming the first failing rank and step.
    """
    for r in range(schedule.p):
        _check_rank(schedule, r)
    return pair_messages(schedule)


def _check_rank(s: Schedule, r: int) -> None:
    """Check 1 of the module docstring for rank `r`."""
    acts, n_st = s.actions[r], s.num_stages
    held = set(s.stages_of(r))
    rank_of = s.stage_to_rank
    done: dict[tuple[Kind, int, int], int] = {}
    unused: dict[tuple[Kind, int, int], int] = {}

    def fail(step: int, reason: str) -> ScheduleError:
        return ScheduleError(s, r, step, reason)

    for i, a in enumerate(acts):
        kind, st, mb = a.kind, a.stage, a.microbatch
        if st >= n_st or mb >= s.m:
            raise fail(i, f"stage {st} or micro-batch {mb} out of range ({n_st} stages, m={s.m})")
        if st not in held:
            raise fail(i, f"stage {st} is held by rank {rank_of[st]}, not rank {r}")
        if (kind, st, mb) in done:
            raise fail(i, f"repeats step {done[(kind, st, mb)]}")
        if kind not in COMPUTE:
            ps = a.peer_stage()
            if not 0 <= ps < n_st:
                raise fail(i, f"there is no stage {ps} to exchange with")
            if rank_of[ps] == r:
                raise fail(i, f"stage {ps} is on this rank too: its data is handed over locally")
            if a.peer != rank_of[ps]:
                raise fail(i, f"peer is rank {a.peer}, but stage {ps} is on rank {rank_of[ps]}")
        if kind is F and st > 0:
            if rank_of[st - 1] == r:
                if (F, st - 1, mb) not in done:
                    raise fail(i, f"runs before {st - 1}F{mb}, whose output it takes")
            elif unused.pop((Kind.RECV_F, st, mb), None) is None:
                raise fail(i, f"runs before its input is received ({st}RECV_F{mb})")
        elif kind in (B, I_):
            if (F, st, mb) not in done:
                raise fail(i, f"runs before {st}F{mb}")
            if (B, st, mb) in done or (I_, st, mb) in done:
                raise fail(i, f"a second backward of stage {st}, micro-batch {mb}")
            if st < n_st - 1:
                if rank_of[st + 1] == r:
                    if not ((B, st + 1, mb) in done or (I_, st + 1, mb) in done):
                        raise fail(
                            i, f"runs before the backward of stage {st + 1}, micro-batch {mb}"
                        )
                elif unused.pop((Kind.RECV_B, st, mb), None) is None:
                    raise fail(i, f"runs before its output gradient is received ({st}RECV_B{mb})")
        elif kind is W and (I_, st, mb) not in done:
            done_by_b = "B already computed its weight gradient"
            raise fail(i, done_by_b if (B, st, mb) in done else f"runs before {st}I{mb}")
        elif kind is Kind.SEND_F and (F, st, mb) not in done:
            raise fail(i, f"sends the output of {st}F{mb} before computing it")
        elif kind is Kind.SEND_B and not ((B, st, mb) in done or (I_, st, mb) in done):
            raise fail(
                i, f"sends the input gradient of stage {st}, micro-batch {mb} before computing it"
            )
        elif kind in RECVS:
            unused[(kind, st, mb)] = i
        done[(kind, st, mb)] = i
    for step in sorted(unused.values()):
        raise fail(step, "receives data that no later action uses")
    end = len(acts)
    for st in sorted(held):
        for mb in range(s.m):
            if (F, st, mb) not in done:
                raise fail(end, f"{st}F{mb} never runs")
            if (I_, st, mb) in done and (W, st, mb) not in done:
                raise fail(done[(I_, st, mb)], f"{st}W{mb}, the weight gradient, never runs")
            if not ((B, st, mb) in done or (I_, st, mb) in done):
                raise fail(end, f"stage {st}, micro-batch {mb} never runs backward (B or I)")
            if st < n_st - 1 and rank_of[st + 1] != r and (Kind.SEND_F, st, mb) not in done:
                raise fail(done[(F, st, mb)], f"its output never goes to rank {rank_of[st + 1]}")
            bwd = done.get((B, st, mb), done.get((I_, st, mb), end))
            if st > 0 and rank_of[st - 1] != r and (Kind.SEND_B, st, mb) not in done:
                raise fail(bwd, f"its input gradient never goes to rank {rank_of[st - 1]}")


def pair_messages(s: Schedule) -> dict[Slot, Slot]:
    """Check 2: pairs every send with its receive, both ways, by (rank, step).

    Raises ScheduleError at the first mismatched or unmatched send or receive.
    """
    sends: dict[tuple[int, int], list[Slot]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Slot]] = defaultdict(list)
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind in SENDS:
                sends[(r, a.peer)].append((r, i))
            elif a.kind in RECVS:
                recvs[(a.peer, r)].append((r, i))
    pairs: dict[Slot, Slot] = {}
    for key in sorted(set(sends) | set(recvs)):
        ss, rs = sends.get(key, []), recvs.get(key, [])
        for k, (snd, rcv) in enumerate(zip(ss, rs, strict=False)):
            a, b = s.actions[snd[0]][snd[1]], s.actions[rcv[0]][rcv[1]]
            if (COUNTERPART[a.kind], a.peer_stage(), a.microbatch) != (
                b.kind,
                b.stage,
                b.microbatch,
            ):
                raise ScheduleError(
                    s,
                    *rcv,
                    f"message {k} from rank {key[0]} to rank {key[1]} is {a} (rank {snd[0]}, "
                    f"step {snd[1]}), but this receive expects {b.counterpart()}",
                )
            pairs[snd], pairs[rcv] = rcv, snd
        if len(ss) != len(rs):
            extra = (ss if len(ss) > len(rs) else rs)[min(len(ss), len(rs))]
            raise ScheduleError(
                s,
                *extra,
                f"rank {key[0]} sends {len(ss)} messages to rank {key[1]}, "
                f"which receives {len(rs)}: this one is never matched",
            )
    return pairs
