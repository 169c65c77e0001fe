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

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from torch import nn

import pycollectives as pc
from strategies.mesh import ParallelDims
from strategies.models import GPT, GPTConfig
from strategies.pipeline import (
    Action,
    AutogradStage,
    Kind,
    PipelineError,
    PipelineRuntime,
    SplitLinear,
    SplitLMHead,
    WeightGradStore,
    balance,
    build,
    chrome_trace,
    deferred_parameters,
    draw_measured_and_simulated,
    gpt_stages,
    layer_split,
    measure,
    peak_activations,
    simulate,
)
from strategies.pipeline.communications import gather_records
from strategies.pipeline.stage import TIED
from strategies.tensor_parallel import parallelize_gpt

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))
B, T = 2, 8


def config(num_stages: int, **change) -> GPTConfig:
    """The tiny GPT: one block per stage, d_model 16, vocab 32, seq 8."""
    cfg = GPTConfig(vocab_size=32, seq_len=T, n_layer=num_stages, n_head=2, d_model=16, seed=3)
    return dataclasses.replace(cfg, **change)


def microbatches(m: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 32, (B, T), generator=g), torch.randint(0, 32, (B, T), generator=g))
        for _ in range(m)
    ]


@functools.cache
def reference(cfg: GPTConfig, m: int, tied: bool = False) -> tuple[dict, list[float]]:
    """Gradients (by global name) and losses of one process accumulating the
    m micro-batches, loss / m each. Untied (default): the head's copy of the
    tied weight is a separate Parameter, its gradient added to the
    embedding's at the end, as the pipeline adds them."""
    model = GPT(cfg)
    if not tied:
        model.head.weight = nn.Parameter(model.embed.tok.weight.detach().clone())
    losses = []
    for x, y in microbatches(m):
        loss = model(x, y)
        (loss / m).backward()
        losses.append(float(loss.detach()))
    grads = {n: p.grad for n, p in model.named_parameters()}
    if not tied:
        grads[TIED] = grads[TIED] + grads.pop("head.weight")
    return grads, losses


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


# ---- single process: the split, the stages, the split backward, the trace


def test_layer_split_balances_parameters():
    assert balance([1] * 8, 4) == [2, 2, 2, 2]
    assert balance([1] * 8, 4, first=3) == [1, 2, 2, 3]
    assert balance([5, 1, 1, 1, 1], 2) == [1, 4]
    big = config(8, vocab_size=4096)  # the embedding and head outweigh blocks
    sizes = [len(r) for r in layer_split(big, 4)]
    assert sum(sizes) == 8 and sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes
    assert [len(r) for r in layer_split(config(8), 3, [2, 5, 1])] == [2, 5, 1]
    for bad in ([2, 5], [0, 7, 1], [2, 2, 2]):
        with pytest.raises(ValueError, match="split="):
            layer_split(config(8), 3, bad)
    with pytest.raises(
        ValueError, match="fewer layers than stages: n_layer=3 blocks cannot fill 4"
    ):
        gpt_stages(config(3), [0], 4)


def test_stages_are_the_gpt_cut_apart():
    cfg = config(5)
    gpt = GPT(cfg)
    stages = gpt_stages(cfg, range(3), 3, split=[2, 1, 2])
    full = dict(gpt.named_parameters())
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.equal(p, full[TIED if n == "head.weight" else n]), n
        assert len(st.blocks) == cfg.n_layer  # global indices: Identity elsewhere
    assert stages[2].head.weight is stages[0].embed.tok.weight  # one rank: shared
    x, y = microbatches(1)[0]
    h = stages[1](stages[0](x))
    assert torch.equal(stages[2](h, y), gpt(x, y))


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5, 16), (16, 16)])
def test_split_linear_is_nn_linear_bitwise(shape):
    torch.manual_seed(0)
    ref = nn.Linear(16, 24)
    store = WeightGradStore()
    split = SplitLinear.from_linear(nn.Linear(16, 24), store)
    with torch.no_grad():
        split.weight.copy_(ref.weight)
        split.bias.copy_(ref.bias)
    x = torch.randn(*shape)
    dy = torch.randn(*shape[:-1], 24)
    xr, xs, xo = (x.clone().requires_grad_() for _ in range(3))
    ref(xr).backward(dy)
    with store.microbatch(0):
        out = split(xs)
    out.backward(dy)  # I: dX only
    assert torch.equal(xs.grad, xr.grad) and split.weight.grad is None
    store.backward_weight(0)  # W: dW = dY^T X, db = sum(dY)
    assert torch.equal(split.weight.grad, ref.weight.grad)
    assert torch.equal(split.bias.grad, ref.bias.grad)
    split.zero_grad(set_to_none=True)
    split(xo).backward(dy)  # outside a micro-batch: every gradient now, as nn.Linear
    assert torch.equal(xo.grad, xr.grad) and torch.equal(split.weight.grad, ref.weight.grad)


