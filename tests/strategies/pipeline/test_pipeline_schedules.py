"""Pipeline schedules as data (strategies/pipeline): verify every built-in,
catch planted faults by rank and step, bubble formulas from the simulator,
activation memory, CSV round trip and torch compatibility, the timeline PNG.
No processes, no communication."""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import itertools
import sys

import pytest

from pycollectives.strategies.pipeline import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build,
    draw_timeline,
    format_table,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_action,
    peak_activations,
    simulate,
    timed_table,
    verify,
    with_comms,
    zb_h1,
)

SINGLE = ("gpipe", "1f1b", "zb-h1")


@functools.cache
def _build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """build(), once per process: the sweep and the formula tests share them."""
    return build(name, p, m, v)


def _replace(s: Schedule, rank: int, acts: list[Action]) -> Schedule:
    """`s` with rank `rank`'s list replaced."""
    lists = list(s.actions)
    lists[rank] = tuple(acts)
    return dataclasses.replace(s, actions=tuple(lists))


def _find(s: Schedule, rank: int, text: str) -> int:
    """The step of the action written `text` on `rank`."""
    return [str(a) for a in s.actions[rank]].index(text)


# ---- verify: every built-in, p <= 8, m <= 32, v <= 4 (one loop, ~1800 schedules)


def test_verify_every_builtin_schedule() -> None:
    count = 0
    for p, m in itertools.product(range(1, 9), range(1, 33)):
        for name in SINGLE:
            verify(_build(name, p, m))
            count += 1
        # v = 1 is 1F1B itself (verified above); v = 2..4 verified here.
        assert _build("interleaved", p, m, 1) == _build("1f1b", p, m)
        for v in range(1, 5):
            if v > 1:
                verify(_build("interleaved", p, m, v))
            count += 1
    assert count == 8 * 32 * 7


def test_builtins_keep_their_shape() -> None:
    s = interleaved_1f1b(4, 6, 3)
    assert (s.p, s.m, s.v, s.num_stages) == (4, 6, 3, 12)
    assert s.stage_to_rank == tuple(st % 4 for st in range(12))
    assert s.stages_of(1) == (1, 5, 9)
    for r in range(4):  # every compute once, sends and receives around them
        comp = [a for a in s.actions[r] if a.is_compute]
        assert len(comp) == 2 * 3 * 6
    kinds = {a.kind for acts in zb_h1(3, 5).actions for a in acts}
    assert Kind.BACKWARD not in kinds and {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT} <= kinds
    with pytest.raises(ValueError, match="v=2 must be 1"):
        build("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="m=0"):
        gpipe(2, 0)


# ---- planted faults: each names the rank and the step


def test_send_moved_past_a_receive_deadlocks() -> None:
    s = gpipe(2, 2)  # rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    acts = list(s.actions[0])
    send = acts.pop(_find(s, 0, "0SEND_F1"))
    acts.insert(acts.index(Action(Kind.BACKWARD, 0, 0)) + 1, send)  # after 0B0
    bad = _replace(s, 0, acts)
    with pytest.raises(ScheduleError) as err:
        verify(bad)
    e = err.value
    assert (e.rank, e.step, str(e.action)) == (0, 3, "0RECV_B0")
    msg = str(e)
    assert "deadlock, cycle of ranks 0 -> 1 -> 0" in msg
    assert "rank 0 step 3 (0RECV_B0) waits for rank 1" in msg
    assert "rank 1 step 2 (1RECV_F1) waits for rank 0 to post 0SEND_F1 at its step 5" in msg
    assert "0RECV_B0<-" in msg and "<-- rank 0" in msg  # the table, marked


def test_receive_swapped_after_its_use() -> None:
    s = one_f_one_b(4, 8)
    acts = list(s.actions[2])
    i, j = _find(s, 2, "2RECV_F3"), _find(s, 2, "2F3")
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(
        ScheduleError, match=r"rank 2, step \d+ \(2F3\): runs before its input"
    ) as e:
        verify(_replace(s, 2, acts))
    assert (e.value.rank, e.value.step) == (2, min(i, j))


def test_send_swapped_before_its_compute() -> None:
    s = one_f_one_b(3, 4)
    acts = list(s.actions[1])
    i, j = _find(s, 1, "1B2"), _find(s, 1, "1SEND_B2")
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="before computing it") as e:
        verify(_replace(s, 1, acts))
    assert (e.value.rank, e.value.step) == (1, i)


