"""3D parallelism (strategies/parallel3d/) on local ranks: dp x tp x pp
training of a tiny GPT matches one process training the same global batches
(4 steps: the first sets up and the next ones run as every later step does;
one process learns over 20); the start is layout-invariant (the full initial weights and the
global order of samples, gathered from the ranks, are those of one process);
bad input raises on every rank. With pp = 1, ZeRO-2/3 and FSDP on the dp
axis (plain gradient accumulation, tensor-parallel blocks inside).

Tolerance: float64 on the CPU. The layouts sum the same numbers in other
orders (tensor-parallel partial sums, micro-batch accumulation, the data-
parallel average, the tied weight's two halves), so they agree with one
process up to rounding: after 20 AdamW steps the losses within 1e-12 and
every parameter within 1e-10 (measured: about 3e-14; the layouts run 4).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import pycollectives as pc
from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
from pycollectives.strategies.models import GPT, GPTConfig
from pycollectives.strategies.parallel3d import Trainer3D, TrainOptions
from pycollectives.strategies.parallel_dims import ParallelDims

STEPS = 20  # one process's run, which learns (test_one_process_learns)
LAYOUT_STEPS = 4  # each layout against the first steps of that run
CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, d_model=16, seed=5)
OPTIONS = TrainOptions(microbatches=2, global_batch=8, dtype=torch.float64, timeout=60)


@functools.cache
def reference(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    """One process: initial weights, losses and final weights of `steps`
    steps of AdamW over the whole global batches."""
    model = GPT(CONFIG, dtype=torch.float64)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    o = OPTIONS
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    data = SyntheticSequences(CONFIG.vocab_size, CONFIG.seq_len, o.num_samples, seed=o.data_seed)
    batches = GlobalBatches(o.num_samples, o.global_batch, seed=o.data_seed)
    losses = []
    for k in range(steps):
        x, y = data.batch(batches.global_ids(k))
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return start, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def job_train(
    comm: pc.Communicator, dp: int, tp: int, pp: int, change: dict, steps: int = STEPS
) -> dict:
    """Trains `steps` steps; returns what the test compares (numpy: no shared memory)."""
    with ParallelDims(comm, dp=dp, tp=tp, pp=pp) as dims:
        trainer = Trainer3D(dims, CONFIG, dataclasses.replace(OPTIONS, **change))
        start = trainer.full_parameters()
        ids = [trainer.batches.ids(k).tolist() for k in range(3)]
        gathers = dims.dp_comm.stats().get("all_gather", {}).get("calls", 0)
        losses = [trainer.step().loss for _ in range(steps)]
        gathers = dims.dp_comm.stats().get("all_gather", {}).get("calls", 0) - gathers
        end = trainer.full_parameters()
        coords = (dims.dp_rank, dims.tp_rank, dims.pp_rank)
        early = trainer.averager.early if trainer.averager else None
        # FSDP with pp > 1: reductions per stage (one per step: every backward unsynced)
        reduced = [(r.sharding_unit.engine.step, r.sharding_unit.engine.micro)
                   for r in trainer.fsdp_roots]  # fmt: skip
        units = sum(  # those with parameters of their own (an inner stage's root has none)
            bool(u.flats) for r in trainer.fsdp_roots for u in r.sharding_unit.engine.units
        )
    as_np = lambda d: {n: t.cpu().numpy() for n, t in d.items()}  # noqa: E731
    return dict(
        coords=coords,
        early=early,
        reduced=reduced,
        gathers_per_unit_and_step=gathers / (units * steps) if units else None,
        ids=ids,
        losses=losses,
        start=as_np(start),
        end=as_np(end),
    )


LAYOUTS = [  # (dp, tp, pp, options)
    (2, 2, 2, {"schedule": "1f1b"}),
    (2, 1, 2, {"schedule": "gpipe"}),
    (1, 2, 2, {"schedule": "zbh1"}),
    (2, 1, 2, {"schedule": "zbh1"}),  # split linears (W outside autograd) under dp
    (2, 1, 2, {"schedule": "interleaved", "zero": 1}),
    # sequence parallelism across stages: [b, t/tp, d] shards between them
    (1, 2, 2, {"schedule": "1f1b", "sequence_parallel": True}),
    (1, 2, 2, {"schedule": "gpipe", "sequence_parallel": True}),
    (1, 2, 2, {"schedule": "interleaved", "sequence_parallel": True}),
    (1, 2, 2, {"schedule": "zbh1", "sequence_parallel": True}),
    # FSDP per stage (reduce-scatter after the step, after the tied sum)
    (2, 1, 2, {"schedule": "1f1b", "fsdp": True}),
    (2, 1, 2, {"schedule": "interleaved", "fsdp": True}),
    (2, 2, 2, {"schedule": "gpipe", "fsdp": True}),
    # pp = 1: ZeRO-2/3 and FSDP on the dp axis, tensor-parallel blocks inside
    (2, 2, 1, {"zero": 2}),
    (2, 2, 1, {"zero": 3}),
    (2, 2, 1, {"fsdp": True}),
]


@pytest.mark.parametrize(
    "dp,tp,pp,change",
    LAYOUTS,
    ids=[
        f"dp{d}-tp{t}-pp{p}-" + "-".join(f"{k}={v}" for k, v in c.items()) for d, t, p, c in LAYOUTS
    ],
)
def test_3d_matches_one_process(pool, dp, tp, pp, change):
    check_layout(pool, dp, tp, pp, change, LAYOUT_STEPS)


def test_one_process_learns():
    """The reference the layouts match learns: 20 steps cut the loss by 0.2."""
    _, losses, _ = reference(STEPS)
    assert losses[-1] < losses[0] - 0.2, losses


def test_3d_zbh1_tensor_parallel_under_dp(pool):
    """dp=2 x tp=2 x pp=2 under ZB-H1: the tensor-parallel layers' weight
    gradients come in W, after their hooks fired in I; the averager sends
    them after the step (sending them in I, as it did the split linears'
    before they were late, is off after 3 steps). 3 steps: 8 processes."""
    check_layout(pool, 2, 2, 2, {"schedule": "zbh1"}, 3)


def job_messages(comm: pc.Communicator, sp: bool, steps: int) -> dict:
    """tp=2 x pp=2, 1F1B: the losses, the final weights and the pipeline
    communicator's batch_p2p bytes over `steps` steps."""
    with ParallelDims(comm, dp=1, tp=2, pp=2) as dims:
        trainer = Trainer3D(dims, CONFIG, dataclasses.replace(OPTIONS, sequence_parallel=sp))
        losses = [trainer.step().loss for _ in range(steps)]
        end = {n: t.numpy() for n, t in trainer.full_parameters().items()}
        sent = dims.pp_comm.stats()["batch_p2p"]["bytes_sent"]
    return dict(losses=losses, end=end, sent=sent)


