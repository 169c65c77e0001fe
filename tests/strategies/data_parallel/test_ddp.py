"""strategies.DistributedDataParallel against single-process training on the
concatenated batch; bucketing (BucketSet, all_reduce_coalesced, windows)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import pycollectives as pc
from pycollectives.bucketing import BucketSet
from pycollectives.strategies.data_parallel.ddp import CompressionHook, DistributedDataParallel

STEPS = 6  # DDP has no state that changes after the first steps (no bucket rebuild)
BATCH = 4  # per rank
# Averaging across ranks sums in another order than one process does over the
# concatenated batch: float32 rounding, amplified a little by AdamW.
RTOL, ATOL = 1e-4, 1e-5


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)).mean(dim=1))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
        )
    return Transformer()


def make_data(kind: str, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (world_size * BATCH, 6) if kind == "mlp" else (world_size * BATCH, 5, 6)
    return torch.randn(shape, generator=g), torch.randn(world_size * BATCH, 3, generator=g)


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # eps well above the rounding noise: parameters whose true gradient is zero
    # (the attention's key bias) get ~1e-9 of noise that differs between the
    # two summation orders, and Adam's default eps=1e-8 would blow it up to a
    # full lr-sized step.
    return torch.optim.AdamW(params, lr=0.01, eps=1e-3)


def max_diff(a: nn.Module, b: nn.Module) -> str | None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=RTOL, atol=ATOL):
            return f"{n}: max |diff| {(p - q).abs().max().item():.3g}"
    return None


def train_and_compare(comm: pc.Communicator, kind: str, opt: str, **ddp_kw) -> str | None:
    n, r = comm.world_size, comm.rank
    ref = make_model(kind)
    model = copy.deepcopy(ref)
    if r > 0:  # DDP must broadcast rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ddp = DistributedDataParallel(model, comm, **ddp_kw)
    o_ref, o = make_opt(opt, ref.parameters()), make_opt(opt, ddp.parameters())
    for step in range(STEPS):
        x, y = make_data(kind, n, step)
        o_ref.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        o_ref.step()
        o.zero_grad()
        sl = slice(r * BATCH, (r + 1) * BATCH)
        nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        o.step()
    return max_diff(model, ref)


def job_train(comm: pc.Communicator) -> list[str]:
    bad = []
    caps = [(1e-6, 1e-6), (None, None), (1000.0, 1000.0)]  # one bucket per parameter .. one bucket
    for kind in ("mlp", "transformer"):
        for opt in ("sgd", "adamw"):
            for cap, first in caps if kind == "mlp" else caps[1:2]:
                kw = {} if cap is None else {"bucket_cap_mb": cap, "first_bucket_cap_mb": first}
                err = train_and_compare(comm, kind, opt, **kw)
                if err:
                    bad.append(f"{kind}/{opt}/cap={cap}: {err}")
    err = train_and_compare(comm, "mlp", "sgd", gradient_as_bucket_view=False, bucket_cap_mb=0.001)
    if err:
        bad.append(f"gradient_as_bucket_view=False: {err}")
    err = train_and_compare(comm, "mlp", "adamw", overlap=False)
    if err:
        bad.append(f"overlap=False: {err}")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_training_matches_single_process(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_train, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


def job_views_equal_copies(comm: pc.Communicator) -> list[str]:
    """gradient_as_bucket_view True (the default) and False: the same parameters
    bit for bit after training (AdamW, with and without no_sync accumulation),
    and no bucket copy of the gradients with views."""
    n, r, bad = comm.world_size, comm.rank, []
    sl = slice(r * BATCH, (r + 1) * BATCH)
    for kind in ("mlp", "transformer"):
        got = {}
        for views in (True, False):
            model = make_model(kind)
            ddp = DistributedDataParallel(model, comm, gradient_as_bucket_view=views)
            opt = make_opt("adamw", ddp.parameters())
            for step in range(6):
                opt.zero_grad(set_to_none=step % 2 == 0)
                for micro in range(2):
                    x, y = make_data(kind, n, 2 * step + micro)
                    ctx = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
                    with ctx:
                        (nn.functional.mse_loss(ddp(x[sl]), y[sl]) / 2).backward()
                opt.step()
            got[views] = [p.detach().clone() for p in model.parameters()]
            shared = {b.buffer.untyped_storage().data_ptr() for b in ddp.buckets.buckets}
            in_buckets = [p.grad.untyped_storage().data_ptr() in shared for p in model.parameters()]
            if all(in_buckets) != views or any(in_buckets) != views:
                bad.append(
                    f"{kind}, gradient_as_bucket_view={views}: grads in buckets {in_buckets}"
                )
        if not all(torch.equal(a, b) for a, b in zip(got[True], got[False], strict=True)):
            bad.append(f"{kind}: views and copies train to different bits")
    return bad


def test_bucket_views_equal_copies_bitwise(pool):
    for r, bad in enumerate(pool(2).run(job_views_equal_copies, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


def job_no_sync_and_views(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    ref, model = make_model("mlp"), make_model("mlp")
    ddp = DistributedDataParallel(model, comm, gradient_as_bucket_view=True, bucket_cap_mb=0.002)
    sl = slice(r * BATCH, (r + 1) * BATCH)
    before = comm.stats().get("all_reduce", {}).get("calls", 0)
    for micro in range(3):
        x, y = make_data("mlp", n, micro)
        nn.functional.mse_loss(ref(x), y).backward()
        if micro < 2:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        else:
            nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        calls = comm.stats().get("all_reduce", {}).get("calls", 0) - before
        if micro < 2 and calls:
            bad.append(f"no_sync step {micro} communicated ({calls} all_reduces)")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
            bad.append(f"accumulated grad of {name} differs")
        if n > 1 and not any(
            p.grad.data_ptr() == v.data_ptr() for b in ddp.buckets.buckets for v in b.views
        ):
            bad.append(f"{name}.grad is not a bucket view")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_accumulates_then_averages(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_no_sync_and_views)):
        assert not bad, f"rank {r}: {bad}"


class Branchy(nn.Module):
    """`a` is used by every rank, `b` only by rank 0, `c` by nobody."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def job_unused(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    x = torch.arange(8.0).view(2, 4) + r
    for caps in (0.0001, 25.0):
        model = Branchy()
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, bucket_cap_mb=caps)
        for _ in range(2):  # twice: the state resets between iterations
            ddp.zero_grad(set_to_none=True)
            ddp(x, use_b=r == 0).sum().backward()
        # Expected: per-rank gradients averaged; b's only from rank 0.
        grads_a, grad_b = [], None
        for q in range(n):
            m = Branchy()
            m(torch.arange(8.0).view(2, 4) + q, use_b=q == 0).sum().backward()
            grads_a.append(m.a.weight.grad)
            if q == 0:
                grad_b = m.b.weight.grad / n
        if not torch.allclose(model.a.weight.grad, sum(grads_a) / n, rtol=RTOL, atol=ATOL):
            bad.append(f"cap {caps}: grad of a differs")
        if model.b.weight.grad is None or not torch.allclose(
            model.b.weight.grad, grad_b, rtol=RTOL, atol=ATOL
        ):
            bad.append(f"cap {caps}: grad of b (used on rank 0 only) wrong")
        if model.c.weight.grad is not None:
            bad.append(f"cap {caps}: grad of c (unused everywhere) should stay None")
    # Without find_unused_parameters: no hang; the ranks lacking gradients raise.
    ddp = DistributedDataParallel(Branchy(), comm)
    try:
        ddp(x, use_b=True).sum().backward()
        bad.append("no error for a parameter without gradient")
    except RuntimeError as e:
        if "find_unused_parameters=True" not in str(e) or "c.weight" not in str(e):
            bad.append(f"unclear error: {e}")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameters(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_unused)):
        assert not bad, f"rank {r}: {bad}"


