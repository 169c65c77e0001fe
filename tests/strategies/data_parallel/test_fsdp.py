"""strategies.data_parallel.fsdp.fully_shard against strategies.DDP and one process on the
whole batch: with and without reshard_after_forward and prefetch, bf16 mixed
precision, gradient accumulation and clipping, a model used twice, frozen
parameters, train/eval, the parameters shown between steps, bad input; CUDA
tensors (marked cuda)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_zero import DDP_ATOL, DDP_RTOL, SINGLE_ATOL, SINGLE_RTOL
from zero_common import (
    CFG,
    DATA,
    OPT,
    build,
    differ,
    fsdp_kw,
    local_batch,
    named,
    train,
    train_ddp,
    train_single,
)

import pycollectives as pc
from pycollectives import _C
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel
from pycollectives.strategies.data_parallel.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from pycollectives.strategies.data_parallel.sharding import EngineMeter
from pycollectives.strategies.models.gpt import GPT, GPTConfig

VARIANTS = {  # label: (reshard_after_forward, prefetch)
    "reshard": (True, 2),
    "reshard/no-prefetch": (True, 0),
    "keep": (False, 2),
    "keep/no-prefetch": (False, 0),
    "auto/prefetch-1": (None, 1),  # FSDP2's default: every unit but the root reshards
}


def job_equivalence(comm: pc.Communicator) -> list[str]:
    n, bad = comm.world_size, []
    single, ddp = train_single(n), train_ddp(comm)
    for label, (reshard, prefetch) in VARIANTS.items():
        got, _, _ = train(comm, "fsdp", **fsdp_kw(reshard, prefetch))
        tol = (0.0, 0.0) if n <= 2 else (DDP_RTOL, DDP_ATOL)
        err = differ(got, ddp, *tol)
        if err:
            bad.append(f"{label} vs DDP ({'bitwise' if n <= 2 else 'tolerance'}): {err}")
        err = differ(got, single, SINGLE_RTOL, SINGLE_ATOL)
        if err:
            bad.append(f"{label} vs one process: {err}")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp_equals_ddp_and_single_process(pool, world_size):
    for r, bad in enumerate(pool(world_size).run(job_equivalence, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


# -- accumulation, clipping, a model used twice, frozen parameters, train/eval ------------
def run(
    comm: pc.Communicator,
    sharded: bool,
    loss: Callable[[Any, int], torch.Tensor],
    steps: int = 5,
    prepare: Callable[[GPT], None] | None = None,
    after: Callable[[Any, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Trains DDP (sharded=False) or FSDP with loss(model, step).backward()."""
    model = GPT(CFG)
    if prepare is not None:
        prepare(model)
    if sharded:
        model, opt = build(comm, "fsdp", model, **fsdp_kw(True, 2))
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, comm)
        opt = torch.optim.AdamW(wrapped.parameters(), **OPT)
    for step in range(steps):
        opt.zero_grad()
        loss(wrapped, step).backward()
        opt.step()
        if after is not None:
            after(wrapped, step)
    return model.full_parameters() if sharded else named(model)


def job_usage(comm: pc.Communicator) -> list[str]:
    bad = []

    def twice(m: Any, step: int) -> torch.Tensor:  # the model used twice in one step
        return m(*local_batch(comm, 2 * step)) + 0.5 * m(*local_batch(comm, 2 * step + 1))

    def freeze(model: GPT) -> None:  # parameters that are not trainable, in two units
        model.embed.pos.weight.requires_grad_(False)
        for p in model.blocks[0].ln1.parameters():
            p.requires_grad_(False)

    outputs: dict[bool, list[torch.Tensor]] = {True: [], False: []}

    def evaluate(sharded: bool) -> Callable[[Any, int], None]:
        def after(m: Any, step: int) -> None:
            m.eval()
            with torch.no_grad():
                outputs[sharded].append(m(local_batch(comm, 100 + step)[0]))
            m.train()
            if step == 2:  # a forward with gradients on but no backward: nothing left stale
                m(*local_batch(comm, 200))

        return after

    plain = lambda m, step: m(*local_batch(comm, step))  # noqa: E731
    cases = {
        "used twice": {"loss": twice},
        "frozen parameters": {"loss": plain, "prepare": freeze},
        "train/eval": {"loss": plain},
    }
    for label, case in cases.items():
        got = run(comm, True, after=evaluate(True) if label == "train/eval" else None, **case)
        ref = run(comm, False, after=evaluate(False) if label == "train/eval" else None, **case)
        err = differ(got, ref)
        if err:
            bad.append(f"{label}: {err}")
    if not all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False], strict=True)):
        bad.append("eval outputs differ from DDP's")
    return bad


