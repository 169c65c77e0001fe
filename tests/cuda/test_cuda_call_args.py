"""The Python side of the CUDA calls, on any machine: with the extension's
CUDA entry points replaced by recorders, every Communicator operation on
CUDA buffers (objects exporting __cuda_array_interface__, as CuPy's) passes
the arguments the bindings take, in their order (csrc/bindings/
cuda_comm_bindings.cc): the buffers' addresses, the count, the dtype code,
the op or root, the device, the caller's stream, async_op, then the timeout.
A synchronous call makes the stream wait for the Work; an asynchronous one
returns it. The CUDA tests (marked cuda) run the same calls on a GPU."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import pycollectives as pc
from pycollectives import _C
from pycollectives._buffers import describe

pytestmark = pytest.mark.skipif(
    not hasattr(_C, "cuda_all_reduce"), reason="an extension without the CUDA entry points"
)

STREAM = 7  # the stream a buffer's producer announces (__cuda_array_interface__ v3)
F32 = describe(np.zeros(1, np.float32), 0, "test", "x")[2]  # float32's code, as the CPU path's


class FakeCudaArray:
    """A float32 CUDA array as CuPy exports it: only its interface is read."""

    def __init__(self, address: int, numel: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": "<f4",
            "data": (address, False),
            "strides": None,
            "version": 3,
            "stream": STREAM,
        }


class FakeWork:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_stream(self, stream: int, timeout: float) -> bool:
        self.waited.append(stream)
        return True

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def recorded(monkeypatch):
    """A one-rank communicator whose CUDA calls are recorded: (name, args, work)."""
    calls: list = []

    def recorder(name):
        def call(core, *args):
            work = FakeWork()
            calls.append((name, args, work))
            return work

        return call

    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
                 "all_to_all", "send", "recv"):  # fmt: skip
        monkeypatch.setattr(_C, f"cuda_{name}", recorder(name), raising=True)
    monkeypatch.setattr(_C, "cuda_built", lambda: True)
    monkeypatch.setattr(_C, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(_C, "cuda_pointer_device", lambda ptr: 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    comm = pc.init(rank=0, world_size=1)
    try:
        yield comm, calls
    finally:
        comm.close()


@pytest.mark.parametrize("async_op", [False, True])
def test_every_cuda_call_passes_the_bindings_arguments(recorded, async_op):
    comm, calls = recorded
    a, b = FakeCudaArray(0x1000, 12), FakeCudaArray(0x2000, 12)
    sum_, mx = int(pc.ReduceOp.SUM), int(pc.ReduceOp.MAX)
    to = 5.0
    comm.all_reduce(a, pc.ReduceOp.MAX, async_op=async_op, timeout=to)
    comm.reduce_scatter(b, a, async_op=async_op, timeout=to)
    comm.all_gather(b, a, async_op=async_op, timeout=to)
    comm.broadcast(a, 0, async_op=async_op, timeout=to)
    comm.reduce(a, 0, pc.ReduceOp.MAX, async_op=async_op, timeout=to)
    comm.all_to_all(b, a, async_op=async_op, timeout=to)
    tail = (0, STREAM, async_op, to)  # device, stream, async_op, timeout
    want = [
        ("all_reduce", (0x1000, 12, F32, mx, *tail)),
        ("reduce_scatter", (0x2000, 0x1000, 12, F32, sum_, *tail)),
        ("all_gather", (0x2000, 0x1000, 12, F32, *tail)),
        ("broadcast", (0x1000, 12, F32, 0, *tail)),
        ("reduce", (0x1000, 12, F32, mx, 0, *tail)),
        ("all_to_all", (0x2000, 0x1000, 12, F32, *tail)),
    ]
    assert [(n, args) for n, args, _ in calls] == want
    for name, _, work in calls:
        # synchronous: the caller's stream waits for the operation; async: the caller waits later
        assert work.waited == ([] if async_op else [STREAM]), name