def job_compression(comm: pc.Communicator) -> list[str]:
    bad = []
    for dt, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        n, r = comm.world_size, comm.rank
        ref, model = make_model("mlp"), make_model("mlp")
        ddp = DistributedDataParallel(model, comm, comm_hook=CompressionHook(dt))
        x, y = make_data("mlp", n, 0)
        nn.functional.mse_loss(ref(x), y).backward()
        sl = slice(r * BATCH, (r + 1) * BATCH)
        nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            scale = q.grad.abs().max().item() + 1e-6
            if (p.grad - q.grad).abs().max().item() > tol * scale:
                bad.append(f"{dt} {name}: {(p.grad - q.grad).abs().max().item():.3g}")
    return bad


def test_compression_hook(pool):
    for r, bad in enumerate(pool(3).run(job_compression)):
        assert not bad, f"rank {r}: {bad}"


def job_different_models(comm: pc.Communicator) -> str:
    width = 8 if comm.rank == 0 else 9
    try:
        DistributedDataParallel(nn.Linear(width, 2), comm)
    except ValueError as e:
        return str(e)
    return "no error"


def test_different_models_raise_everywhere(pool):
    for r, msg in enumerate(pool(3).run(job_different_models)):
        assert "differs from rank 0" in msg and "ranks [1, 2]" in msg, f"rank {r}: {msg}"


