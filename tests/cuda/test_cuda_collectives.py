"""The CUDA path of the Communicator.

Marked `cuda` (skipped without a CUDA build or a device): every collective x
world sizes 2, 3, 4 on one GPU x sizes {0, 1, 7, 1000, 2^20+3} x every dtype
x op, exact on small-integer data (the jobs of test_collectives.py, run on
CUDA copies of their tensors), stream ordering at issue and at Work.wait(),
overlap with compute on another stream, CuPy arrays when CuPy is importable.

Not marked: the CPU-side behaviour, which runs anywhere: CUDA buffers on a
machine (or build) that cannot take them, and CPU/CUDA buffers mixed in one
call, raise ValueError naming the rank, the operation and the argument, and
the communicator stays usable.
"""

from __future__ import annotations

import pytest
import torch
from test_collectives import JOBS, data, mismatches

import pycollectives as pc
from pycollectives import _C

CUDA_OK = bool(getattr(_C, "cuda_built", lambda: False)()) and torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA build of pycollectives and a GPU")
CUDA_WORLD_SIZES = [2, 3, 4]


def _device(comm: pc.Communicator) -> torch.device:
    """Rank r's GPU: all ranks share the GPU on a one-GPU host."""
    return torch.device("cuda", comm.rank % torch.cuda.device_count())


class OnCuda:
    """A Communicator whose methods take the CPU tensors of test_collectives'
    jobs, run the operation on CUDA copies (synchronous calls: the current
    stream waits for them) and copy the results back, so those exact jobs
    check the CUDA path unchanged."""

    def __init__(self, comm: pc.Communicator) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.dev = _device(comm)
        torch.cuda.set_device(self.dev)
        # The first CUDA collective sets the transport up (send/recv need it).
        comm.all_reduce(torch.zeros(1, device=self.dev))

    def __getattr__(self, name: str):
        method = getattr(self.comm, name)

        def call(*args, **kwargs):
            host = [a for a in args if isinstance(a, torch.Tensor)]
            on_gpu = [a.to(self.dev) if isinstance(a, torch.Tensor) else a for a in args]
            out = method(*on_gpu, **kwargs)
            for h, g in zip(host, [a for a in on_gpu if isinstance(a, torch.Tensor)], strict=True):
                h.copy_(g.cpu())  # .cpu() runs on the current stream, after the collective
            return out

        return call


def _cuda_job(job):
    def run(comm: pc.Communicator) -> list[str]:
        return job(OnCuda(comm))

    run.__name__ = run.__qualname__ = f"cuda_{job.__name__}"  # pickled by name
    return run


# Module-level, so that the pool's ranks can unpickle them.
CUDA_JOBS = [_cuda_job(j) for j in JOBS]
for _j in CUDA_JOBS:
    globals()[_j.__name__] = _j


# The two ways a CUDA collective moves its bytes: the direct IPC path (the
# default: kernels read and write the peers' own buffers) and the staging ring.
PATHS = {"direct": None, "ring": {"PYCOLL_ALGO": "ring"}}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world_size", CUDA_WORLD_SIZES)
@pytest.mark.parametrize("job", CUDA_JOBS, ids=lambda j: j.__name__[8:])
def test_cuda_collective_exact(pool, job, world_size, path):
    results = pool(world_size, PATHS[path]).run(job, timeout=400)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad[:40])


# ---- which path ran -------------------------------------------------------------------------

_OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]


