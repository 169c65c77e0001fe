"""Turns torch tensors and NumPy arrays into (address, element count, dtype code)
for the C++ core, with errors that name the argument, the rank and the operation."""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # NumPy-only use
    torch = None

# Codes of csrc/core/types.h DataType.
_NUMPY_CODES = {
    np.dtype(np.float32): 0,
    np.dtype(np.float64): 1,
    np.dtype(np.float16): 2,
    np.dtype(np.int8): 4,
    np.dtype(np.uint8): 5,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
}
_TORCH_CODES: dict[Any, int] = {}
if torch is not None:
    _TORCH_CODES = {
        torch.float32: 0,
        torch.float64: 1,
        torch.float16: 2,
        torch.bfloat16: 3,
        torch.int8: 4,
        torch.uint8: 5,
        torch.int32: 6,
        torch.int64: 7,
    }
    _Tensor = torch.Tensor
    from . import _C

    _C.set_torch_dtypes([d for d, _ in sorted(_TORCH_CODES.items(), key=lambda kv: kv[1])])
else:
    _Tensor = ()
DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
ITEMSIZE = [4, 8, 2, 2, 1, 1, 4, 8]


def describe(buf: Any, rank: int, op: str, arg: str, writable: bool = True) -> tuple[int, int, int]:
    """Returns (address, numel, dtype code) of a contiguous CPU buffer.

    Raises TypeError for an object that is not a tensor or array, or of an
    unsupported dtype; ValueError for a non-contiguous buffer, a CUDA tensor,
    or a read-only array where the operation writes (`writable`).
    """
    if isinstance(buf, _Tensor):
        code = _TORCH_CODES.get(buf.dtype)
        if code is not None and buf.is_cpu and buf.is_contiguous():  # the fast path
            return buf.data_ptr(), buf.numel(), code
        if code is None:
            raise TypeError(
                f"pycollectives: rank {rank}: {op}: {arg} has unsupported dtype {buf.dtype}; "
                f"supported: {', '.join(DTYPE_NAMES)}"
            )
        if buf.is_cuda:
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is a CUDA tensor, but pycollectives "
                "was built without CUDA (the CPU path takes CPU tensors)"
            )
        if buf.device.type != "cpu":
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is on {buf.device}, not the CPU"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is not contiguous "
                "(call .contiguous() and copy the result back)"
            )
        return buf.data_ptr(), buf.numel(), code
    if isinstance(buf, np.ndarray):
        code = _NUMPY_CODES.get(buf.dtype)
        if code is None:
            raise TypeError(
                f"pycollectives: rank {rank}: {op}: {arg} has unsupported dtype {buf.dtype}; "
                f"supported: {', '.join(n for n in DTYPE_NAMES if n != 'bfloat16')}"
            )
        if not buf.flags.c_contiguous:
            raise ValueError(f"pycollectives: rank {rank}: {op}: {arg} is not C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError(f"pycollectives: rank {rank}: {op}: {arg} is read-only")
        return buf.ctypes.data, buf.size, code
    raise TypeError(
        f"pycollectives: rank {rank}: {op}: {arg} must be a torch.Tensor or numpy.ndarray, "
        f"not {type(buf).__name__}"
    )
