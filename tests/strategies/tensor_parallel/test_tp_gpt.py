"""parallelize_gpt against the plain GPT: a block, the whole model, training
with dp x tp (DistributedDataParallel over dims.dp_comm), the layout-invariant
start, the overlap of the input-gradient all-reduce, and bad input.

Random data in float64: tensor parallelism changes only the order of sums
(tp partial dot products, the vocabulary summed in pieces, DDP averaging), so
the results agree to ~1e-15 relative; the tolerances (1e-12, and 1e-10 after
AdamW steps) leave room for that and nothing more. Where the arithmetic is the
same (tp = 1, dp = 1; the initial weights) the checks are bitwise.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pycollectives as pc
from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel
from pycollectives.strategies.models import GPT, GPTConfig
from pycollectives.strategies.parallel_dims import ParallelDims
from pycollectives.strategies.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallelize_gpt,
)

# Heads, vocabulary, MLP width and sequence divisible by 1, 2, 3 and 4.
CFG = GPTConfig(vocab_size=24, seq_len=12, n_layer=2, n_head=12, d_model=24, seed=7)
B, T = 2, 12


def gather_full(local: torch.Tensor, full_shape: torch.Size, comm: pc.Communicator):
    """The full tensor from the tp ranks' shards (the dimension whose size differs);
    for a replicated tensor, its value if every rank holds the same bits, else None."""
    every = local.new_empty((comm.world_size, *local.shape))
    comm.all_gather(every, local.detach().contiguous())
    split = [d for d in range(local.dim()) if local.shape[d] != full_shape[d]]
    if not split:
        return local if all(torch.equal(e, every[0]) for e in every) else None
    return torch.cat(list(every), dim=split[0])


def compare(bad: list[str], tag: str, model: nn.Module, plain: nn.Module, comm, tol, grads=True):
    """Appends to `bad` each parameter (and gradient) of `model`, gathered over
    tp, that differs from `plain`'s by more than tol (tol 0: bitwise)."""
    ref = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        q = ref[name]
        for what, got, want in [("", p, q)] + ([(".grad", p.grad, q.grad)] if grads else []):
            full = gather_full(got, want.shape, comm)
            if full is None:
                bad.append(f"{tag} {name}{what}: replicas differ across tp")
            elif tol == 0 and not torch.equal(full, want):
                bad.append(f"{tag} {name}{what}: not bitwise equal")
            elif not torch.allclose(full, want, rtol=tol, atol=tol):
                bad.append(f"{tag} {name}{what}: max |diff| {(full - want).abs().max():.3g}")


def job_block(comm: pc.Communicator, sp: bool, dropout: float) -> list[str]:
    bad: list[str] = []
    cfg = dataclasses.replace(CFG, n_layer=1, dropout=dropout)
    with ParallelDims(comm, tp=comm.world_size) as dims:
        plain = perturbed(cfg).blocks[0]
        block = parallelize_gpt(perturbed(cfg), dims, sequence_parallel=sp).blocks[0]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(B, T, cfg.d_model, generator=g, dtype=torch.float64)
        dy = torch.randn(B, T, cfg.d_model, generator=g, dtype=torch.float64)
        n, r = comm.world_size, comm.rank
        local = (lambda t: t.chunk(n, 1)[r]) if sp else (lambda t: t)
        x_ref, x_in = x.clone().requires_grad_(), local(x).clone().requires_grad_()
        torch.manual_seed(3)  # the same dropout masks, drawn alike on every rank
        y_ref = plain(x_ref)
        y_ref.backward(dy)
        torch.manual_seed(3)
        y = block(x_in)
        y.backward(local(dy))
        tag = f"block sp={sp} dropout={dropout}"
        tol = 0 if n == 1 else 1e-12  # tp = 1: the same operations
        for what, got, want in (("y", y, local(y_ref)), ("dx", x_in.grad, local(x_ref.grad))):
            if not torch.allclose(got, want, rtol=tol, atol=tol) or (
                tol == 0 and not torch.equal(got, want)
            ):
                bad.append(f"{tag} {what}: max |diff| {(got - want).abs().max():.3g}")
        compare(bad, tag, block, plain, dims.tp_comm, tol)
    return bad


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_block_matches_plain(pool, tp):
    for sp in (False, True):
        for dropout in (0.0, 0.25):
            for r, bad in enumerate(pool(tp).run(job_block, sp, dropout, timeout=60)):
                assert not bad, f"rank {r}: {bad}"


