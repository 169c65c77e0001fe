"""Host staging of CUDA tensors across hosts (pycollectives/_staging.py), on the
CPU: the device side is a fake (FakeGpu) whose copies run only when the stream
they were enqueued on is made to run (an event synchronized or waited for, or
the test draining it), as a GPU's would run some time after they were issued.
So a stager that let the CPU operation read a host buffer before its copy in
was waited for, copied back on the wrong stream, forgot the current stream's
wait, or reused a pinned buffer whose copy back was still pending, computes a
wrong value here. Also: the pinned-buffer cache's bounds and reuse, an
asynchronous operation's Work (wait, timeout, is_completed, errors), the
errors of bad settings and non-torch CUDA buffers across hosts, and (2 ranks)
the stager around the real CPU collectives, synchronous and asynchronous.
The same path on real GPUs: tests/multihost/test_multihost_cuda.py (marked cuda)."""

from __future__ import annotations

import types

import pytest
import torch

import pycollectives as pc
from pycollectives._args import cuda_args
from pycollectives._staging import (
    PinnedCache,
    Staged,
    StagedWork,
    Stager,
    TorchCudaOps,
    cache_bytes_from_env,
)
from pycollectives.work import Work


class Event:
    def __init__(self, stream: Stream, pos: int) -> None:
        self.stream, self.pos = stream, pos


class Stream:
    """Work enqueued runs only when run_to() reaches it."""

    def __init__(self, name: str) -> None:
        self.name, self.queue, self.done = name, [], 0

    def run_to(self, pos: int) -> None:
        while self.done < pos:
            self.queue[self.done]()
            self.done += 1

    def drain(self) -> None:
        self.run_to(len(self.queue))


class FakeGpu:
    """DeviceOps whose "device" tensors are CPU tensors and whose copies wait
    in their stream's queue; `log` records every call in order."""

    def __init__(self) -> None:
        self.current = Stream("s0")
        self.log: list[str] = []
        self.pinned_made = 0

    def current_stream(self, tensor):
        return self.current

    def pinned(self, nbytes):
        self.pinned_made += 1
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # NaN / -1 until written

    def copy(self, dst, src, stream):
        self.log.append(f"copy on {stream.name}")
        stream.queue.append(lambda: dst.copy_(src))

    def record(self, stream):
        self.log.append(f"record on {stream.name}")
        return Event(stream, len(stream.queue))

    def synchronize(self, event):
        self.log.append("synchronize")
        event.stream.run_to(event.pos)

    def query(self, event):
        return event.stream.done >= event.pos

    def stream_wait(self, stream, event):
        self.log.append(f"{stream.name} waits")
        stream.queue.append(lambda: event.stream.run_to(event.pos))


class CoreWork:
    """The core's side of an asynchronous CPU operation, finished by the test."""

    def __init__(self, finish) -> None:
        self.finish, self.done, self.error, self.source = finish, False, None, -1

    def complete(self, error: Exception | None = None) -> None:
        if error is None:
            self.finish()
        self.done, self.error = True, error

    def wait(self, seconds: float) -> bool:
        if self.done and self.error is not None:
            raise self.error
        return self.done

    def is_completed(self) -> bool:
        return self.done


OWNER = types.SimpleNamespace(_prune=lambda: None)


def doubled(gpu: FakeGpu, core: list | None = None):
    """A CPU "all-reduce" of 2 equal ranks: doubles the host buffer, checking
    that the copy in has landed (no 0xFF byte left)."""

    def call(hosts, async_op):
        gpu.log.append("cpu operation")
        assert not (hosts[0].view(torch.uint8) == 0xFF).any(), "read before the copy in landed"
        if not async_op:
            hosts[0].mul_(2)
            return None
        core.append(CoreWork(lambda: hosts[0].mul_(2)))
        return Work(core[-1], OWNER)

    return call


def test_synchronous_order_copy_in_waited_then_copy_back_on_the_current_stream():
    gpu = FakeGpu()
    stager = Stager(gpu)
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert stager.run(OWNER, [Staged(x, "tensor", True, True)], doubled(gpu), False) is None
    assert gpu.log == [
        "copy on s0",
        "record on s0",
        "synchronize",
        "cpu operation",
        "copy on s0",
        "record on s0",
    ]
    assert torch.equal(x, torch.arange(6.0).view(2, 3)), "the copy back blocked the host"
    gpu.current.drain()  # the GPU runs the stream
    assert torch.equal(x, 2 * torch.arange(6.0).view(2, 3))