def test_receives_from_one_peer_swapped_mismatch() -> None:
    s = interleaved_1f1b(2, 4, 2)
    slots = [(r, i) for r in range(2) for i in range(len(s.actions[r]) - 1)]
    for r, i in slots:
        a, b = s.actions[r][i], s.actions[r][i + 1]
        if a.kind.is_recv and b.kind.is_recv and a.peer == b.peer:
            break
    else:
        pytest.fail("no batch with two receives from one peer")
    acts = list(s.actions[r])
    acts[i], acts[i + 1] = b, a  # both still precede their use: only the order is wrong
    with pytest.raises(ScheduleError, match="but this receive expects") as e:
        verify(_replace(s, r, acts))
    assert (e.value.rank, e.value.step) == (r, i)


def test_missing_w_names_rank_and_step() -> None:
    s = zb_h1(4, 8)
    acts = [a for a in s.actions[1] if str(a) != "1W5"]
    with pytest.raises(ScheduleError, match="1W5, the weight gradient, never runs") as e:
        verify(_replace(s, 1, acts))
    assert (e.value.rank, e.value.step) == (1, _find(s, 1, "1I5"))


@pytest.mark.parametrize(
    ("rank", "edit", "message"),
    [
        (1, lambda a: a[:-3], "never"),  # list cut short
        (0, lambda a: a + [a[0]], "repeats step 0"),  # 0F0 twice
        (2, lambda a: [Action(Kind.FORWARD, 1, 0)] + a, "held by rank 1"),
        (3, lambda a: [dataclasses.replace(a[0], peer=1)] + a[1:], "peer is rank 1"),
        (0, lambda a: [x for x in a if x.kind is not Kind.SEND_F], "never goes to rank 1"),
        (1, lambda a: [Action(Kind.BACKWARD_WEIGHT, 1, 0)] + a, "runs before 1I0"),
    ],
)
def test_other_faults(rank: int, edit, message: str) -> None:
    s = one_f_one_b(4, 4)
    with pytest.raises(ScheduleError, match=message) as e:
        verify(_replace(s, rank, edit(list(s.actions[rank]))))
    assert e.value.rank == rank


# ---- simulate: activations and bubbles


def test_1f1b_holds_at_most_p_microbatches() -> None:
    for p, m in itertools.product(range(1, 9), range(1, 33)):
        peaks = peak_activations(_build("1f1b", p, m))
        assert peaks == tuple(min(m, p - r) for r in range(p))  # rank 0 holds p: the most
        assert max(peak_activations(_build("zb-h1", p, m))) <= p  # ZB-H1: 1F1B's memory
    assert simulate(one_f_one_b(4, 8)).peak_activations == (4, 3, 2, 1)
    assert simulate(gpipe(4, 8)).peak_activations == (8, 8, 8, 8)


def test_gpipe_and_1f1b_bubble_is_exact() -> None:
    """(p-1)/(m+p-1) of the step, exactly: unit costs everywhere, other costs
    and synchronous batches on a coarser grid."""
    for p, m in itertools.product(range(1, 9), range(1, 33)):
        want = (p - 1) / (m + p - 1)
        for name in ("gpipe", "1f1b"):
            s = _build(name, p, m)
            assert simulate(s, 1, 1, 0).bubble_fraction == want, (name, p, m)
            if m % 8 == 1:
                for costs in ((1, 1, 1), (2, 3, 1)):
                    assert simulate(s, *costs).bubble_fraction == want, (name, p, m, costs)
                    assert simulate(s, *costs, overlap=False).bubble_fraction == want