def perturbed(cfg: GPTConfig) -> GPT:
    """A float64 GPT whose parameters are all moved off their initial values
    (zero biases, unit norms), the same way on every rank."""
    model = GPT(cfg, torch.float64)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def job_gpt(comm: pc.Communicator, sp: bool) -> list[str]:
    """Loss, every gradient and the logits of the whole model (with dropout:
    the same masks, drawn alike on every rank); tp = 1 bitwise."""
    bad: list[str] = []
    tol = 0 if comm.world_size == 1 else 1e-12  # tp = 1: the same operations
    cfg = dataclasses.replace(CFG, dropout=0.1)
    with ParallelDims(comm, tp=comm.world_size) as dims:
        plain = perturbed(cfg)
        model = parallelize_gpt(perturbed(cfg), dims, sequence_parallel=sp)
        compare(bad, f"sp={sp} sharded", model, plain, dims.tp_comm, 0, grads=False)
        x, y = SyntheticSequences(CFG.vocab_size, T, 8, seed=1).batch(torch.arange(B))
        y[0, 0] = -100  # ignored, as F.cross_entropy does
        losses = []
        for m in (model, plain):
            torch.manual_seed(5)
            losses.append(m(x, y))
            losses[-1].backward()
        if not torch.allclose(*losses, rtol=tol, atol=tol):
            bad.append(f"sp={sp} loss {losses[0].item()} != {losses[1].item()}")
        compare(bad, f"sp={sp}", model, plain, dims.tp_comm, tol)
        model.eval()
        plain.eval()
        with torch.no_grad():
            logits, want = model(x), plain(x)
        if logits.shape != want.shape or not torch.allclose(logits, want, rtol=tol, atol=tol):
            bad.append(f"sp={sp} logits differ")
    return bad


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_gpt_matches_plain(pool, tp):
    for sp in (False, True):
        for r, bad in enumerate(pool(tp).run(job_gpt, sp, timeout=60)):
            assert not bad, f"rank {r}: {bad}"


def job_train(comm: pc.Communicator, dp: int, tp: int, sp: bool) -> list[str]:
    """3 AdamW steps of dp x tp against one process on the global batch."""
    bad: list[str] = []
    data = SyntheticSequences(CFG.vocab_size, T, 64, seed=2)
    plain = GPT(CFG, torch.float64)
    with ParallelDims(comm, dp=dp, tp=tp) as dims:
        model = parallelize_gpt(GPT(CFG, torch.float64), dims, sequence_parallel=sp)
        run = DistributedDataParallel(model, dims.dp_comm) if dp > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        everyone = GlobalBatches(64, 12, seed=3)
        mine = GlobalBatches(64, 12, dp_size=dp, dp_rank=dims.dp_rank, seed=3)
        for step in range(3):
            ids = mine.ids(step)
            gathered = torch.empty(12, dtype=torch.int64)
            dims.dp_comm.all_gather(gathered, ids)
            if not torch.equal(gathered, everyone.global_ids(step)):
                bad.append(f"step {step}: dp ranks' samples {gathered} != global batch")
            loss = run(*data.batch(ids))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref = plain(*data.batch(everyone.global_ids(step)))
            ref.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            dims.dp_comm.all_reduce(avg := loss.detach().clone(), pc.ReduceOp.AVG)
            if not torch.allclose(avg, ref, rtol=1e-12, atol=0):
                bad.append(f"step {step}: loss {avg.item()} != {ref.item()}")
        exact = dp == 1 and tp == 1
        compare(
            bad,
            f"dp={dp} tp={tp} sp={sp}",
            model,
            plain,
            dims.tp_comm,
            0 if exact else 1e-10,
            grads=False,
        )
    return bad


@pytest.mark.parametrize(
    "dp,tp,sp",
    [
        (1, 1, False),
        (2, 1, False),
        (1, 2, True),
        (3, 1, False),
        (1, 3, True),
        (2, 2, False),
        (2, 2, True),
        (1, 4, True),
    ],
)
def test_training_matches_single_process(pool, dp, tp, sp):
    for r, bad in enumerate(pool(dp * tp).run(job_train, dp, tp, sp, timeout=120)):
        assert not bad, f"rank {r}: {bad}"


