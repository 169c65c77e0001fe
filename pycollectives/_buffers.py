"""Turns torch tensors and NumPy arrays into (address, element count, dtype code)
for the C++ core, with errors that name the argument, the rank and the operation."""

from __future__ import annotations

from collections.abc import Callable
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

    _C.set_torch(
        torch.Tensor,
        [d for d, _ in sorted(_TORCH_CODES.items(), key=lambda kv: kv[1])],
        torch.UntypedStorage,
    )
else:
    _Tensor = ()
DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
ITEMSIZE = [4, 8, 2, 2, 1, 1, 4, 8]


def _check_not_negated(buf: Any, rank: int, op: str, arg: str) -> None:
    """Raises ValueError for a tensor with torch's negative bit set: a lazily negated
    view (``z.conj().imag``, ``torch._neg_view``) stores the negation of its values,
    so its bytes are not what it holds."""
    if buf.is_neg():
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} is a negated view (its negative bit is "
            "set, as in z.conj().imag): call .resolve_neg() and copy the result back"
        )


def _check_in_storage(buf: Any, rank: int, op: str, arg: str) -> None:
    """Raises ValueError for a tensor whose bytes are not all inside its storage: torch
    keeps a tensor's sizes when its storage is resized under it (FSDP frees a parameter
    by resizing its storage to 0), so they alone would send the core past the memory."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0:
        return
    storage = buf.untyped_storage()
    start = buf.data_ptr() - storage.data_ptr()
    if buf.data_ptr() == 0 or start < 0 or start + nbytes > storage.nbytes():
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} needs {nbytes} bytes at offset "
            f"{max(start, 0)} of its storage, which holds {storage.nbytes()} (was the storage "
            "resized, as FSDP does to free a parameter?)"
        )


def describe(buf: Any, rank: int, op: str, arg: str, writable: bool = True) -> tuple[int, int, int]:
    """Returns (address, numel, dtype code) of a contiguous CPU buffer.

    Raises TypeError for an object that is not a tensor or array, or of an
    unsupported dtype; ValueError for a non-contiguous buffer, a CUDA tensor,
    or a read-only array where the operation writes (`writable`).
    """
    if isinstance(buf, _Tensor):
        view = _C.view_tensor(buf)  # contiguous CPU tensor of a supported dtype, else None
        if view is not None:
            _check_in_storage(buf, rank, op, arg)  # view_tensor trusts a shrunk one's sizes
            return view
        code = _TORCH_CODES.get(buf.dtype)
        if code is None:
            raise TypeError(
                f"pycollectives: rank {rank}: {op}: {arg} has unsupported dtype {buf.dtype}; "
                f"supported: {', '.join(DTYPE_NAMES)}"
            )
        if buf.is_cuda:
            if not cuda_built():
                raise ValueError(
                    f"pycollectives: rank {rank}: {op}: {arg} is a CUDA tensor, but pycollectives "
                    "was built without CUDA (the CPU path takes CPU tensors)"
                )
            raise ValueError(_MIXED.format(rank=rank, op=op, arg=arg, what="a CUDA tensor"))
        if buf.device.type != "cpu":
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is on {buf.device}, not the CPU"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is not contiguous "
                "(call .contiguous() and copy the result back)"
            )
        _check_not_negated(buf, rank, op, arg)
        _check_in_storage(buf, rank, op, arg)
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
    if hasattr(buf, "__cuda_array_interface__"):
        raise ValueError(
            _MIXED.format(rank=rank, op=op, arg=arg, what=f"a CUDA array ({type(buf).__name__})")
        )
    raise TypeError(
        f"pycollectives: rank {rank}: {op}: {arg} must be a torch.Tensor or numpy.ndarray, "
        f"not {type(buf).__name__}"
    )


# ---- CUDA buffers -------------------------------------------------------------------------

_MIXED = (
    "pycollectives: rank {rank}: {op}: {arg} is {what}, but this call runs on the CPU path (its "
    "first buffer is a CPU buffer, or the operation takes CPU buffers only): all buffers of one "
    "call must be on the same device"
)
# __cuda_array_interface__ typestr -> DataType code (no standard typestr for bfloat16).
_CAI_CODES = {np.dtype(k).str: v for k, v in _NUMPY_CODES.items()}


def cuda_built() -> bool:
    """Whether the extension was compiled with the CUDA path."""
    from . import _C

    built = getattr(_C, "cuda_built", None)
    return bool(built is not None and built())


def is_cuda_buffer(buf: Any) -> bool:
    """True for a CUDA torch tensor or an object exporting __cuda_array_interface__ (CuPy)."""
    if isinstance(buf, _Tensor):
        return buf.is_cuda
    return not isinstance(buf, np.ndarray) and hasattr(buf, "__cuda_array_interface__")


def require_cuda(rank: int, op: str, arg: str) -> None:
    """Raises ValueError naming `arg`, the rank and the operation when CUDA
    buffers cannot be used here: a build without CUDA, or no CUDA device."""
    from . import _C

    if not cuda_built():
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} is a CUDA buffer, but pycollectives was "
            "built without CUDA (the CPU path takes CPU tensors)"
        )
    if _C.cuda_device_count() == 0:
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} is a CUDA buffer, but there is no CUDA "
            "device (no driver, or cudaGetDeviceCount found none): pycollectives can only run "
            "without CUDA here"
        )


def _cai_contiguous(shape: tuple, strides: Any, itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def describe_cuda(
    buf: Any, rank: int, op: str, arg: str, writable: bool = True
) -> tuple[int, int, int, int | None, Callable[[], int]]:
    """Returns (device address, numel, dtype code, device index, current-stream getter)
    of a contiguous CUDA buffer: a CUDA torch tensor, or an object with
    __cuda_array_interface__ (CuPy). The getter returns the caller's current
    stream (an int cudaStream_t) when called. The device is None for an
    empty interface buffer with no address.

    Raises ValueError for a CPU buffer (mixing), a non-contiguous or read-only
    (`writable`) buffer or a masked array; TypeError for an unsupported dtype.
    """
    if isinstance(buf, _Tensor):
        if not buf.is_cuda:
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is on {buf.device}, but the other "
                "buffers of this call are CUDA buffers: all buffers of one call must be on the "
                "same device"
            )
        code = _TORCH_CODES.get(buf.dtype)
        if code is None:
            raise TypeError(
                f"pycollectives: rank {rank}: {op}: {arg} has unsupported dtype {buf.dtype}; "
                f"supported: {', '.join(DTYPE_NAMES)}"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} is not contiguous "
                "(call .contiguous() and copy the result back)"
            )
        _check_not_negated(buf, rank, op, arg)
        _check_in_storage(buf, rank, op, arg)
        dev = buf.device.index if buf.device.index is not None else torch.cuda.current_device()
        return (
            buf.data_ptr(),
            buf.numel(),
            code,
            dev,
            lambda: torch.cuda.current_stream(dev).cuda_stream,
        )
    cai = (
        getattr(buf, "__cuda_array_interface__", None) if not isinstance(buf, np.ndarray) else None
    )
    if not isinstance(cai, dict):
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} is a {type(buf).__name__} in host memory, "
            "but the other buffers of this call are CUDA buffers: all buffers of one call must be "
            "on the same device"
        )
    try:
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
        ptr = int(ptr or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"pycollectives: rank {rank}: {op}: {arg} has a malformed __cuda_array_interface__ ({e})"
        ) from None
    try:
        dt = np.dtype(typestr)
    except TypeError:
        dt = None
    code = _CAI_CODES.get(dt.str) if dt is not None else None
    if code is None:
        raise TypeError(
            f"pycollectives: rank {rank}: {op}: {arg} has unsupported dtype {typestr!r}; "
            f"supported: {', '.join(n for n in DTYPE_NAMES if n != 'bfloat16')}"
        )
    if cai.get("mask") is not None:
        raise ValueError(f"pycollectives: rank {rank}: {op}: {arg} is a masked array")
    if not _cai_contiguous(shape, cai.get("strides"), dt.itemsize):
        raise ValueError(f"pycollectives: rank {rank}: {op}: {arg} is not C-contiguous")
    if writable and readonly:
        raise ValueError(f"pycollectives: rank {rank}: {op}: {arg} is read-only")
    numel = 1
    for d in shape:
        numel *= d
    require_cuda(rank, op, arg)
    from . import _C

    dev = getattr(getattr(buf, "device", None), "id", None)  # CuPy
    if not isinstance(dev, int):
        dev = _C.cuda_pointer_device(ptr) if ptr else None
        if dev is not None and dev < 0:
            raise ValueError(
                f"pycollectives: rank {rank}: {op}: {arg} exports __cuda_array_interface__ but "
                "its address is not device memory"
            )
    if type(buf).__module__.split(".")[0] == "cupy":
        import cupy

        def stream() -> int:
            return int(cupy.cuda.get_current_stream().ptr)
    else:
        # The producer's stream (CAI v3): 1 legacy default, 2 per-thread default, None: none.
        s = int(cai.get("stream") or 0)

        def stream() -> int:
            return s

    return ptr, numel, code, dev, stream