def job_init_sync(comm: pc.Communicator) -> list[str]:
    """init_sync: True broadcasts; "verify" broadcasts only when a rank's
    values differ (one bit is enough); False leaves every rank's own."""
    bad = []

    def broadcasts() -> int:
        return comm.stats().get("broadcast", {}).get("calls", 0)

    def build(mode, perturb: bool) -> nn.Module:
        model = make_model("mlp")
        model.register_buffer("steps", torch.tensor([7], dtype=torch.int64))
        if perturb and comm.rank == comm.world_size - 1:
            with torch.no_grad():  # one bit of one element
                w = model[0].weight.view(-1)[:1].view(torch.int32)
                w ^= 1
        before = broadcasts()
        DistributedDataParallel(model, comm, init_sync=mode)
        bad.extend(
            f"init_sync={mode!r}, perturbed={perturb}: {n} broadcasts, expected {want}"
            for n, want in [(broadcasts() - before, _expected(mode, perturb, comm.world_size))]
            if n != want
        )
        return model

    for mode in (True, "verify", False):
        for perturb in (False, True):
            model = build(mode, perturb)
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = torch.empty(comm.world_size * mine.numel())
            comm.all_gather(every, mine)
            alike = all(torch.equal(row, every.view(comm.world_size, -1)[0])
                        for row in every.view(comm.world_size, -1))  # fmt: skip
            if alike != (mode is not False or not perturb or comm.world_size == 1):
                bad.append(f"init_sync={mode!r}, perturbed={perturb}: ranks alike: {alike}")
    try:
        DistributedDataParallel(make_model("mlp"), comm, init_sync="yes")
        bad.append("init_sync='yes' accepted")
    except ValueError as e:
        if "init_sync='yes'" not in str(e) or f"rank {comm.rank}" not in str(e):
            bad.append(f"unclear error: {e}")
    return bad


def _expected(mode, perturb: bool, world_size: int) -> int:
    """Broadcast calls of one construction: one per dtype (float32, int64)."""
    if mode is True:
        return 2
    if mode == "verify" and perturb and world_size > 1:
        return 2
    return 0


@pytest.mark.parametrize("world_size", [1, 3])
def test_init_sync_modes(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_init_sync, timeout=120)):
        assert not bad, f"rank {r}: {bad}"


