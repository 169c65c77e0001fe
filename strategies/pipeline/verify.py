"""`verify(schedule)`: proves that a schedule runs to the end and computes what
it should, or names the rank and step where it does not.

The execution model (execution_model.py runs it with `overlap=False`; docs/pipeline.md
says what a runtime must do):

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

from collections import defaultdict

from .actions import COMPUTE, COUNTERPART, RECVS, SENDS, Kind
from .execution_model import Slot, execute
from .schedule import Schedule, ScheduleError

__all__ = ["ScheduleError", "check_static", "pair_messages", "verify"]

F, B, I_, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


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