def test_split_lm_head_is_lm_head_bitwise():
    cfg = config(1)
    ref, other = GPT(cfg).head, GPT(cfg).head
    store = WeightGradStore()
    head = SplitLMHead.from_head(other, store)
    x, y = torch.randn(B, T, 16), torch.randint(0, 32, (B, T))
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr, y).backward()
    with store.microbatch(0):
        loss = head(xs, y)
    loss.backward()
    store.backward_weight(0)
    assert torch.equal(xs.grad, xr.grad) and torch.equal(head.weight.grad, ref.weight.grad)
    assert torch.equal(head.ln_f.weight.grad, ref.ln_f.weight.grad)


def test_split_backward_frees_its_graph():
    """After I and W nothing of a micro-batch stays alive (a stashed X with
    its grad_fn once tied the stash to the graph in a cycle through
    autograd's C++ nodes: every step's activations leaked)."""
    import gc

    cfg = dataclasses.replace(config(2), seq_len=64)
    stage = gpt_stages(cfg, [0], 2)[0]
    ex = AutogradStage(stage, 0, 2, 3, split_weights=True)
    x = torch.randint(0, 32, (4, 64))

    def live() -> int:
        gc.collect()
        return sum(type(o) is torch.Tensor and o.numel() >= 4096 for o in gc.get_objects())

    before = live()
    for _ in range(2):
        for j in range(3):
            ex.forward(j, x, None)
        for j in range(3):
            ex.backward_input(j, torch.ones(4, 64, 16))
            ex.backward_weight(j)
        assert ex.activations() == (0, 0, 0)
        assert live() == before


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


# ---- with tensor parallelism: stages keep global names, parallelize_gpt applies


def _watch_w(rt: PipelineRuntime, names: dict[int, str], seen: dict[str, bool]) -> None:
    """Records, for each parameter W accumulates into, whether it had no
    .grad right before the step's first W and had one right after (seen)."""
    for st in rt.stages.values():
        store, run_w = st.store, st.store.backward_weight

        def watched(j: int, store=store, run_w=run_w) -> None:  # noqa: ANN001
            params = store.parameters(j)
            before = [p.grad is None for p in params]
            run_w(j)
            for p, none in zip(params, before, strict=True):
                n = names[id(p)]
                seen[n] = seen.get(n, True) and (none or j > 0) and p.grad is not None

        store.backward_weight = watched


def job_tp_pp(comm: pc.Communicator) -> dict:
    """tp=2 x pp=2, 1F1B and ZB-H1 (the tensor-parallel layers split): each
    against one process; ZB-H1 against 1F1B; what ZB-H1's W computed."""
    m = 4
    out: dict = {"bad": [], "grads": {}}
    with ParallelDims(comm, tp=2, pp=2) as dims:
        cfg = config(4)
        ref = GPT(cfg, dtype=torch.float64)
        for x, y in microbatches(m):
            (ref(x, y) / m).backward()
        want = dict(ref.named_parameters())
        for name in ("1f1b", "zb-h1"):
            s = build(name, 2, m)
            stages = gpt_stages(cfg, s.stages_of(dims.pp_rank), 2, dtype=torch.float64)
            stages = [parallelize_gpt(st, dims) for st in stages]
            rt = PipelineRuntime(s, stages, dims.pp_comm, timeout=30)
            seen: dict[str, bool] = {}
            _watch_w(rt, {id(p): n for n, p in stages[0].named_parameters()}, seen)
            rt.step(microbatches(m))
            out["grads"][name] = {n: p.grad.clone() for n, p in stages[0].named_parameters()}
            if name == "zb-h1":
                out["w"] = seen
                out["in_i"] = sorted(
                    n for n, p in stages[0].named_parameters() if id(p) not in
                    {id(q) for q in deferred_parameters(stages)}
                )  # fmt: skip
            for n, p in stages[0].named_parameters():
                full = want[TIED if n in ("head.weight",) else n].grad
                every = p.grad.new_empty((2, *p.grad.shape))
                dims.tp_comm.all_gather(every, p.grad.contiguous())
                split = [d for d in range(p.dim()) if p.shape[d] != full.shape[d]]
                got = torch.cat(list(every), split[0]) if split else every[0]
                if not torch.allclose(got, full, rtol=1e-10, atol=1e-12):
                    out["bad"].append(f"{name} {n}: {(got - full).abs().max():.3g}")
        out["stage"] = dims.pp_rank
    return out