def job_buckets(comm: pc.Communicator) -> list[str]:
    n, r, bad = comm.world_size, comm.rank, []
    specs = [((3, 5), torch.float32), ((0,), torch.float32), ((1000,), torch.int64)]
    specs += [((300_000,), torch.float32), ((7,), torch.bfloat16), ((2,), torch.float32)]
    bs = BucketSet(comm, specs, bucket_cap_mb=1.0, first_bucket_cap_mb=0.0001)
    dtypes = [b.buffer.dtype for b in bs.buckets]
    for b in bs.buckets:
        if len({t.dtype for t in b.views}) != 1:
            bad.append(f"bucket {b.index} mixes dtypes")
    if dtypes.count(torch.float32) < 3:  # first bucket tiny, the 300k tensor alone
        bad.append(f"unexpected bucketing: {bs.buckets}")
    for i, (shape, dt) in enumerate(specs):
        v = bs.view(i)
        if tuple(v.shape) != shape or v.dtype != dt:
            bad.append(f"view {i}: {v.shape} {v.dtype}")
        v.copy_((torch.arange(v.numel()) % 11 + r + i).view(shape).to(dt))
    works = [bs.all_reduce(b) for b in range(len(bs))]
    for w in works:
        w.wait()
    for i, (shape, dt) in enumerate(specs):
        base = torch.arange(bs.view(i).numel()) % 11 + i
        want = (n * base + sum(range(n))).view(shape).to(dt)
        if not torch.equal(bs.view(i), want):
            bad.append(f"tensor {i} wrong after bucket all-reduce")
    # all_reduce_coalesced on plain tensors, sync and async, twice (cached buckets)
    for async_op in (False, True):
        ts = [torch.full((k * 1000 + 1,), float(r + k)) for k in range(5)] + [
            torch.ones(3, dtype=torch.int32)
        ]
        w = comm.all_reduce_coalesced(ts, async_op=async_op, bucket_cap_mb=0.01)
        if async_op:
            w.wait()
        for k in range(5):
            if not torch.all(ts[k] == n * k + sum(range(n))):
                bad.append(f"coalesced {async_op} tensor {k} wrong")
        if not torch.all(ts[5] == n):
            bad.append("coalesced int tensor wrong")
    # ... into Parameters, and into an inference tensor waited on outside inference
    # mode: the copies out are made outside autograd
    want = float(sum(range(n)))
    for async_op in (False, True):
        ps = [torch.nn.Parameter(torch.full((k + 2,), float(r))) for k in range(2)]
        with torch.inference_mode():
            inf = torch.full((3,), float(r))
        try:
            w = comm.all_reduce_coalesced([*ps, inf], async_op=async_op)
            if async_op:
                w.wait()
            if not all(torch.all(t == want) for t in (*ps, inf)) or not ps[0].requires_grad:
                bad.append(f"coalesced Parameters {async_op} wrong")
        except RuntimeError as e:
            bad.append(f"coalesced Parameters {async_op}: {e}")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_buckets(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_buckets)):
        assert not bad, f"rank {r}: {bad}"


def job_bucket_bad_input(comm: pc.Communicator) -> list[str]:
    r, bad = comm.rank, []
    cases = [
        (lambda: comm.alloc_shared(-1), "shape"),
        (lambda: comm.alloc_shared(4, torch.complex64), "dtype"),
        (lambda: BucketSet(comm, [torch.ones(2)], bucket_cap_mb=0), "bucket_cap_mb"),
        (lambda: BucketSet(comm, ["x"]), "tensors[0]"),
        (lambda: comm.all_reduce_coalesced([torch.ones(4)[::2]]), "tensors[0]"),
    ]
    for fn, needle in cases:
        try:
            fn()
            bad.append(f"{needle}: no error")
        except ValueError as e:
            if needle not in str(e) or f"rank {r}" not in str(e):
                bad.append(f"{needle}: unclear message {e}")
    return bad


def test_bucket_bad_input(pool):
    for r, bad in enumerate(pool(2).run(job_bucket_bad_input)):
        assert not bad, f"rank {r}: {bad}"