def test_zb_h1_bubble_is_exact_from_m_equal_p() -> None:
    """(p-1)/(3m) relative to the ideal time 3m with t_F = t_B = t_W; for
    m < p there is no steady state to hide W in: the bubble is larger."""
    for p, m in itertools.product(range(1, 9), range(1, 33)):
        r = simulate(_build("zb-h1", p, m), 1, 1, 1)
        want = (p - 1) / (3 * m)
        if m >= p:
            assert r.bubble_ratio == want and r.makespan == 3 * m + p - 1, (p, m)
        else:
            assert r.bubble_ratio > want, (p, m)
        if m % 4 == 0:
            assert simulate(_build("zb-h1", p, m), 1, 1, 1, overlap=False).makespan == r.makespan
    one = simulate(one_f_one_b(4, 8), 1, 1, 1)  # the same work, 1F1B: (p-1)/m
    assert (one.bubble_ratio, simulate(zb_h1(4, 8)).bubble_ratio) == (3 / 8, 3 / 24)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble(v: int) -> None:
    """(p-1)/(v*m) relative to the ideal time, exactly for m >= p (p need not
    divide m), unit costs and the 1:2 forward:backward ratio, with batches
    overlapping compute; larger for m < p; never smaller with synchronous
    batches."""
    for p in (1, 2, 3, 4, 5, 8):
        for m in sorted({1, p - 1, p, p + 1, 2 * p, 2 * p + 3, 32} - {0}):
            s = _build("interleaved", p, m, v)
            want = (p - 1) / (v * m)
            for costs in ((1, 1, 0), (1, 1, 1)):
                got = simulate(s, *costs).bubble_ratio
                exact = m >= p or v == 1  # v = 1 is 1F1B: exact for every m
                assert got == want if exact else got > want, (p, m, v, costs)
            assert simulate(s, 1, 1, 1, overlap=False).bubble_ratio >= want


def test_simulate_records_and_p2p_cost() -> None:
    s = one_f_one_b(2, 2)
    r = simulate(s, 1, 2, 0, t_p2p=0.5)
    computes = [x for x in r.records if x.action.is_compute]
    assert len(computes) == 8 and r.busy == (6.0, 6.0)
    assert len(r.records) == sum(len(a) for a in s.actions)
    # 9 = (m + p - 1)(t_F + t_B) without message costs; with them rank 1 gets
    # F0 at 1.5, runs F0 B0 F1 B1 to 7.5, and rank 0 gets 1SEND_B1 at 8: B1 ends at 10.
    assert simulate(s, 1, 2, 0).makespan == 9.0 and r.makespan == 10.0
    with pytest.raises(ValueError, match="costs must be >= 0"):
        simulate(s, t_p2p=-1)


# ---- printing, CSV, torch compatibility


def test_tables() -> None:
    s = gpipe(2, 2)
    lines = format_table(s).splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[1].split() == ["Step", "0:", "0F0", "1RECV_F0"] and len(lines) == 9
    assert str(s) == format_table(s)
    t = timed_table(one_f_one_b(2, 2)).splitlines()
    assert t[1].split() == ["t=0", "0F0"] and t[2].split() == ["t=1", "0F1", "1F0"]
    assert t[3].split() == ["t=2", "1B0"] and t[4].split() == ["t=3", "..."]


def test_csv_round_trip() -> None:
    for s in (gpipe(3, 5), one_f_one_b(4, 8), zb_h1(4, 6), interleaved_1f1b(3, 7, 2)):
        text = s.to_csv()
        assert Schedule.from_csv(text) == s
        assert Schedule.from_csv(s.compute_only().to_csv()) == s.compute_only()
        assert with_comms(s.compute_only()) == s
        rows = list(csv.reader(io.StringIO(text)))
        assert rows == [[str(a) for a in acts] for acts in s.actions]
    assert parse_action("1SEND_B3") == Action(Kind.SEND_B, 1, 3)
    assert str(Action(Kind.RECV_F, 2, 0, peer=1)) == "2RECV_F0"
    for bad in ("", "F0", "2X0", "(0F1;1B0)OVERLAP_F_B", "0UNSHARD"):
        with pytest.raises(ValueError, match="invalid action string"):
            parse_action(bad)
    with pytest.raises(ValueError, match="row 1 .*column 2"):
        Schedule.from_csv("0F0,0B0\n1F0,1B0,1Q0\n")
    with pytest.raises(ValueError, match="which rank 0 also runs"):
        Schedule.from_csv("0F0,0B0\n0F1,1B0\n")


def test_torch_reads_our_csv() -> None:
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    for s in (zb_h1(3, 4), interleaved_1f1b(2, 5, 3)):
        for acts, row in zip(s.actions, csv.reader(io.StringIO(s.to_csv())), strict=True):
            theirs = [sched._Action.from_str(cell) for cell in row]
            assert [
                (t.stage_index, t.computation_type.value, t.microbatch_index) for t in theirs
            ] == [(a.stage, a.kind.value, a.microbatch) for a in acts]
            assert [str(t) for t in theirs] == row


