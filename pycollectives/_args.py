"""Argument checks of the Communicator's calls, below it: each helper takes what
it checks (the rank, the operation's name, the world size, whether the ranks
span hosts, the device so far), never the communicator. They describe CPU and
CUDA buffers for the C++ core (a CUDA buffer across hosts must be a torch
tensor: it is staged through host memory, _staging.py) and check roots, overlap
and batch_p2p's ops. Every error names the argument, the rank and the
operation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._buffers import describe, describe_cuda, is_cuda_buffer, require_cuda

Buffer = Any  # torch.Tensor | numpy.ndarray | an object with __cuda_array_interface__


def check_root(root: Any, world_size: int, rank: int, arg: str, name: str) -> int:
    """Returns `root` if it is a rank of the group; raises ValueError naming
    `arg`, the rank and the operation otherwise."""
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < world_size:
        raise ValueError(
            f"pycollectives: rank {rank}: {name}: {arg}={root!r} is out of range [0, {world_size})"
        )
    return root


def check_no_overlap(a: tuple, b: tuple, allowed: int | None, rank: int, name: str) -> None:
    """Raises ValueError if byte ranges a=(ptr, nbytes) and b overlap, unless b
    starts exactly at `allowed` (the in-place layout torch uses)."""
    (pa, na), (pb, nb) = a, b
    if na == 0 or nb == 0 or pa + na <= pb or pb + nb <= pa:
        return
    if allowed is not None and pb == allowed:
        return
    raise ValueError(f"pycollectives: rank {rank}: {name}: input and output overlap")


def _require_torch_tensor(rank: int, name: str, buf: Buffer, arg: str) -> None:
    """Across hosts CUDA buffers are staged through torch: raises ValueError for
    another kind (a CuPy array)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not isinstance(buf, torch.Tensor):
        raise ValueError(
            f"pycollectives: rank {rank}: {name}: {arg} is a CUDA {type(buf).__name__}, and "
            "the ranks span hosts, where CUDA buffers are staged through host memory by torch: "
            "pass a torch tensor (torch.as_tensor(x) views it without a copy)"
        )


def cuda_args(
    rank: int,
    across_hosts: bool,
    device_so_far: int | None,
    name: str,
    *specs: tuple[Buffer, str, bool],
) -> tuple:
    """Describes the CUDA buffers of one call: specs are (buffer, argument
    name, writable). Returns ([(address, numel, dtype code)], device,
    current-stream getter); the device of buffers without an address (empty
    ones) is `device_so_far`, else 0. Raises ValueError naming the argument,
    the rank and the operation for a build without CUDA or a machine without
    a device (within one host: across hosts, staging needs torch.cuda only), a
    buffer that is not a torch tensor across hosts, a CPU buffer among CUDA
    ones, or buffers on different devices."""
    if across_hosts:
        for buf, arg, _ in specs:
            if is_cuda_buffer(buf):
                _require_torch_tensor(rank, name, buf, arg)
    else:
        require_cuda(rank, name, specs[0][1])
    descs, device, first, stream = [], None, specs[0][1], None
    for buf, arg, writable in specs:
        ptr, n, dt, dev, get_stream = describe_cuda(buf, rank, name, arg, writable)
        if dev is not None and device is not None and dev != device:
            raise ValueError(
                f"pycollectives: rank {rank}: {name}: {arg} is on cuda:{dev}, but "
                f"{first} is on cuda:{device}: all buffers of one call must be on one device"
            )
        if device is None:
            device, first = dev, arg
        stream = stream or get_stream
        descs.append((ptr, n, dt))
    if device is None:  # empty buffers without an address: the communicator's device
        device = device_so_far if device_so_far is not None else 0
    return descs, device, stream


def p2p_ops(rank: int, world_size: int, ops: Sequence[Any]) -> tuple[list, list]:
    """Checks and describes batch_p2p's CPU `ops` (("send", buffer, dst) or
    ("recv", buffer, src)): returns the core's items (is_send, address,
    numel, dtype code, peer) and the buffers to keep alive. Raises ValueError
    naming ops[i], the rank and the operation for a bad kind, peer or buffer."""
    name, items, keep = "batch_p2p", [], []
    for i, op in enumerate(ops):
        if not (isinstance(op, tuple) and len(op) == 3 and op[0] in ("send", "recv")):
            raise ValueError(
                f"pycollectives: rank {rank}: {name}: ops[{i}]={op!r} is not "
                "('send', buffer, dst) or ('recv', buffer, src)"
            )
        kind, buf, peer = op
        is_send = kind == "send"
        arg = f"ops[{i}]"
        ptr, n, dt = describe(buf, rank, name, arg, writable=not is_send)
        check_root(peer, world_size, rank, f"{arg} peer", name)
        items.append((is_send, ptr, n, dt, peer))
        keep.append(buf)
    return items, keep


def cuda_p2p_ops(ops: Sequence[Any]) -> list[tuple[int, bool]]:
    """The positions of batch_p2p's ops on CUDA buffers, each with whether it
    receives (the rest are checked by p2p_ops)."""
    return [
        (i, op[0] == "recv")
        for i, op in enumerate(ops)
        if isinstance(op, tuple) and len(op) == 3 and is_cuda_buffer(op[1])
    ]