def test_asynchronous_work_copies_back_at_wait_and_orders_the_waiting_stream():
    gpu, core = FakeGpu(), []
    stager = Stager(gpu)
    x = torch.ones(1000, dtype=torch.bfloat16)
    w = stager.run(OWNER, [Staged(x, "tensor", True, True)], doubled(gpu, core), True)
    assert isinstance(w, StagedWork) and isinstance(w, Work)
    assert not w.is_completed() and w.wait(timeout=0.01) is False
    assert gpu.log[-1] == "cpu operation", "copied back before the operation finished"
    core[0].complete()
    issue_stream = gpu.current
    gpu.current = Stream("s1")  # the caller waits on another stream than it issued on
    assert w.wait() is True
    assert gpu.log[-3:] == ["copy on s0", "record on s0", "s1 waits"]
    assert torch.equal(x, torch.ones(1000, dtype=torch.bfloat16)), "wait() blocked the host"
    assert not w.is_completed(), "completed before the copy back ran"
    gpu.current.drain()  # s1 runs: its wait runs s0's copy back first
    assert issue_stream.done == len(issue_stream.queue)
    assert torch.equal(x, torch.full((1000,), 2, dtype=torch.bfloat16)) and w.is_completed()
    assert w.wait() is True and gpu.log.count("copy on s0") == 2  # copied back once


def test_is_completed_alone_finishes_the_copy_back():
    gpu, core = FakeGpu(), []
    x = torch.full((5,), 3, dtype=torch.int64)
    w = Stager(gpu).run(OWNER, [Staged(x, "tensor", True, True)], doubled(gpu, core), True)
    core[0].complete()
    assert not w.is_completed()  # the copy back is enqueued now, not yet run
    gpu.current.drain()
    assert w.is_completed() and torch.equal(x, torch.full((5,), 6, dtype=torch.int64))


def test_failed_asynchronous_operation_raises_copies_nothing_back_and_frees_its_buffers():
    gpu, core = FakeGpu(), []
    stager = Stager(gpu)
    x = torch.ones(8)
    w = stager.run(OWNER, [Staged(x, "tensor", True, True)], doubled(gpu, core), True)
    err = pc.PeerFailure("pycollectives: rank 1 died")
    core[0].complete(err)
    assert w.is_completed() and w.exception() is err
    with pytest.raises(pc.PeerFailure, match="rank 1 died"):
        w.wait()
    gpu.current.drain()
    assert torch.equal(x, torch.ones(8)) and gpu.log.count("copy on s0") == 1
    assert len(stager.cache) == 1


def test_bad_arguments_raise_unchanged_and_free_the_buffers():
    gpu = FakeGpu()
    stager = Stager(gpu)

    def call(hosts, async_op):
        raise ValueError("pycollectives: rank 0: broadcast: src=5 is out of range [0, 2)")

    with pytest.raises(ValueError, match="rank 0: broadcast: src=5"):
        stager.run(OWNER, [Staged(torch.ones(4), "tensor", False, True)], call, False)
    assert len(stager.cache) == 1 and "copy on s0" not in gpu.log


def test_only_what_the_operation_reads_is_copied_in_and_what_it_writes_copied_back():
    gpu = FakeGpu()
    out, inp = torch.zeros(6), torch.arange(3.0)

    def gather(hosts, async_op):  # all_gather of 2 equal ranks
        hosts[0].copy_(torch.cat([hosts[1], hosts[1]]))

    bufs = [Staged(out, "output", False, True), Staged(inp, "input", True, False)]
    Stager(gpu).run(OWNER, bufs, gather, False)
    gpu.current.drain()
    assert torch.equal(out, torch.tensor([0.0, 1, 2, 0, 1, 2])) and torch.equal(
        inp, torch.arange(3.0)
    )
    assert gpu.log.count("copy on s0") == 2  # the input in, the output back


def test_pinned_buffers_are_reused_bounded_and_reused_only_after_their_copy_back():
    gpu = FakeGpu()
    stager = Stager(gpu, cache_bytes=4096)
    for _ in range(5):
        x = torch.ones(256)  # 1 KiB
        stager.run(OWNER, [Staged(x, "tensor", True, True)], doubled(gpu), False)
    assert gpu.pinned_made == 1, "a pinned buffer was allocated per call"
    # A receive reuses the buffer whose copy back to x has not run yet, and
    # writes it from the CPU: take() must have run that copy back first.
    y = torch.zeros(256)
    recv = lambda h, a: h[0].fill_(7.0)  # noqa: E731
    stager.run(OWNER, [Staged(y, "tensor", False, True)], recv, False)
    gpu.current.drain()
    assert torch.equal(x, torch.full((256,), 2.0)) and torch.equal(y, torch.full((256,), 7.0))
    big = torch.ones(2048)  # 8 KiB > the cache's 4 KiB: pinned per call, never kept
    for _ in range(2):
        stager.run(OWNER, [Staged(big, "tensor", True, True)], doubled(gpu), False)
    assert gpu.pinned_made == 3 and stager.cache.cached_bytes <= 4096
    cache = PinnedCache(gpu, max_bytes=1 << 20, max_buffers=2)
    bufs = [cache.take(n) for n in (10, 20, 30)]
    for b in bufs:
        cache.give(b, None)
    assert len(cache) == 2 and sorted(b.numel() for b, _ in cache._free.values()) == [20, 30]
    cache = PinnedCache(gpu, max_bytes=45)
    for n in (10, 20, 30):
        cache.give(cache.take(n), None)
    assert cache.cached_bytes == 30  # the least recently returned went first
    assert cache.take(30) is not None and len(cache) == 0