def _torch_order(sched, cls, p: int, m: int, v: int) -> dict:
    """torch's compute-only order of `cls`, built without a process group."""
    o = object.__new__(cls)
    o._num_stages, o._n_microbatches, o.pp_group_size, o.n_local_stages = p * v, m, p, v
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    if cls is sched.ScheduleGPipe or cls is sched.Schedule1F1B:
        return o._get_pipeline_order()
    return {r: o._calculate_single_rank_operations(r) for r in range(p)}


def _mod(stage: int, p: int) -> int:
    return stage % p


def _torch_csv(order: dict) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerows(order[r] for r in sorted(order))  # as _dump_csv
    return buf.getvalue()


def test_we_read_and_verify_torch_schedules() -> None:
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cases = [
        (sched.ScheduleGPipe, 4, 8, 1),
        (sched.Schedule1F1B, 4, 8, 1),
        (sched.ScheduleInterleaved1F1B, 4, 8, 2),
        (sched.ScheduleInterleaved1F1B, 2, 6, 3),
    ]
    for cls, p, m, v in cases:
        try:
            order = _torch_order(sched, cls, p, m, v)
        except (AttributeError, TypeError) as e:  # torch internals moved
            pytest.skip(f"torch's {cls.__name__} internals changed: {e}")
        ours = Schedule.from_csv(_torch_csv(order), m=m)  # skips None and REDUCE_GRAD
        kept = [[a for a in order[r] if a is not None and str(a)[-1].isdigit()] for r in range(p)]
        assert [[str(a) for a in acts] for acts in ours.actions] == [
            list(map(str, k)) for k in kept
        ]
        if cls is sched.Schedule1F1B:
            continue  # torch 2.13's display order for it gives rank p-1 3F1 first and 3F8
        assert ours.stage_to_rank == tuple(st % p for st in range(p * v))
        lowered = with_comms(ours)
        verify(lowered)
        if cls is sched.ScheduleInterleaved1F1B:
            assert simulate(lowered, 1, 1, 0).bubble_ratio == (p - 1) / (v * m)
        # torch's own lowering with sends and receives also runs under our model.
        compute = {r: [a for a in order[r] if a is not None] for r in order}
        comm = sched._add_send_recv(compute, functools.partial(_mod, p=p), p * v)
        verify(Schedule.from_csv(_torch_csv(comm)))


# ---- timeline


def test_draw_timeline_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    r = simulate(interleaved_1f1b(2, 3, 2), t_p2p=0.1)
    out = draw_timeline(r.records, tmp_path / "sim.png", title="interleaved")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    measured = [(0, 0.0, 1.5, "0F0"), (1, 1.6, 2.0, "1F0"), (1, 2.0, 3.0, "load data")]
    assert draw_timeline(measured, tmp_path / "measured.png").endswith("measured.png")
    with pytest.raises(ValueError, match="ends before it starts"):
        draw_timeline([(0, 2.0, 1.0, "0F0")], tmp_path / "bad.png")


def test_draw_timeline_without_matplotlib(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(ImportError, match="pip install matplotlib"):
        draw_timeline([(0, 0.0, 1.0, "0F0")], tmp_path / "x.png")


def test_simulate_takes_a_cost_per_stage():
    """Per-stage costs: the same cost on every stage is the scalar's result; a slower last
    stage lengthens 1F1B's step to at least m times its work; one cost per stage or an error."""
    sched = build("1f1b", 4, 8)
    same = simulate(sched, [1.0] * 4, [2.0] * 4, 0.0)
    assert same.makespan == simulate(sched, 1.0, 2.0, 0.0).makespan
    slow = simulate(sched, [1, 1, 1, 3], [2, 2, 2, 6], 0.0)
    assert slow.makespan >= 8 * 9 and slow.busy[3] == 8 * 9
    with pytest.raises(ValueError, match="t_B has 3 costs for 4 stages"):
        simulate(sched, 1.0, [2.0] * 3)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        simulate(sched, [1.0, -1.0, 1.0, 1.0])