def job_layout_invariant_start(comm: pc.Communicator, layouts: list) -> list[str]:
    """For each dp x tp x pp: this rank's pipeline stage (embedding on the first,
    head on the last, its share of 4 blocks), tensor-parallel; its weights
    gathered over tp are bitwise the single-process model's, and the samples
    of the dp ranks, gathered, are the global batch of one process."""
    bad: list[str] = []
    cfg = dataclasses.replace(CFG, n_layer=4)
    plain = GPT(cfg)
    for dp, tp, pp in layouts:
        with ParallelDims(comm, dp=dp, tp=tp, pp=pp) as dims:
            mine = GlobalBatches(100, 8, dp_size=dp, dp_rank=dims.dp_rank, seed=5)
            for step in (0, 12, 13):  # 12 and 13 cross into the second epoch
                every = torch.empty(8, dtype=torch.int64)
                dims.dp_comm.all_gather(every, mine.ids(step))
                if not torch.equal(every, GlobalBatches(100, 8, seed=5).global_ids(step)):
                    bad.append(f"dp={dp} tp={tp} pp={pp} step {step}: samples {every.tolist()}")
            stage = GPT(cfg)
            per = cfg.n_layer // pp
            for i in range(cfg.n_layer):
                if i // per != dims.pp_rank:
                    stage.blocks[i] = nn.Identity()  # not this stage's: names stay global
            if dims.pp_rank > 0:
                del stage.embed
            if dims.pp_rank < pp - 1:
                del stage.head
            parallelize_gpt(stage, dims)
            for name, p in stage.named_parameters():
                name = "embed.tok.weight" if name == "head.weight" else name  # tied
                want = dict(plain.named_parameters())[name]
                full = gather_full(p, want.shape, dims.tp_comm)
                if full is None or not torch.equal(full, want):
                    bad.append(f"dp={dp} tp={tp} pp={pp} {name}: differs from one process")
    return bad


def test_layout_invariant_start(pool):
    layouts = [(1, 1, 4), (1, 2, 2), (2, 2, 1), (1, 4, 1), (4, 1, 1), (2, 1, 2)]
    for r, bad in enumerate(pool(4).run(job_layout_invariant_start, layouts, timeout=120)):
        assert not bad, f"rank {r}: {bad}"


class Recorder:
    """A communicator that logs its collectives and their waits into `events`,
    and issues them `delay` seconds late (the layers take their communicator as
    an argument, so a test can pass this)."""

    def __init__(self, comm: pc.Communicator, events: list, delay: float) -> None:
        self._comm, self.events, self.delay = comm, events, delay

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def _call(self, name: str, *args, async_op: bool = False):
        time.sleep(self.delay)
        self.events.append((name, time.monotonic(), async_op))
        work = getattr(self._comm, name)(*args, async_op=async_op)
        return RecordedWork(work, self.events) if async_op else work

    def all_reduce(self, tensor, op=pc.ReduceOp.SUM, *, async_op=False):
        return self._call("all_reduce", tensor, op, async_op=async_op)

    def reduce_scatter(self, output, input, op=pc.ReduceOp.SUM, *, async_op=False):  # noqa: A002
        return self._call("reduce_scatter", output, input, op, async_op=async_op)

    def all_gather(self, output, input, *, async_op=False):  # noqa: A002
        return self._call("all_gather", output, input, async_op=async_op)


class RecordedWork:
    def __init__(self, work: pc.Work, events: list) -> None:
        self._work, self.events = work, events

    def wait(self, timeout=None) -> bool:
        self.events.append(("wait", time.monotonic(), self._work.is_completed()))
        return self._work.wait(timeout)