def test_sequence_parallel_stages_send_sequence_shards(pool):
    """tp=2 x pp=2 (1F1B) with and without sequence parallelism: the same
    training (losses within 1e-12, weights within 1e-10), and each
    activation or activation gradient between the stages is the rank's
    [b, t/2, d] sequence shard: half the bytes."""
    steps, m = 3, OPTIONS.microbatches
    plain, sp = (pool(4).run(job_messages, flag, steps, timeout=120) for flag in (False, True))
    b, t, d = OPTIONS.global_batch // m, CONFIG.seq_len, CONFIG.d_model
    tied = CONFIG.vocab_size // 2 * d * 8  # the tied weight's tp shard, float64
    for a, s in zip(plain, sp, strict=True):
        assert max(abs(x - y) for x, y in zip(a["losses"], s["losses"], strict=True)) <= 1e-12
        for name, v in a["end"].items():
            assert abs(v - s["end"][name]).max() <= 1e-10, name
        # per step and rank: m activations (or their gradients) and the tied gradient
        assert a["sent"] == steps * (m * b * t * d * 8 + tied), a["sent"]
        assert s["sent"] == steps * (m * b * (t // 2) * d * 8 + tied), s["sent"]


def check_layout(pool, dp: int, tp: int, pp: int, change: dict, steps: int) -> None:  # noqa: ANN001
    """Trains `steps` steps with dp x tp x pp and compares with one process."""
    start, losses, end = reference(steps)
    out = pool(dp * tp * pp).run(job_train, dp, tp, pp, change, steps, timeout=240)
    got_start, got_end = {}, {}
    ids: dict[int, list] = {}
    for r in out:
        dp_rank = r["coords"][0]
        assert ids.setdefault(dp_rank, r["ids"]) == r["ids"], "ranks of one dp group differ"
        for name, v in r["start"].items():  # layout-invariant start: bitwise the same weights
            t = torch.from_numpy(v)
            assert torch.equal(t, start[name]), (r["coords"], name)
            got_start[name] = t
        got_end.update({n: torch.from_numpy(v) for n, v in r["end"].items()})
        plain = not (change.get("zero") or change.get("fsdp"))
        if dp > 1 and plain and change["schedule"] != "zbh1":
            assert r["early"] >= 1, r["early"]  # a bucket's all-reduce overlapped the step
        if change.get("fsdp") and pp > 1:  # one reduce-scatter per unit and step, after it
            assert r["reduced"] and set(r["reduced"]) == {(steps, 0)}, r["reduced"]
            # and one all-gather: units stay gathered through the step's micro-batches
            assert r["gathers_per_unit_and_step"] == 1, r["gathers_per_unit_and_step"]
        worst = max(abs(a - b) for a, b in zip(r["losses"], losses, strict=True))
        assert worst <= 1e-12, (r["coords"], worst)
    assert set(got_start) == set(start) == set(got_end)
    batches = GlobalBatches(OPTIONS.num_samples, OPTIONS.global_batch, seed=OPTIONS.data_seed)
    for k in range(3):  # the global order of samples: the dp shares, in dp order
        assert sum((ids[d][k] for d in range(dp)), []) == batches.global_ids(k).tolist()
    for name, want in end.items():
        diff = (got_end[name] - want).abs().max().item()
        assert diff <= 1e-10, (name, diff)


# ---- on CUDA: the same training as on the CPU


CUDA_OK = bool(getattr(pc._C, "cuda_built", lambda: False)()) and torch.cuda.is_available()
CUDA_LAYOUTS = [  # 2 ranks on cuda:(rank % GPUs); (dp, tp, pp, options)
    (1, 1, 2, {"schedule": "1f1b"}),  # activations through the host, tied gradient summed
    (1, 2, 1, {"schedule": "1f1b", "sequence_parallel": True}),  # TP collectives on CUDA
    (2, 1, 1, {"schedule": "1f1b"}),  # the dp average on CUDA buckets
]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA build of pycollectives and a GPU")
@pytest.mark.parametrize("dp,tp,pp,change", CUDA_LAYOUTS, ids=["pp2", "tp2-sp", "dp2"])
def test_3d_on_cuda_matches_one_process(pool, dp, tp, pp, change):
    """device="cuda", 2 ranks, 1F1B: the CUDA run matches one process on
    the CPU (float64) within the bounds of the CPU layouts."""
    check_layout(pool, dp, tp, pp, {**change, "device": "cuda"}, STEPS)


# ---- bad input: the same error on every rank, never a hang


def job_bad_input(comm: pc.Communicator) -> dict[str, str]:
    """Each case on a communicator of its own."""
    out = {}

    def try_(name: str, sizes: tuple[int, int, int], cfg: GPTConfig = CONFIG, **change) -> None:
        sub = comm.split(0)
        try:
            with ParallelDims(sub, dp=sizes[0], tp=sizes[1], pp=sizes[2]) as dims:
                Trainer3D(dims, cfg, dataclasses.replace(OPTIONS, **change))
            out[name] = "no error"
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            sub.close()

    try_("dims", (2, 2, 2))
    try_("heads", (1, 2, 2), dataclasses.replace(CONFIG, n_head=3, d_model=18))
    try_("vocab", (1, 2, 2), dataclasses.replace(CONFIG, vocab_size=33))
    try_("layers", (1, 1, 4), dataclasses.replace(CONFIG, n_layer=3))
    try_("interleaved", (2, 1, 2), schedule="interleaved", virtual_stages=3)
    try_("zero2", (2, 1, 2), zero=2)
    try_("fsdp", (2, 1, 2), fsdp=True, schedule="zbh1")
    try_("both", (4, 1, 1), fsdp=True, zero=1)
    try_("batch", (2, 1, 2), global_batch=6)
    try_("schedule", (1, 1, 4), schedule="zbh2")
    try_("device", (2, 1, 2), device="cuda")
    # ranks that disagree: rank 1 asks for other micro-batches
    try_("differ", (2, 1, 2), microbatches=4 if comm.rank == 1 else 2)
    return out


def test_bad_input_raises_on_every_rank(pool):
    for r, out in enumerate(pool(4).run(job_bad_input, timeout=120)):
        assert out["dims"].startswith("ValueError") and "dp=2 x tp=2 x pp=2 = 8" in out["dims"]
        assert "world size is 4" in out["dims"], out["dims"]
        assert "n_head=3 is not divisible by --tp 2" in out["heads"], out["heads"]
        assert "vocab_size=33 is not divisible by --tp 2" in out["vocab"], out["vocab"]
        assert "fewer layers than stages: n_layer=3" in out["layers"], out["layers"]
        assert "--pp 2 x 3 stages per rank = 6 stages" in out["interleaved"], out["interleaved"]
        assert "--zero 2 with --pp 2 does not compose with the pipeline" in out["zero2"]
        assert "--fsdp with --pp 2 and --schedule zbh1 does not compose" in out["fsdp"]
        assert "--fsdp and --zero 1: choose one" in out["both"], out["both"]
        assert "--batch 6 is not divisible by --dp 2 x --microbatches 2" in out["batch"]
        assert "--schedule 'zbh2' is not one of" in out["schedule"], out["schedule"]
        if CUDA_OK:
            assert out["device"] == "no error", out["device"]
        else:  # every rank names the flag and each rank
            for q in range(4):
                assert f"--device cuda: rank {q}: " in out["device"], out["device"]
        assert "ranks [1] train another model or with other options" in out["differ"]
        for case, text in out.items():
            assert text.startswith("ValueError"), (case, text)
            if case != "dims":  # ParallelDims's own message names the rank its own way
                assert f"raised on rank {r}" in text, (case, text)


# ---- StepGradAverager alone


def job_averager(comm: pc.Communicator) -> dict:
    from torch import nn

    from pycollectives.strategies.data_parallel.grad_average import StepGradAverager

    def net() -> nn.Module:
        torch.manual_seed(0)  # the same weights on every rank
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def batch(r: int, j: int) -> torch.Tensor:
        return torch.full((3, 4), float(r + j))

    model, ref, w = net(), net(), comm.world_size
    named = list(model.named_parameters())
    avg = StepGradAverager(named, comm, accumulations=2, late=[model[1].weight])
    for j in range(2):  # two micro-batches: the early buckets go in the second backward
        model(batch(comm.rank, j)).sum().backward()
    avg.finish()
    early = avg.early
    for r in range(w):  # one process, every rank's micro-batches
        for j in range(2):
            ref(batch(r, j)).sum().backward()
    want = dict(ref.named_parameters())
    bad = [n for n, p in named if not torch.allclose(p.grad, want[n].grad / w, atol=1e-6)]
    for p in model.parameters():
        p.grad = None
    for j in range(3):  # a third backward after the buckets were sent
        model(batch(comm.rank, j)).sum().backward()
    try:
        avg.finish()
        overflow = "no error"
    except RuntimeError as e:
        overflow = str(e)
    return dict(early=early, bad=bad, overflow=overflow)


def test_step_grad_averager(pool):
    """Averages the step's accumulated gradients; the non-late bucket's
    all-reduce starts during the last backward; a gradient arriving after its
    bucket was sent raises on every rank."""
    for r, out in enumerate(pool(2).run(job_averager, timeout=60)):
        assert out["bad"] == [] and out["early"] == 1, out
        assert f"rank {r}: parameters ['1.bias', '0.bias', '0.weight']" in out["overflow"], out
