"""The pipeline runtime (strategies/pipeline/runtime.py) on real ranks:
every built-in schedule at p = 2, 4 and m = 1..8 (interleaved with v = 2)
gives gradients and losses bitwise equal to one process accumulating the
same micro-batches through the plain GPT, activations counted at run time
within the schedule's bound, and bad input fails on every rank.

Bitwise is expected: fp32 on the CPU, one thread per rank, and the pipeline
runs the reference's operations in the reference's order (each stage's
forward and backward are the GPT's, micro-batches accumulate in order 0..m-1
on every stage, the loss is divided by m before backward as the reference
divides it; ZB-H1's split linears compute dX, dW and db with autograd's own
calls). One exception, by construction: the tied embedding/head weight. One
process sums its two contributions per micro-batch, sum_j (h_j + e_j); the
pipeline, whose first and last stages are on different ranks, sums each
side over the step and then the two, (sum_j h_j) + (sum_j e_j): a different
association, equal up to rounding. The reference therefore keeps the head's
copy of the weight apart (same value) and adds the two gradients at the end,
as the pipeline does; `test_tied_weight_within_rounding` bounds the
difference from the plain tied GPT (1e-6 of the gradient's largest
element; exact for m = 1).
"""

import dataclasses
import json

import pytest
import torch
from pipeline_cases import SCHEDULES, config, microbatches, reference

import pycollectives as pc
from pycollectives.strategies.pipeline import (
    Action,
    Kind,
    PipelineError,
    PipelineRuntime,
    build,
    chrome_trace,
    draw_measured_and_simulated,
    gpt_stages,
    measure,
    peak_activations,
    simulate,
)
from pycollectives.strategies.pipeline.communications import gather_records
from pycollectives.strategies.pipeline.gpt_stage import TIED


def run_case(comm: pc.Communicator, name: str, v: int, m: int, steps: int = 1) -> dict:
    """One schedule on the pool's ranks; what differs from the reference."""
    s = build(name, comm.world_size, m, v)
    cfg = config(s.num_stages)
    stages = gpt_stages(cfg, s.stages_of(comm.rank), s.num_stages)
    rt = PipelineRuntime(s, stages, comm, timeout=30)
    for _ in range(steps):
        for st in stages:
            st.zero_grad(set_to_none=True)
        result = rt.step(microbatches(m))
    want, losses = reference(cfg, m)
    bad = []
    for st in stages:
        for n, p in st.named_parameters():
            ref = want[TIED if n == "head.weight" else n]
            if p.grad is None or not torch.equal(p.grad, ref):
                diff = "None" if p.grad is None else f"{(p.grad - ref).abs().max():.3g}"
                bad.append(f"stage {st.stage_index} {n}: {diff}")
    if result.losses is not None and result.losses != losses:
        bad.append(f"losses {result.losses} != {losses}")
    return {
        "bad": bad,
        "in_flight": result.peak_in_flight,
        "held": result.peak_held,
        "bytes": result.peak_bytes,
        "records": len(result.records),
    }


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_gradients_bitwise_equal_to_one_process(pool, name, v, p, m):
    s = build(name, p, m, v)
    peaks = peak_activations(s)
    for r, out in enumerate(pool(p).run(run_case, name, v, m, timeout=90)):
        assert out["bad"] == [], (r, out["bad"])
        assert out["held"] == peaks[r], (r, out)  # counted from the stages' own state
        if name == "1f1b":
            assert out["in_flight"] == min(m, p - r) <= p, (r, out)
        if name == "gpipe":
            assert out["in_flight"] == m, (r, out)
        if name == "zb-h1":
            assert out["in_flight"] <= p and out["held"] <= p, (r, out)


def test_second_step_and_activation_bytes(pool):
    """A runtime runs step after step; 1F1B holds fewer bytes than GPipe."""
    p, m = 2, 8
    one = pool(p).run(run_case, "1f1b", 1, m, 2)
    gp = pool(p).run(run_case, "gpipe", 1, m)
    for r in range(p):
        assert one[r]["bad"] == [], one[r]
        assert one[r]["bytes"] * m == gp[r]["bytes"] * min(m, p - r), (one[r], gp[r])


def test_tied_weight_within_rounding():
    cfg = config(2)
    for m in (1, 3, 8):
        split, _ = reference(cfg, m)
        plain, _ = reference(cfg, m, tied=True)
        for n, g in plain.items():
            if n == TIED and m > 1:
                # reassociated sums: off by rounding, relative to the gradient's scale
                assert (split[n] - g).abs().max() <= 1e-6 * g.abs().max(), (m, n)
            else:
                assert torch.equal(split[n], g), (m, n)