class MatmulLog(TorchDispatchMode):
    """Logs every matrix multiplication this thread runs, with its output's shape."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.events.append(("mm", time.monotonic(), tuple(out.shape)))
        return out


def job_overlap(comm: pc.Communicator, overlap: bool, sp: bool) -> list:
    """The backward of a column-parallel layer, logged; in backward, rank 1
    issues each collective 0.3 s late."""
    events: list = []
    recorder = Recorder(comm, events, 0.0)
    layer = ColumnParallelLinear(64, 128, recorder, overlap=overlap, sequence_parallel=sp)
    x = torch.randn(2, 128, 64, requires_grad=True)
    y = layer(x)
    events.clear()
    recorder.delay = 0.3 if comm.rank == 1 else 0.0
    with MatmulLog(events):
        y.backward(torch.ones_like(y))
    return events


def test_input_gradient_communication_overlaps_weight_gradient(pool):
    """Rank 0 starts the input gradient's all-reduce (sequence parallel: its
    reduce-scatter), computes the weight gradient (a [64, 64] mm: its 128/2
    output features x 64 inputs) and waits, all before the late rank 1 has
    even started the collective: the weight gradient was computed while the
    collective was in flight. With sequence parallelism, the input's
    all-gather is likewise in flight while dx is computed."""
    for sp in (False, True):
        rank0, rank1 = pool(2).run(job_overlap, True, sp)
        kinds = [(e[0], e[2]) for e in rank0]
        reduce = "reduce_scatter" if sp else "all_reduce"
        want = [
            ("mm", (256 * (2 if sp else 1), 64)),
            (reduce, True),
            ("mm", (64, 64)),
            ("wait", False),
        ]
        if sp:  # re-gather the input shard during dx
            want = [("all_gather", True)] + want[:1] + [("wait", False)] + want[1:]
        assert kinds == want, rank0
        rank1_start = next(t for kind, t, _ in rank1 if kind == reduce)
        assert rank0[-1][1] < rank1_start, (rank0, rank1)  # rank 0 waited before rank 1 began

    # Without overlap, autograd computes both products, then all-reduces synchronously.
    rank0, _ = pool(2).run(job_overlap, False, False)
    assert [(e[0], e[2]) for e in rank0] == [
        ("mm", (256, 64)),
        ("mm", (64, 64)),
        ("all_reduce", False),
    ], rank0


def job_bad_input(comm: pc.Communicator) -> dict[str, str]:
    n = comm.world_size
    ok = GPTConfig(vocab_size=4 * n, seq_len=4 * n + 1, n_head=n, d_model=4 * n)

    def gpt(**change) -> GPT:
        return GPT(dataclasses.replace(ok, **change))

    cases = {
        "heads": lambda d: parallelize_gpt(gpt(n_head=n + 1, d_model=4 * (n + 1)), d),
        "vocab": lambda d: parallelize_gpt(gpt(vocab_size=4 * n + 1), d),
        "hidden": lambda d: parallelize_gpt(gpt(d_ff=4 * n + 1), d),
        "twice": lambda d: parallelize_gpt(parallelize_gpt(gpt(), d), d),
        "seq": lambda d: parallelize_gpt(gpt(), d, sequence_parallel=True)(
            torch.zeros(1, 4 * n + 1, dtype=torch.int64)
        ),
        "ids": lambda d: parallelize_gpt(gpt(), d)(torch.tensor([[0, 4 * n]])),
        "column": lambda d: ColumnParallelLinear(4, 4 * n + 1, d.tp_comm),
        "row": lambda d: RowParallelLinear(4 * n + 1, 4, d.tp_comm),
        "embedding": lambda d: VocabParallelEmbedding(4 * n + 1, 4, d.tp_comm),
        "differ": lambda d: parallelize_gpt(gpt(seed=comm.rank % 2), d),
    }
    out = {}
    with ParallelDims(comm, tp=n) as dims:
        for name, fn in cases.items():
            try:
                fn(dims)
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
        t = torch.ones(1)  # still in step
        dims.tp_comm.all_reduce(t)
        assert t.item() == n
    return out


@pytest.mark.parametrize("tp", [2, 3])
def test_bad_input_raises_on_every_rank(pool, tp):
    for r, out in enumerate(pool(tp).run(job_bad_input, timeout=60)):
        assert f"n_head={tp + 1} is not divisible by tp={tp}" in out["heads"], out
        assert f"vocab_size={4 * tp + 1} is not divisible by tp={tp}" in out["vocab"], out
        assert f"MLP hidden size={4 * tp + 1} is not divisible by tp={tp}" in out["hidden"], out
        assert "already parallelized" in out["twice"], out
        assert f"sequence length ({4 * tp + 1}) divisible by tp={tp}" in out["seq"], out
        assert f"token ids in [0, {4 * tp}] outside [0, {4 * tp})" in out["ids"], out
        assert f"out_features={4 * tp + 1} is not divisible by tp={tp}" in out["column"], out
        assert f"in_features={4 * tp + 1} is not divisible by tp={tp}" in out["row"], out
        assert f"vocab size={4 * tp + 1} is not divisible by tp={tp}" in out["embedding"], out
        assert "tp ranks [1] parallelize another model" in out["differ"], out
        assert all(f"rank {r}" in msg for msg in out.values()), out
