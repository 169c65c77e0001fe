"""The built-in schedules: each a compute order per rank, lowered by
`with_comms` into action lists with their sends and receives.

- `gpipe(p, m)`: all forwards, then all backwards (GPipe); m micro-batches of
  activations in flight.
- `one_f_one_b(p, m)`: rank r runs min(m, p - r) forwards, then alternates
  backward and forward (PipeDream-flush / Megatron 1F1B); at most p - r in
  flight.
- `interleaved_1f1b(p, m, v)`: v stages per rank, stage s on rank s % p
  (Megatron's interleaved schedule); any m.
- `zb_h1(p, m)`: 1F1B with the backward split into I (input gradient, on the
  critical path) and W (weight gradient, deferred into the bubbles), rank r
  running its W's r micro-batches late (Qi et al. 2024, ZB-H1); at most p in
  flight on every rank.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable

from .actions import COUNTERPART, Action, Kind
from .schedule import Schedule

__all__ = [
    "BUILDERS",
    "build",
    "gpipe",
    "ideal_times",
    "interleaved_1f1b",
    "one_f_one_b",
    "with_comms",
    "zb_h1",
]

F, B, I_, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def _check(p: int, m: int, v: int = 1) -> None:
    """Raises ValueError unless p, m and v are positive integers."""
    for name, x in (("p", p), ("m", m), ("v", v)):
        if not isinstance(x, int) or x < 1:
            raise ValueError(f"pipeline schedule: {name}={x!r} must be an integer >= 1")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs F of micro-batches 0..m-1, then B of 0..m-1.

    Raises ValueError unless p, m >= 1.
    """
    _check(p, m)
    order = [
        [Action(F, r, j) for j in range(m)] + [Action(B, r, j) for j in range(m)] for r in range(p)
    ]
    return with_comms(Schedule(p, m, 1, range(p), order, name=f"GPipe(p={p}, m={m})"))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank r runs min(m, p - r) forwards, then one backward and one
    forward while forwards remain, then the remaining backwards.

    Raises ValueError unless p, m >= 1.
    """
    _check(p, m)
    order = []
    for r in range(p):
        warm = min(m, p - r)
        acts = [Action(F, r, j) for j in range(warm)]
        for j in range(m):
            acts.append(Action(B, r, j))
            if warm + j < m:
                acts.append(Action(F, r, warm + j))
        order.append(acts)
    return with_comms(Schedule(p, m, 1, range(p), order, name=f"1F1B(p={p}, m={m})"))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B with v stages per rank, stage s on rank s % p.

    Micro-batches go in groups of at least p (m // p groups, sizes differing
    by at most one; one group of m when m < p). Each rank runs its forwards
    group by group, chunk 0 to v - 1 over the group's micro-batches, and its
    backwards likewise with the chunks reversed; after a warm-up of
    (v - 1) * g + 2 * (p - 1 - r) forwards (g the first group's size, as
    Megatron-LM; fewer, p - 1 - r as 1F1B, misses the bubble formula) it
    alternates one forward and one backward. With v = 1 this is 1F1B. Rank r
    holds up to warm-up + 1 stages' activations (p = 4, m = 8, v = 2: 11 on
    rank 0, 5.5 micro-batches' worth, against 1F1B's 4).

    Raises ValueError unless p, m, v >= 1.
    """
    _check(p, m, v)
    rounds = max(1, m // p)
    sizes = [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]
    fwd: list[tuple[int, int]] = []
    bwd: list[tuple[int, int]] = []
    start = 0
    for g in sizes:
        fwd += [(c, j) for c in range(v) for j in range(start, start + g)]
        bwd += [(c, j) for c in reversed(range(v)) for j in range(start, start + g)]
        start += g
    order = []
    for r in range(p):
        warm = (v - 1) * sizes[0] + 2 * (p - 1 - r) if v > 1 else p - 1 - r
        warm = min(len(fwd), warm)
        acts = [Action(F, c * p + r, j) for c, j in fwd[:warm]]
        for k, (c, j) in enumerate(bwd):
            if warm + k < len(fwd):
                fc, fj = fwd[warm + k]
                acts.append(Action(F, fc * p + r, fj))
            acts.append(Action(B, c * p + r, j))
        order.append(acts)
    stages = [s % p for s in range(p * v)]
    name = f"Interleaved1F1B(p={p}, m={m}, v={v})"
    return with_comms(Schedule(p, m, v, stages, order, name=name))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: the 1F1B order with B split into I then W. Rank r runs
    min(m, p - r) forwards, then alternates I and F; the W of micro-batch j
    comes after the I of micro-batch j + r (so at most p micro-batches hold
    activations on any rank), the last r W's at the end.

    Raises ValueError unless p, m >= 1.
    """
    _check(p, m)
    order = []
    for r in range(p):
        warm = min(m, p - r)
        acts = [Action(F, r, j) for j in range(warm)]
        for j in range(m):
            acts.append(Action(I_, r, j))
            if j >= r:
                acts.append(Action(W, r, j - r))
            if warm + j < m:
                acts.append(Action(F, r, warm + j))
        acts += [Action(W, r, j) for j in range(max(0, m - r), m)]
        order.append(acts)
    return with_comms(Schedule(p, m, 1, range(p), order, name=f"ZB-H1(p={p}, m={m})"))


def ideal_times(
    schedule: Schedule, cost: Callable[[Action], float] = lambda a: 1.0
) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action of a compute-only schedule when
    each starts as soon as its rank is free and its data is ready (F of the
    stage before, B or I of the stage after, I before W), messages free.

    Raises ValueError naming a rank and step that can never run (an order
    whose data dependencies form a cycle, or an action whose input no rank
    computes).
    """
    n = schedule.num_stages
    # (stage, micro-batch) -> when its F ended, its B or I (the gradient it
    # sends back), its I (what W needs).
    fwd: dict[tuple[int, int], float] = {}
    grad: dict[tuple[int, int], float] = {}
    inp: dict[tuple[int, int], float] = {}

    def deps(a: Action) -> tuple[tuple[dict[tuple[int, int], float], tuple[int, int]], ...]:
        st, mb = a.stage, a.microbatch
        if a.kind is F:
            return ((fwd, (st - 1, mb)),) if st > 0 else ()
        if a.kind is W:
            return ((inp, (st, mb)),)
        return ((fwd, (st, mb)),) + (((grad, (st + 1, mb)),) if st < n - 1 else ())

    needs = [[deps(a) for a in acts] for acts in schedule.actions]
    times: list[list[tuple[float, float]]] = [[] for _ in range(schedule.p)]
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule.actions):
            rt = times[r]
            while len(rt) < len(acts):
                start = rt[-1][1] if rt else 0.0
                for table, key in needs[r][len(rt)]:
                    end = table.get(key)
                    if end is None:
                        break
                    start = max(start, end)
                else:
                    a = acts[len(rt)]
                    end = start + cost(a)
                    rt.append((start, end))
                    key = (a.stage, a.microbatch)
                    if a.kind is F:
                        fwd[key] = end
                    elif a.kind is not W:
                        grad[key] = end
                        if a.kind is I_:
                            inp[key] = end
                    progress = True
                    continue
                break
    for r, acts in enumerate(schedule.actions):
        if len(times[r]) < len(acts):
            step = len(times[r])
            raise ValueError(
                f"{schedule.name or 'schedule'}: rank {r} step {step} ({acts[step]}) can never "
                "run: its input is never computed, or the order of the ranks forms a cycle"
            )
    return times