def test_torch_copy_back_writes_parameters_and_inference_tensors():
    """TorchCudaOps.copy (the real device copy; stream None: the current one,
    here on CPU tensors) writes outside autograd: into a Parameter, a view of
    one, and an inference tensor outside inference mode (a wait() made after
    leaving the mode the operation was issued in), as c10d's copies do."""
    ops = TorchCudaOps()
    p = torch.nn.Parameter(torch.zeros(3, 2))
    with torch.inference_mode():
        inf = torch.zeros(3)
    ops.copy(p, torch.ones(3, 2), None)
    ops.copy(p[:, 1], torch.full((3,), 2.0), None)
    ops.copy(inf, torch.full((3,), 3.0), None)
    assert p.tolist() == [[1.0, 2.0]] * 3 and p.is_leaf and p.requires_grad
    assert inf.tolist() == [3.0] * 3


def test_cache_size_setting(monkeypatch):
    monkeypatch.setenv("PYCOLL_STAGING_CACHE_MB", "1.5")
    assert cache_bytes_from_env(0) == 3 << 19
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("PYCOLL_STAGING_CACHE_MB", bad)
        with pytest.raises(ValueError, match="rank 3: PYCOLL_STAGING_CACHE_MB"):
            cache_bytes_from_env(3)


def test_a_cuda_array_that_is_not_a_torch_tensor_is_refused_across_hosts_naming_it():
    class CupyLike:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1, False)}

    with pytest.raises(ValueError, match=r"rank 2: all_gather: input is a CUDA CupyLike.*torch"):
        cuda_args(
            2,
            True,
            None,
            "all_gather",
            (torch.ones(2), "output", True),
            (CupyLike(), "input", False),
        )


# ---- around the real CPU collectives (2 ranks) ---------------------------------------------


def job_stager_around_collectives(comm: pc.Communicator) -> list[str]:
    gpu, bad, r = FakeGpu(), [], comm.rank
    stager = Stager(gpu)
    for _ in range(2):  # the second reuses the first's pinned buffer
        x = torch.full((70_001,), float(r + 1))  # past the one-shot size
        call = lambda h, a: comm.all_reduce(h[0])  # noqa: E731
        stager.run(comm, [Staged(x, "tensor", True, True)], call, False)
        gpu.current.drain()
        bad += [] if torch.equal(x, torch.full((70_001,), 3.0)) else ["sync all_reduce"]
    out, inp = torch.zeros(6), torch.full((3,), float(r))
    bufs = [Staged(out, "output", False, True), Staged(inp, "input", True, False)]
    w = stager.run(comm, bufs, lambda h, a: comm.all_gather(h[0], h[1], async_op=a), True)
    w.wait()
    gpu.current.drain()
    if not (w.is_completed() and torch.equal(out, torch.tensor([0.0] * 3 + [1.0] * 3))):
        bad.append(f"async all_gather: {out.tolist()}")
    t = torch.full((4,), float(r))
    if r == 0:
        stager.run(comm, [Staged(t, "tensor", True, False)], lambda h, a: comm.send(h[0], 1), False)
    else:
        got = stager.run(
            comm, [Staged(t, "tensor", False, True)], lambda h, a: comm.recv(h[0], 0), False
        )
        gpu.current.drain()
        bad += [] if got == 0 and torch.equal(t, torch.zeros(4)) else [f"recv: {got} {t}"]
    if gpu.pinned_made != 4:  # one per size: 280 KB, 24 B and 12 B, 16 B
        bad.append(f"{gpu.pinned_made} pinned buffers made, not 4")
    return bad


def test_stager_around_the_real_cpu_collectives(pool):
    for r, bad in enumerate(pool(2).run(job_stager_around_collectives, timeout=60)):
        assert not bad, f"rank {r}: {bad}"