def test_trace_and_measure(tmp_path):
    s = build("1f1b", 4, 8)
    sim = simulate(s, 1.0, 2.0, 0.0)
    got = measure(sim.records, s.p)
    assert got.bubble_fraction == sim.bubble_fraction == 3 / 11
    trace = chrome_trace(sim.records)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(sim.records)
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    f = next(e for e in events if e["name"] == "2F0")
    assert f["args"] == {"stage": 2, "microbatch": 0} and f["dur"] == 1e6
    json.dumps(trace)
    pytest.importorskip("matplotlib")
    png = draw_measured_and_simulated(sim.records, sim.records, tmp_path / "t.png", title="1F1B")
    assert (tmp_path / "t.png").stat().st_size > 1000 and png.endswith("t.png")


def job_large_activations(comm: pc.Communicator, name: str) -> list[str]:
    """Activations of 512 KiB (two slots) through the slots (PYCOLL_CMA=0)."""
    s = build(name, comm.world_size, 4)
    cfg = dataclasses.replace(config(s.num_stages), seq_len=1024, n_head=1, d_model=64)
    stages = gpt_stages(cfg, s.stages_of(comm.rank), s.num_stages)
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 32, (2, 1024), generator=g),) * 2 for _ in range(4)]
    result = PipelineRuntime(s, stages, comm, timeout=30).step(mbs)
    return [str(r.action) for r in result.records]


@pytest.mark.parametrize("name", ["gpipe", "zb-h1"])
def test_large_activations_through_the_slots(pool, name):
    for out in pool(2, {"PYCOLL_CMA": "0"}).run(job_large_activations, name, timeout=120):
        assert len(out) > 0


# ---- bad input: the same error on every rank, never a hang