def with_comms(
    schedule: Schedule,
    t_F: float = 1.0,  # noqa: N803 (the cost names of the literature)
    t_B: float = 1.0,  # noqa: N803
    t_W: float = 1.0,  # noqa: N803
) -> Schedule:
    """Adds the sends and receives to a compute-only schedule (torch's
    `_add_send_recv` does the same for its runtime).

    Each message is exchanged when its data is produced in the schedule's
    ideal timeline (`ideal_times` with costs F = t_F, I = t_B, W = t_W,
    B = t_B + t_W, as `simulate`): the send right after the producing compute
    (F's output to the rank holding the next stage, B's or I's input gradient
    to the rank holding the previous one), the receive at the receiver's first
    step boundary at or after that moment (received early, kept until used).
    Receives from one sender so follow its send order, and a send meets its
    receive at once, or as soon as the receiver ends the compute it is in.
    The actions between two computes form one batch. With equal costs that
    timeline is itself a run of the rendezvous model in which nothing waits,
    so the lists cannot deadlock; verify proves it for the built-ins with
    the default costs, the real runtime's ratio (backward twice forward).

    Raises ValueError if the schedule already has sends or receives, or (from
    `ideal_times`) if its compute order cannot run.
    """
    rank_of, n = schedule.rank_of, schedule.num_stages
    if any(a.is_comm for acts in schedule.actions for a in acts):
        raise ValueError(f"with_comms: {schedule.name or 'schedule'} already has sends/receives")
    costs = {F: t_F, B: t_B + t_W, I_: t_B, W: t_W}
    times = ideal_times(schedule, lambda a: costs[a.kind])

    def send(a: Action, r: int) -> Action | None:
        if a.kind is F and a.stage + 1 < n and rank_of(a.stage + 1) != r:
            return Action(Kind.SEND_F, a.stage, a.microbatch, rank_of(a.stage + 1))
        if a.kind in (B, I_) and a.stage > 0 and rank_of(a.stage - 1) != r:
            return Action(Kind.SEND_B, a.stage, a.microbatch, rank_of(a.stage - 1))
        return None

    sends = [[send(a, r) for a in acts] for r, acts in enumerate(schedule.actions)]
    starts = [[t for t, _ in rank_times] for rank_times in times]
    # recvs[b][k]: what rank b receives just before its k-th compute, as
    # (time sent, sender, receive).
    recvs: list[dict[int, list[tuple[float, int, Action]]]] = [
        defaultdict(list) for _ in range(schedule.p)
    ]
    for r in range(schedule.p):
        for snd, (_, end) in zip(sends[r], times[r], strict=True):
            if snd is not None:
                b, kind = snd.peer, COUNTERPART[snd.kind]
                rcv = Action(kind, snd.peer_stage(), snd.microbatch, r)
                recvs[b][bisect_left(starts[b], end)].append((end, r, rcv))
    lists = []
    for r, acts in enumerate(schedule.actions):
        out: list[Action] = []
        for k, (a, snd) in enumerate(zip(acts, sends[r], strict=True)):
            if k in recvs[r]:
                out += [rcv for *_, rcv in sorted(recvs[r][k], key=lambda x: x[:2])]
            out.append(a)
            if snd is not None:
                out.append(snd)
        if len(acts) in recvs[r]:
            out += [rcv for *_, rcv in sorted(recvs[r][len(acts)], key=lambda x: x[:2])]
        lists.append(out)
    return Schedule(
        schedule.p, schedule.m, schedule.v, schedule.stage_to_rank, lists, name=schedule.name
    )


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The built-in schedule `name` (a key of BUILDERS); v only for interleaved.

    Raises ValueError for an unknown name, or v != 1 for a single-chunk one.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: one of {', '.join(BUILDERS)}")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one stage per rank: v={v} must be 1")
    return BUILDERS[name](p, m)