def test_pipeline_with_tensor_parallel_stages(pool):
    """tp=2 x pp=2 matches one process (within rounding: tp sums partial
    products) under 1F1B and ZB-H1; under ZB-H1 the tensor-parallel layers'
    weights and biases get their gradients in W only (none before the first
    W, all of them after it), every other parameter in I, and the gradients
    are bitwise those of 1F1B's unsplit layers."""
    for r, out in enumerate(pool(4).run(job_tp_pp, timeout=120)):
        assert out["bad"] == [], (r, out["bad"])
        one, zb = out["grads"]["1f1b"], out["grads"]["zb-h1"]
        differ = [n for n in one if not torch.equal(one[n], zb[n])]
        assert differ == [], (r, differ)
        tp_layers = {n for n in one if ".attn." in n or ".mlp." in n or n == "head.weight"}
        assert set(out["w"]) == tp_layers and all(out["w"].values()), (r, out["w"])
        assert set(out["in_i"]) == set(one) - tp_layers, (r, out["in_i"])
        if out["stage"] == 0:  # embedding, layer norms; stage 1: its layer norms and ln_f
            assert "embed.tok.weight" in out["in_i"], out["in_i"]
        else:
            assert "head.weight" in out["w"], out["w"]


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


def job_split_tp_layers(comm: pc.Communicator, sp: bool) -> dict:
    """One tp=2 stage, with or without sequence parallelism: F, I, W of two
    micro-batches through the split layers against F, B of unsplit ones; then
    the split layers outside a micro-batch (every gradient in backward)."""
    m = 2
    with ParallelDims(comm, tp=2) as dims:
        cfg = config(2, tie_embeddings=False)
        split, plain = (
            AutogradStage(parallelize_gpt(gpt_stages(cfg, [0], 1, dtype=torch.float64)[0], dims,
                                          sequence_parallel=sp), 0, 1, m, split_weights=s)
            for s in (True, False)
        )  # fmt: skip
        for j, (x, y) in enumerate(microbatches(m)):
            split.forward(j, x, y)
            plain.forward(j, x, y)
        for j in range(m):
            split.backward_input(j, None)
            plain.backward(j, None)
        named = dict(split.module.named_parameters())
        after_i = sorted(n for n, p in named.items() if p.grad is None)
        deferred = {id(p) for p in deferred_parameters([split.module])}
        for j in range(m):
            split.backward_weight(j)
        want = dict(plain.module.named_parameters())

        def bad() -> list[str]:
            return [
                f"{n}: {(p.grad - want[n].grad).abs().max():.3g}"
                for n, p in named.items()
                if not torch.allclose(p.grad, want[n].grad, rtol=1e-10, atol=1e-12)
            ]

        bad_w = bad()
        for p in named.values():
            p.grad = None
        for x, y in microbatches(m):
            (split.module(x, y) / m).backward()
        return dict(
            after_i=after_i,
            deferred=sorted(n for n, p in named.items() if id(p) in deferred),
            bad_w=bad_w,
            bad_outside=bad(),
        )


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_split_tensor_parallel_layers(pool, sp):
    """The split tensor-parallel layers' gradients equal the unsplit layers'
    (within rounding), with and without sequence parallelism; after I the
    column- and row-parallel weights and biases and the head's weight have
    none, except the row-parallel bias under sequence parallelism (summed
    across tp, a communication, so computed in I)."""
    for r, out in enumerate(pool(2).run(job_split_tp_layers, sp, timeout=60)):
        assert out["bad_w"] == [] and out["bad_outside"] == [], (r, out)
        tp_layers = [f"blocks.{b}.{layer}.{p}" for b in range(2)
                     for layer in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
                     for p in ("bias", "weight")]  # fmt: skip
        if sp:
            tp_layers = [n for n in tp_layers if not n.endswith("proj.bias")]
        assert out["after_i"] == out["deferred"] == sorted([*tp_layers, "head.weight"]), (r, out)
