"""The CUDA side of the Communicator's calls: describing and checking their
CUDA buffers for the C++ core, keeping them alive until a CUDA operation
completes, and, where the ranks span hosts, running the operation on pinned
host copies of them instead (_staging.py). Every error names the argument,
the rank and the operation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._buffers import describe, describe_cuda, is_cuda_buffer, require_cuda
from ._staging import Staged, Stager, TorchCudaOps, cache_bytes_from_env
from .work import CudaWork, Timeout, Work

if TYPE_CHECKING:
    from .communicator import Communicator

Buffer = Any  # torch.Tensor | numpy.ndarray | an object with __cuda_array_interface__


def _require_torch_tensor(comm: Communicator, name: str, buf: Buffer, arg: str) -> None:
    """Across hosts CUDA buffers are staged through torch: raises ValueError for
    another kind (a CuPy array)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not isinstance(buf, torch.Tensor):
        raise ValueError(
            f"pycollectives: rank {comm.rank}: {name}: {arg} is a CUDA {type(buf).__name__}, and "
            "the ranks span hosts, where CUDA buffers are staged through host memory by torch: "
            "pass a torch tensor (torch.as_tensor(x) views it without a copy)"
        )


def cuda_args(comm: Communicator, name: str, *specs: tuple[Buffer, str, bool]) -> tuple:
    """Describes the CUDA buffers of one call: specs are (buffer, argument
    name, writable). Returns ([(address, numel, dtype code)], device,
    current-stream getter). Raises ValueError naming the argument, the rank
    and the operation for a build without CUDA or a machine without a device
    (within one host: across hosts, staging needs torch.cuda only), a buffer
    that is not a torch tensor across hosts, a CPU buffer among CUDA ones,
    or buffers on different devices."""
    if comm._across_hosts:
        for buf, arg, _ in specs:
            if is_cuda_buffer(buf):
                _require_torch_tensor(comm, name, buf, arg)
    else:
        require_cuda(comm.rank, name, specs[0][1])
    descs, device, first, stream = [], None, specs[0][1], None
    for buf, arg, writable in specs:
        ptr, n, dt, dev, get_stream = describe_cuda(buf, comm.rank, name, arg, writable)
        if dev is not None and device is not None and dev != device:
            raise ValueError(
                f"pycollectives: rank {comm.rank}: {name}: {arg} is on cuda:{dev}, but "
                f"{first} is on cuda:{device}: all buffers of one call must be on one device"
            )
        if device is None:
            device, first = dev, arg
        stream = stream or get_stream
        descs.append((ptr, n, dt))
    if device is None:  # empty buffers without an address: the communicator's device
        device = comm._cuda_device if comm._cuda_device is not None else 0
    comm._cuda_device = device
    return descs, device, stream


def cuda_ret(
    comm: Communicator, work: Any, async_op: bool, stream: Any, *buffers: Buffer
) -> Work | None:
    """Keeps the buffers alive until the CUDA operation completes; returns a
    CudaWork, or (synchronous call) makes the current stream wait for it."""
    comm._prune()
    comm._inflight.append((work, buffers))
    if async_op:
        return CudaWork(work, comm, stream)
    work.wait_stream(stream(), -1.0)
    return None


def describe_pair(comm: Communicator, name: str, output: Buffer, input: Buffer) -> tuple:  # noqa: A002
    """Describes the output (written) and input (read) of one call, which
    must share a dtype: returns ((ptr, numel, dtype) of output, the same of
    input, None or (device, current-stream getter) for CUDA buffers).
    Raises ValueError naming the argument, the rank and the operation."""
    if is_cuda_buffer(output):
        [o, i], dev, stream = cuda_args(
            comm, name, (output, "output", True), (input, "input", False)
        )
        cuda = (dev, stream)
    else:
        o = describe(output, comm.rank, name, "output")
        i = describe(input, comm.rank, name, "input", writable=False)
        cuda = None
    if o[2] != i[2]:
        raise ValueError(
            f"pycollectives: rank {comm.rank}: {name}: output dtype differs from input dtype"
        )
    return o, i, cuda


def stage(
    comm: Communicator, bufs: Sequence[Staged], call: Callable[[list, bool], Any], async_op: bool
) -> Any:
    """Across hosts: runs call(host buffers, async_op), the CPU operation, on
    pinned host copies of the CUDA buffers `bufs` (see _staging.Stager.run);
    returns its result, or a StagedWork with async_op."""
    if comm._stager is None:
        comm._stager = Stager(TorchCudaOps(), cache_bytes_from_env(comm.rank))
    return comm._stager.run(comm, bufs, call, async_op)


def stage_pair(
    comm: Communicator,
    output: Buffer,
    input: Buffer,  # noqa: A002
    call: Callable[[Any, Any, bool], Any],
    async_op: bool,
) -> Any:
    """stage() for an operation reading `input` and writing `output`."""
    bufs = [Staged(output, "output", False, True), Staged(input, "input", True, False)]
    return stage(comm, bufs, lambda h, a: call(h[0], h[1], a), async_op)


def stage_batch_p2p(
    comm: Communicator, ops: Sequence[Any], async_op: bool, timeout: Timeout
) -> Work | None:
    """batch_p2p across hosts with CUDA buffers among `ops`: each is checked
    (naming ops[i]), then the batch runs on host copies of them (sends copied
    in, receives copied back) and the CPU buffers as they are."""
    name, bufs, where = "batch_p2p", [], []
    for i, op in enumerate(ops):
        if isinstance(op, tuple) and len(op) == 3 and is_cuda_buffer(op[1]):
            recv = op[0] == "recv"
            cuda_args(comm, name, (op[1], f"ops[{i}]", recv))
            bufs.append(Staged(op[1], f"ops[{i}]", not recv, recv))
            where.append(i)

    def call(hosts: list, a: bool) -> Work | None:
        host_ops = list(ops)
        for i, h in zip(where, hosts, strict=True):
            host_ops[i] = (ops[i][0], h, ops[i][2])
        return comm.batch_p2p(host_ops, async_op=a, timeout=timeout)

    return stage(comm, bufs, call, async_op)