def test_model_used_twice_frozen_parameters_train_eval(pool):
    for r, bad in enumerate(pool(2).run(job_usage, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


def job_accumulate_and_clip(comm: pc.Communicator) -> list[str]:
    bad, steps = [], 4
    ref_acc = train_ddp(comm, steps, micro=3)
    ref_clip = train_ddp(comm, steps, micro=3, clip=0.05)
    got, _, _ = train(comm, "fsdp", steps, micro=3, **fsdp_kw(True, 2))
    if differ(got, ref_acc):
        bad.append(f"no_sync accumulation vs DDP: {differ(got, ref_acc)}")
    got, _, _ = train(comm, "fsdp", steps, micro=3, clip_to=0.05, **fsdp_kw(False, 2))
    if differ(got, ref_clip):  # bitwise: the norm as torch takes it (sharding/clip.py)
        bad.append(f"accumulation + clipping vs DDP: {differ(got, ref_clip)}")
    # set_requires_gradient_sync(False) is no_sync: no reduce-scatter, same result
    model, opt = build(comm, "fsdp", **fsdp_kw(True, 2))
    for step in range(steps):
        opt.zero_grad()
        for k in range(3):
            model.set_requires_gradient_sync(k == 2)
            before = comm.stats().get("reduce_scatter", {}).get("calls", 0)
            (model(*local_batch(comm, 3 * step + k)) / 3).backward()
            calls = comm.stats().get("reduce_scatter", {}).get("calls", 0) - before
            if calls != (3 if k == 2 else 0):
                bad.append(f"micro-batch {k}: {calls} reduce-scatters")
        opt.step()
    if differ(model.full_parameters(), ref_acc):
        bad.append("set_requires_gradient_sync(False) accumulation differs from DDP")
    # Kept gathered through forward and the no_sync backwards: one all-gather per unit and
    # step instead of one per unit and micro-batch, and the same result.
    for keep in (False, True):
        model, opt = build(comm, "fsdp", **fsdp_kw(False, 2))
        model.set_reshard_after_backward(not keep)
        for step in range(steps):
            before = comm.stats().get("all_gather", {}).get("calls", 0)
            opt.zero_grad()
            for k in range(3):
                model.set_requires_gradient_sync(k == 2)
                (model(*local_batch(comm, 3 * step + k)) / 3).backward()
            opt.step()
            units = len(model.sharding_unit.engine.units)
            calls = comm.stats().get("all_gather", {}).get("calls", 0) - before
            if step > 0 and calls != units * (1 if keep else 3):  # (step 0 builds the engine)
                bad.append(f"reshard_after_backward={not keep}: {calls} all-gathers in a step")
        if differ(model.full_parameters(), ref_acc):
            bad.append(f"reshard_after_backward={not keep}: accumulation differs from DDP")
    return bad


def test_accumulation_and_clipping_equal_ddp(pool):
    for r, bad in enumerate(pool(2).run(job_accumulate_and_clip, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


# -- what the parameters are between steps; prefetch bound -------------------------------
def job_shapes_and_prefetch(comm: pc.Communicator) -> list[str]:
    """Six blocks: the units gathered at once are the root, the block that
    computes and exactly `prefetch` blocks ahead (reshard_after_forward), or
    all of them by the end of forward (keep)."""
    bad = []
    x, y = local_batch(comm, 0)
    deep = GPTConfig(**{**CFG.__dict__, "n_layer": 6})
    for reshard, prefetch in ((True, 0), (True, 1), (True, 3), (False, 2)):
        model, opt = build(comm, "fsdp", GPT(deep), **fsdp_kw(reshard, prefetch))
        if not all(isinstance(m, FSDPModule) for m in (model, *model.blocks)):
            bad.append("fully_shard did not make FSDPModules")
        w = model.blocks[0].mlp.fc.weight
        if w.dim() != 1:
            bad.append(f"before forward: {tuple(w.shape)}, expected a 1-D shard piece")
        loss = model(x, y)
        full_after_forward = tuple(w.shape) == (CFG.hidden, CFG.d_model)
        if full_after_forward == reshard:
            bad.append(f"reshard={reshard}: after forward the block holds {tuple(w.shape)}")
        loss.backward()
        if w.dim() != 1 or w.grad is None or w.grad.shape != w.shape:
            bad.append(f"after backward: param {tuple(w.shape)}, grad {w.grad is not None}")
        opt.step()
        model(x, y).backward()  # the second iteration prefetches by the first's order
        engine = model.sharding_unit.engine
        most = engine.max_gathered
        want = 2 + prefetch if reshard else 1 + deep.n_layer
        if most != want:
            bad.append(f"reshard={reshard}, prefetch={prefetch}: {most} units gathered at once")
        # the meter: all-gathers in flight at once never exceed the prefetch
        # bound (an on-demand gather counts one), every one started was waited
        # for, and the waits, copies and reduce-scatters took time
        m = engine.meter
        gathers = 2 * (1 + deep.n_layer) * (2 if reshard else 1)  # 2 iterations, every unit
        if m.max_in_flight != max(prefetch, 1) or m.in_flight != 0:
            bad.append(f"prefetch={prefetch}: in flight {m.in_flight}, at most {m.max_in_flight}")
        if not (m.gather_wait_s > 0 and m.reduce_wait_s > 0 and m.grad_copy_s > 0):
            bad.append(f"prefetch={prefetch}: meter {m.as_dict()}")
        if m.step_gather_s != 0 or m.gathers != gathers:
            bad.append(f"prefetch={prefetch}: {m.gathers} gathers, meter {m.as_dict()}")
        m.reset()
        if m.as_dict() != EngineMeter().as_dict():
            bad.append(f"reset left {m.as_dict()}")
    return bad


def test_parameters_between_steps_and_prefetch_bound(pool):
    for r, bad in enumerate(pool(2).run(job_shapes_and_prefetch)):
        assert not bad, f"rank {r}: {bad}"


# -- mixed precision --------------------------------------------------------------------
def job_bf16(comm: pc.Communicator, reduce_dtype: torch.dtype | None) -> dict[str, Any]:
    """bf16 compute on fp32 master shards learns the toy language."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model, opt = build(comm, "fsdp", **fsdp_kw(True, 2, mp))
    for g in opt.param_groups:
        g["lr"] = 3e-2
    seen = []
    model.blocks[0].mlp.fc.register_forward_pre_hook(
        lambda m, a: seen.append((m.weight.dtype, a[0].dtype))
    )
    losses = []
    for step in range(40):
        opt.zero_grad()
        loss = model(*local_batch(comm, step, batch=8))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    w = model.blocks[0].mlp.fc.weight
    return {
        "first": sum(losses[:5]) / 5,
        "last": sum(losses[-5:]) / 5,
        "seen": seen[0],
        "master": (w.dtype, w.grad.dtype),
        "floor": DATA.loss_floor,
    }


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_bf16_param_dtype_trains(pool, reduce_dtype):
    for r, res in enumerate(pool(2).run(job_bf16, reduce_dtype)):
        assert res["seen"] == (torch.bfloat16, torch.bfloat16), (r, res)
        assert res["master"] == (torch.float32, torch.float32), (r, res)
        # log(32) = 3.47 at the start; the chain's floor is log(2) = 0.69
        assert res["last"] < res["first"] - 1.0, (r, res)


# -- bad input ----------------------------------------------------------------------------
def job_bad_input(comm: pc.Communicator) -> list[str]:
    r, bad = comm.rank, []

    def expect(make: Callable[[], Any], *needles: str) -> None:
        try:
            make()
            bad.append(f"{needles}: no error")
        except ValueError as e:
            if not all(s in str(e) for s in needles):
                bad.append(f"{needles}: unclear message: {e}")

    def parent_first() -> None:
        model = GPT(CFG)
        fully_shard(model, comm)
        fully_shard(model.blocks[0], comm)

    expect(
        parent_first,
        "on ranks [0, 1, 2]: parameters ['ln1.weight'",
        "already belong to the unit of GPT",
        "shard bottom-up",
    )

    def shared() -> None:  # the tied embedding split between two units
        model = GPT(CFG)
        fully_shard(model.embed, comm)
        fully_shard(model.head, comm)

    expect(shared, "parameters ['weight'] are shared with the unit of Embedding")

    def twice() -> None:
        block = GPT(CFG).blocks[0]
        fully_shard(block, comm)
        fully_shard(block, comm)

    expect(twice, "already sharded")
    expect(
        lambda: fully_shard(GPT(CFG), comm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8)),
        "mp_policy.param_dtype=torch.int8",
    )
    other = GPTConfig(
        **{**CFG.__dict__, "n_head": 4 if r == 2 else 2, "d_model": 16 + 4 * (r == 2)}
    )
    expect(lambda: fully_shard(GPT(other).blocks[0], comm), "ln1.weight", "ranks [2]")
    return bad


def test_bad_input_raises_on_every_rank(pool):
    for r, bad in enumerate(pool(3).run(job_bad_input)):
        assert not bad, f"rank {r}: {bad}"


# -- CUDA tensors: the same code, the CUDA collectives ------------------------------------
CUDA_OK = bool(getattr(_C, "cuda_built", lambda: False)()) and torch.cuda.is_available()


def job_cuda(comm: pc.Communicator) -> list[str]:
    dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    comm.all_reduce(torch.zeros(1, device=dev))  # sets up the CUDA transport
    bad = []

    def trained(mode: str, **kw: Any) -> dict[str, torch.Tensor]:
        model, opt = build(comm, mode, GPT(CFG, device=dev), **kw)
        for step in range(5):
            opt.zero_grad()
            x, y = local_batch(comm, step)
            model(x.to(dev), y.to(dev)).backward()
            opt.step()
        full = opt.full_parameters() if mode.startswith("zero") else model.full_parameters()
        return {k: v.cpu() for k, v in full.items()}

    ref_model = GPT(CFG, device=dev)
    ddp = DistributedDataParallel(ref_model, comm)
    opt = torch.optim.AdamW(ddp.parameters(), **OPT)
    for step in range(5):
        opt.zero_grad()
        x, y = local_batch(comm, step)
        ddp(x.to(dev), y.to(dev)).backward()
        opt.step()
    ref = {k: v.cpu() for k, v in named(ref_model).items()}
    for mode, kw in (("zero2", {}), ("zero3", {}), ("fsdp", fsdp_kw(True, 2))):
        err = differ(trained(mode, **kw), ref, 1e-5, 1e-6)
        if err:
            bad.append(f"{mode} on CUDA vs DDP: {err}")
    return bad


def job_backward_on_another_thread(comm: pc.Communicator) -> list[str]:
    """On CUDA, autograd runs backward on its own device thread, which issues
    the gradient collectives while the caller waits in backward(): here the
    backward of every step runs on a second thread, after this thread issued
    the communicator's first operation. The results equal those of the same
    training with backward on this thread, bit for bit."""
    import threading

    comm.all_reduce(torch.zeros(1))  # this thread issues first

    def trained(mode: str, elsewhere: bool, **kw: Any) -> dict[str, torch.Tensor]:
        if mode == "ddp":
            model = DistributedDataParallel(GPT(CFG), comm)
            opt = torch.optim.AdamW(model.parameters(), **OPT)
        else:
            model, opt = build(comm, mode, GPT(CFG), **kw)
        for step in range(3):
            opt.zero_grad()
            x, y = local_batch(comm, step)
            loss = model(x, y)
            errors: list[BaseException] = []

            def backward(loss: torch.Tensor = loss, errors: list = errors) -> None:
                try:
                    loss.backward()
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            if elsewhere:
                t = threading.Thread(target=backward)
                t.start()
                t.join()
            else:
                backward()
            if errors:
                raise errors[0]
            opt.step()
        if mode == "ddp":
            return {k: v.detach().clone() for k, v in named(model.module).items()}
        full = opt.full_parameters() if mode.startswith("zero") else model.full_parameters()
        return {k: v.detach().clone() for k, v in full.items()}

    bad = []
    for mode, kw in (("ddp", {}), ("zero2", {}), ("zero3", {}), ("fsdp", fsdp_kw(True, 2))):
        try:
            got = trained(mode, True, **kw)
        except Exception as e:  # noqa: BLE001 - the test reports it
            bad.append(f"{mode}: backward on a second thread raised {type(e).__name__}: {e}")
            continue
        err = differ(got, trained(mode, False, **kw), 0.0, 0.0)
        if err:
            bad.append(f"{mode}: backward on a second thread vs this thread: {err}")
    return bad


def test_backward_on_another_thread(pool):
    for r, bad in enumerate(pool(2).run(job_backward_on_another_thread, timeout=240)):
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA build of pycollectives and a GPU")
def test_cuda_tensors(pool):
    for r, bad in enumerate(pool(2).run(job_cuda, timeout=240)):
        assert not bad, f"rank {r}: {bad}"