def _run_six(comm: pc.Communicator, dev: torch.device, alloc) -> list[str]:
    """Runs the six collectives on int32 CUDA buffers made by alloc(numel)
    (1000 elements per rank and block); returns what came out wrong."""
    n, r, k = comm.world_size, comm.rank, 1000
    bad = []

    def filled(numel: int, value) -> torch.Tensor:
        t = alloc(numel)
        t.copy_(torch.as_tensor(value, dtype=torch.int32).expand(numel).to(dev))
        return t

    x = filled(k, r + 1)
    comm.all_reduce(x)
    if int((x != n * (n + 1) // 2).sum()):
        bad.append("all_reduce wrong")
    out = filled(k, -1)
    comm.reduce_scatter(out, filled(k * n, r + 1))
    if int((out != n * (n + 1) // 2).sum()):
        bad.append("reduce_scatter wrong")
    out = filled(k * n, -1)
    comm.all_gather(out, filled(k, r))
    if not torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32).repeat_interleave(k)):
        bad.append("all_gather wrong")
    x = filled(k, r + 7)
    comm.broadcast(x, n - 1)
    if int((x != n - 1 + 7).sum()):
        bad.append("broadcast wrong")
    x = filled(k, r + 1)
    comm.reduce(x, 0)
    if r == 0 and int((x != n * (n + 1) // 2).sum()):
        bad.append("reduce wrong")
    src = torch.arange(n, dtype=torch.int32).repeat_interleave(k) + 10 * r
    out = filled(k * n, -1)
    comm.all_to_all(out, filled(k * n, src))
    want = torch.arange(n, dtype=torch.int32).repeat_interleave(k) * 10 + r
    if not torch.equal(out.cpu(), want):
        bad.append("all_to_all wrong")
    torch.cuda.synchronize(dev)
    return bad


def job_paths(comm: pc.Communicator, want: str, cupy_async_rank: int) -> list[str]:
    """The six collectives are right and every rank took path `want`
    ("direct" or "slots"); rank `cupy_async_rank` (if >= 0) passes CuPy
    arrays from a stream-ordered pool (cudaMallocAsync), which CUDA IPC cannot
    export, and the others CuPy arrays from cudaMalloc."""
    dev = _device(comm)
    torch.cuda.set_device(dev)
    before = {op: comm.stats().get(op, {}).get("paths", {}).get(want, 0) for op in _OPS}
    if cupy_async_rank < 0:
        bad = _run_six(comm, dev, lambda numel: torch.empty(numel, dtype=torch.int32, device=dev))
    else:
        import cupy

        pool = cupy.cuda.MemoryAsyncPool() if comm.rank == cupy_async_rank else None
        plain = cupy.cuda.MemoryPool()
        with cupy.cuda.Device(dev.index), cupy.cuda.using_allocator((pool or plain).malloc):
            bad = _run_six(
                comm,
                dev,
                lambda numel: torch.as_tensor(cupy.empty(numel, dtype=cupy.int32), device=dev),
            )
    after = comm.stats()
    for op in _OPS:
        got = after.get(op, {}).get("paths", {})
        if got.get(want, 0) - before[op] != 1:
            bad.append(f"{op}: expected one call on the {want} path, counters {got}")
    return bad


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "case",
    ["direct", "ring_forced", "expandable_segments", "one_rank_async_pool"],
)
def test_cuda_path_taken(pool, world_size, case):
    """Direct by default; the staging ring when forced, or when any rank's
    buffers cannot be exported (every rank must then take it, or they hang)."""
    env, want, async_rank = None, "direct", -1
    if case == "ring_forced":
        env, want = PATHS["ring"], "slots"
    elif case == "expandable_segments":
        env, want = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "slots"
    elif case == "one_rank_async_pool":
        pytest.importorskip("cupy")
        want, async_rank = "slots", world_size - 1
    results = pool(world_size, env).run(job_paths, want, async_rank, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


# ---- stream semantics ---------------------------------------------------------------------

_SLEEP_CYCLES = 200_000_000  # ~0.1 s of torch.cuda._sleep on a 1.5-2 GHz GPU


def job_issue_waits_for_caller_stream(comm: pc.Communicator) -> list[str]:
    """The collective must see values written by kernels queued on the
    caller's stream before the call, even if they have not run yet."""
    dev, n, r = _device(comm), comm.world_size, comm.rank
    torch.cuda.set_device(dev)
    bad = []
    for count in (1, 1000, 2**22 + 5):
        x = torch.zeros(count, device=dev)
        torch.cuda._sleep(_SLEEP_CYCLES)  # the fill below runs late
        x.fill_(r + 1)
        comm.all_reduce(x)
        want = n * (n + 1) / 2
        if k := int((x.cpu() != want).sum()):
            bad.append(f"count={count}: {k} elements missed the caller's fill")
    return bad


def job_wait_orders_current_stream(comm: pc.Communicator) -> list[str]:
    """After Work.wait(), work queued on the current stream sees the result
    (wait() blocks the host until the operation is complete on the direct
    path, only until its last kernel is enqueued on the staging ring)."""
    dev, n, r = _device(comm), comm.world_size, comm.rank
    torch.cuda.set_device(dev)
    bad = []
    for count in (7, 2**24 + 3):
        x = torch.full((count,), float(r + 1), device=dev)
        out = torch.empty(count * n, device=dev)
        w1 = comm.all_reduce(x, async_op=True)
        w2 = comm.all_gather(out, x, async_op=True)  # ordered after w1 on the comm's stream
        w1.wait()
        w2.wait()
        y = x.clone()  # the current stream: must run after both collectives
        g = out.clone()
        want = n * (n + 1) / 2
        if k := int((y.cpu() != want).sum()):
            bad.append(f"count={count}: all_reduce result not visible after wait: {k} wrong")
        if k := int((g.cpu() != want).sum()):
            bad.append(f"count={count}: all_gather result not visible after wait: {k} wrong")
        if not w1.is_completed() and not w1.synchronize(timeout=60):
            bad.append("synchronize() timed out")
    return bad


def job_overlaps_other_stream(comm: pc.Communicator) -> list[str]:
    """A collective does not wait for compute queued on another stream: it
    completes while a long kernel still runs there."""
    dev = _device(comm)
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP_CYCLES * 20)  # ~2 s
    x = torch.ones(1 << 20, device=dev)
    comm.all_reduce(x)
    torch.cuda.current_stream(dev).synchronize()
    still_busy = not side.query()
    ok = bool((x == comm.world_size).all().item())
    side.synchronize()
    bad = []
    if not still_busy:
        bad.append("the side stream had finished: the collective waited for it (no overlap)")
    if not ok:
        bad.append("wrong all_reduce result")
    return bad


def job_sync_after_async(comm: pc.Communicator) -> list[str]:
    """A synchronous call issued while asynchronous ones are pending runs after
    them (queued, not on the caller's thread ahead of them), and the caller's
    current device is unchanged by a synchronous call."""
    dev = _device(comm)
    torch.cuda.set_device(dev)
    n = comm.world_size
    xs = [torch.full((4097,), float(comm.rank + k), device=dev) for k in range(3)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    y = torch.ones(4097, device=dev)
    comm.all_reduce(y)  # queued behind the three
    z = torch.ones(1, device=dev)
    comm.all_reduce(z)  # nothing pending now (y has completed): on this thread
    bad = []
    if torch.cuda.current_device() != dev.index:
        bad.append(f"current device changed to {torch.cuda.current_device()}")
    if not all(w.is_completed() for w in works):
        bad.append("a synchronous call returned before the asynchronous ones issued before it")
    for w in works:
        w.wait()
    for k, x in enumerate(xs):
        want = float(sum(r + k for r in range(n)))
        if not bool((x == want).all().item()):
            bad.append(f"async all_reduce {k}: wrong")
    if not bool((y == n).all().item()) or not bool((z == n).all().item()):
        bad.append("synchronous all_reduce: wrong")
    return bad


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world_size", CUDA_WORLD_SIZES)
@pytest.mark.parametrize(
    "job",
    [
        job_issue_waits_for_caller_stream,
        job_wait_orders_current_stream,
        job_overlaps_other_stream,
        job_sync_after_async,
    ],
    ids=lambda j: j.__name__[4:],
)
def test_cuda_stream_semantics(pool, job, world_size, path):
    results = pool(world_size, PATHS[path]).run(job, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


def job_cupy(comm: pc.Communicator) -> list[str]:
    import cupy

    n, r = comm.world_size, comm.rank
    with cupy.cuda.Device(r % cupy.cuda.runtime.getDeviceCount()):
        bad = []
        for count in (0, 7, 2**20 + 3):
            x = cupy.asarray(data(r, count, torch.int32, pc.ReduceOp.SUM, n).numpy())
            comm.all_reduce(x)
            want = sum(data(p, count, torch.int32, pc.ReduceOp.SUM, n) for p in range(n))
            if count and (k := mismatches(torch.from_numpy(cupy.asnumpy(x)), want)):
                bad.append(f"cupy all_reduce count={count}: {k} wrong")
            out = cupy.zeros(count * n, dtype=cupy.float32)
            comm.all_gather(out, cupy.full(count, r, dtype=cupy.float32))
            want_g = cupy.repeat(cupy.arange(n, dtype=cupy.float32), count)
            if count and not bool((out == want_g).all()):
                bad.append(f"cupy all_gather count={count}: wrong")
        return bad


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("world_size", [2, 3])
def test_cuda_cupy_arrays(pool, world_size):
    pytest.importorskip("cupy")
    results = pool(world_size).run(job_cupy, timeout=240)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


def job_cuda_device_errors(comm: pc.Communicator) -> list[str]:
    """Mixed devices in one call and tensors on another GPU raise ValueError."""
    dev, r = _device(comm), comm.rank
    torch.cuda.set_device(dev)
    bad = []
    cases = [
        (
            "all_gather",
            "input",
            lambda: comm.all_gather(torch.zeros(2 * comm.world_size, device=dev), torch.zeros(2)),
        ),
        # A CPU output first: the CPU path, so the error names the CUDA input.
        (
            "reduce_scatter",
            "input",
            lambda: comm.reduce_scatter(
                torch.zeros(2), torch.zeros(2 * comm.world_size, device=dev)
            ),
        ),
    ]
    for op, arg, fn in cases:
        try:
            fn()
            bad.append(f"{op}: no error")
        except ValueError as e:
            if not all(s in str(e) for s in (f"rank {r}", op, arg)):
                bad.append(f"{op}: message does not name rank/op/{arg}: {e}")
    x = torch.ones(3, device=dev)
    comm.all_reduce(x)  # still usable
    if not bool((x == comm.world_size).all().item()):
        bad.append("all_reduce after the errors is wrong")
    return bad


@pytest.mark.cuda
@cuda
def test_cuda_argument_errors(pool):
    results = pool(2).run(job_cuda_device_errors, timeout=120)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


# ---- CPU-side behaviour (runs anywhere) -----------------------------------------------------


class FakeCudaArray:
    """An object exporting __cuda_array_interface__ (as CuPy does) whose
    address is no device memory: whatever the machine, it must be refused
    with a ValueError before any communication."""

    def __init__(self, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (0x7F0000000000, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def job_cuda_refused(comm: pc.Communicator) -> list[str]:
    r, n, bad = comm.rank, comm.world_size, []
    cases = [
        ("all_reduce", "tensor", lambda: comm.all_reduce(FakeCudaArray(4))),
        ("broadcast", "tensor", lambda: comm.broadcast(FakeCudaArray(4), 0)),
        ("reduce", "tensor", lambda: comm.reduce(FakeCudaArray(4), 0)),
        (
            "reduce_scatter",
            "output",
            lambda: comm.reduce_scatter(FakeCudaArray(4), torch.zeros(4 * n)),
        ),
        # CPU first buffer, CUDA second: the mixing error names the CUDA one.
        ("all_gather", "input", lambda: comm.all_gather(torch.zeros(4 * n), FakeCudaArray(4))),
        ("all_to_all", "input", lambda: comm.all_to_all(torch.zeros(4 * n), FakeCudaArray(4 * n))),
        ("send", "tensor", lambda: comm.send(FakeCudaArray(4), (r + 1) % n)),
        ("recv", "tensor", lambda: comm.recv(FakeCudaArray(4), (r + 1) % n)),
    ]
    for op, arg, fn in cases:
        try:
            fn()
            bad.append(f"{op}: no error")
        except ValueError as e:
            msg = str(e)
            if not all(s in msg for s in (f"rank {r}", op, arg)):
                bad.append(f"{op}: message does not name rank {r}, {op} and {arg}: {msg}")
        except Exception as e:  # noqa: BLE001 - reported
            bad.append(f"{op}: {type(e).__name__} instead of ValueError: {e}")
    if not CUDA_OK:
        try:
            comm.all_reduce(FakeCudaArray(4))
        except ValueError as e:
            if "no CUDA device" not in str(e) and "built without CUDA" not in str(e):
                bad.append(f"the error does not say why CUDA is unavailable: {e}")
    t = torch.full((5,), float(r + 1))
    comm.all_reduce(t)  # the communicator was not disturbed
    if not bool((t == n * (n + 1) / 2).all()):
        bad.append("all_reduce after the refused calls is wrong")
    return bad


def test_cuda_buffers_refused_with_clear_errors(pool):
    results = pool(2).run(job_cuda_refused, timeout=120)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


def test_cuda_mixed_message_names_argument():
    """describe() (the CPU path) refuses an interface object with the mixing error."""
    from pycollectives._buffers import describe, is_cuda_buffer

    assert is_cuda_buffer(FakeCudaArray(2))
    assert not is_cuda_buffer(torch.zeros(2))
    with pytest.raises(ValueError, match=r"rank 3: all_gather: input is a CUDA array"):
        describe(FakeCudaArray(2), 3, "all_gather", "input")


@pytest.mark.skipif(CUDA_OK, reason="checks the GPU-less exit")
def test_bench_device_cuda_exits_clearly_without_gpu():
    """`pycollectives-bench --device cuda` and benchmarks/cuda/cuda_collectives.py
    exit with status 2 and say why, before starting any rank."""
    import os
    import subprocess
    import sys

    import paths

    root = str(paths.ROOT)
    for cmd in (
        [sys.executable, "-m", "pycollectives.bench", "--device", "cuda", "--nproc", "2"],
        [sys.executable, os.path.join(root, "benchmarks", "cuda", "cuda_collectives.py")],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 2, (cmd, r.returncode, r.stderr)
        assert "no CUDA device" in r.stderr or "without CUDA" in r.stderr, r.stderr