def job_bad_input(comm: pc.Communicator) -> dict[str, str]:
    """Each case on a communicator of its own (a fault aborts it)."""
    p, r, out = comm.world_size, comm.rank, {}
    s = build("1f1b", p, 4)

    def try_(name, fn):
        sub = comm.split(0)
        try:
            fn(sub)
            out[name] = "no error"
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
            if isinstance(e, PipelineError):
                out[name + ".where"] = (e.stage, e.microbatch, e.step, e.iteration)
        finally:
            sub.close()

    def stages(cfg=None, sched=s):
        return gpt_stages(cfg or config(sched.num_stages), sched.stages_of(r), sched.num_stages)

    try_("layers", lambda c: gpt_stages(config(p - 1), s.stages_of(r), p))
    acts = [list(a) for a in s.actions]
    acts[1][0], acts[1][1] = acts[1][1], acts[1][0]  # rank 1 computes before receiving
    broken = dataclasses.replace(s, actions=acts)
    try_("verify", lambda c: PipelineRuntime(broken, stages(), c, timeout=20))
    other = build("1f1b", p, 3) if r == 1 else s
    try_("schedule", lambda c: PipelineRuntime(other, stages(sched=other), c, timeout=20))
    wide = config(p, d_model=32) if r == 1 else config(p)
    try_("shapes", lambda c: PipelineRuntime(s, stages(wide), c, timeout=20).step(microbatches(4)))

    def sharded(c):  # rank 1's stage expects sequence shards (sequence parallelism), rank 0's not
        st = stages()
        st[0].sequence_shards = 2 if r == 1 else 1
        PipelineRuntime(s, st, c, timeout=20).step(microbatches(4))

    try_("sequence_shards", sharded)
    mbs = microbatches(3 if r == 1 else 4)
    try_("count", lambda c: PipelineRuntime(s, stages(), c, timeout=20).step(mbs))

    def skip(c):  # rank 1 does not post its receive of micro-batch 2's activations
        rt = PipelineRuntime(s, stages(), c, timeout=20)
        issue, skipped = rt._issue, Action(Kind.RECV_F, 1, 2, 0)
        if r == 1:
            rt._issue = lambda acts, ops: issue(
                acts, [op for a, op in zip(acts, ops, strict=True) if a != skipped]
            )
        rt.step(microbatches(4))

    try_("skip", skip)

    def crash(c):  # stage 1's forward raises on micro-batch 1 (its second forward)
        st = stages()
        calls = []

        def hook(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("stage forward failed on purpose")

        if r == 1:
            st[0].register_forward_pre_hook(hook)
        PipelineRuntime(s, st, c, timeout=20).step(microbatches(4))

    try_("crash", crash)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_bad_input_raises_on_every_rank(pool, p):
    for r, out in enumerate(pool(p).run(job_bad_input, timeout=120)):
        assert "fewer layers than stages" in out["layers"], out["layers"]
        assert "ValueError" in out["verify"] and "rank 1, step 0 (1F0)" in out["verify"]
        assert "runs before its input is received" in out["verify"], out["verify"]
        assert "ranks [1] run another schedule" in out["schedule"], out["schedule"]
        assert (
            "stage 0 (rank 0) sends float32[2, 8, 16] but stage 1 (rank 1) expects "
            "float32[2, 8, 32]"
        ) in out["shapes"], out["shapes"]
        if p == 2:  # stage 1 alone takes [b, t/2, d] sequence shards
            assert (
                "stage 0 (rank 0) sends float32[2, 8, 16] but stage 1 (rank 1) expects "
                "float32[2, 4, 16]"
            ) in out["sequence_shards"], out["sequence_shards"]
        else:  # rank 1 holds stage 1: both its boundaries disagree
            assert "stage 1 (rank 1) sends float32[2, 4, 16] but stage 2" in out["sequence_shards"]
        assert "microbatches has 3 entries, the schedule m=4" in out["count"], out["count"]
        for case in ("verify", "schedule", "shapes", "sequence_shards", "count"):
            assert f"raised on rank {r}" in out[case], out[case]
        # A skipped receive: every rank raises, naming its stage, micro-batch and step.
        assert out["skip"].startswith("PipelineError: pipeline iteration 0"), out["skip"]
        assert f"rank {r}, " in out["skip"] and out["skip.where"][3] == 0, out["skip"]
        assert "CollectiveMismatch" in out["skip"], out["skip"]
        if r == 1:
            assert "1RECV_F3" in out["skip"], out["skip"]  # the receive that met micro-batch 2
            assert "the two ranks disagree on which message comes next" in out["skip"]
        assert out["crash"].startswith("PipelineError"), out["crash"]
        if r == 1:
            assert "stage 1, micro-batch 1" in out["crash"] and "on purpose" in out["crash"]
        else:
            assert "stop signal" in out["crash"] or "CollectiveMismatch" in out["crash"], out


def rank_dies(rank: int, world_size: int) -> str:
    """Rank 1 dies in its forward of micro-batch 2; the others report."""
    import os

    comm = pc.init(timeout=30)
    s = build("1f1b", world_size, 4)
    stages = gpt_stages(config(s.num_stages), s.stages_of(rank), s.num_stages)
    calls = []

    def die(module, args):
        calls.append(1)
        if len(calls) == 3:
            os._exit(1)

    if rank == 1:
        stages[0].register_forward_pre_hook(die)
    try:
        PipelineRuntime(s, stages, comm, timeout=20).step(microbatches(4))
    except PipelineError as e:
        return f"{type(e.__cause__).__name__}: {e}"
    return "no error"


def test_a_dead_rank_fails_the_others():
    from spawn import run

    out = run(rank_dies, 3, timeout=90, expect_exit={1: 1})
    for r in (0, 2):
        assert out[r].startswith("PeerFailure"), out[r]
        assert f"rank {r}, stage {r}, micro-batch" in out[r] and "rank 1 died" in out[r], out[r]


def job_records(comm: pc.Communicator) -> tuple[int, set]:
    s = build("zb-h1", comm.world_size, 4)
    stages = gpt_stages(config(s.num_stages), s.stages_of(comm.rank), s.num_stages)
    result = PipelineRuntime(s, stages, comm, timeout=30).step(microbatches(4))
    every = gather_records(comm, result.records)
    return len(every), {(r.rank, str(r.action)) for r in every}


def test_records_cover_every_action(pool):
    s = build("zb-h1", 2, 4)
    want = {(r, str(a)) for r, acts in enumerate(s.actions) for a in acts}
    for n, got in pool(2).run(job_records):
        assert n == len(want) and got == want


def job_interrupted(comm: pc.Communicator) -> str:
    """Rank 1's stage forward raises KeyboardInterrupt (Ctrl-C in Python
    code, not in a pycollectives wait) on its second micro-batch."""
    s = build("1f1b", comm.world_size, 4)
    sub = comm.split(0)  # aborted by the interrupt
    stages = gpt_stages(config(s.num_stages), s.stages_of(comm.rank), s.num_stages)
    calls = []

    def ctrl_c(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    if comm.rank == 1:
        stages[0].register_forward_pre_hook(ctrl_c)
    try:
        PipelineRuntime(s, stages, sub, timeout=20).step(microbatches(4))
        return "no error"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except PipelineError as e:
        return f"{type(e.__cause__).__name__}: {e}"
    finally:
        sub.close()


def test_an_interrupted_rank_is_named_not_a_mismatch(pool):
    """Its peers say that rank 1 was interrupted: not a stop signal (a failed
    step) nor, for a peer waiting for an end mark, a send/recv mismatch."""
    out = pool(2).run(job_interrupted, timeout=90)
    assert out[1] == "KeyboardInterrupt", out
    assert out[0].startswith("CommunicatorAborted"), out[0]
    assert "rank 1 was interrupted (SIGINT)" in out[0], out[0]
    assert "stop signal" not in out[0] and "ismatch" not in out[0], out[0]
