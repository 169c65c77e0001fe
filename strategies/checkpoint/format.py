"""The on-disk format: one safetensors file per rank plus a JSON index.

    DIR/index.json                        names, global shapes, dtypes, every piece
    DIR/shard-00000-of-00004.safetensors  rank 0's pieces
    ...

Why safetensors written by our own ~60 lines rather than
torch.distributed.checkpoint (DCP) or the `safetensors` package:

- Anyone can open it: a safetensors file is an 8-byte little-endian header
  length, a JSON header ({key: {dtype, shape, data_offsets}}, plus a
  string-to-string "__metadata__"), then the raw bytes. The `safetensors`
  package, numpy (json + np.frombuffer) or any language reads it; DCP's
  .distcp files are pickles plus torch's storage format, readable with torch
  alone (and unpickling is code execution).
- It streams: the header is known from the pieces' metadata before any byte,
  so a rank writes one tensor after the other (a contiguous CPU copy of one
  tensor at a time, one fsync), and a reader seeks to the bytes it needs
  (os.pread) instead of loading the file.
- No dependency: the `safetensors` package (0.8) would write the same bytes
  from a dict of contiguous CPU tensors, but without an fsync before the
  directory is renamed (which atomicity needs), and it would become a
  requirement of the library; the tests use it to read our files.
- Layouts stay ours: each tensor in a rank's file is one *piece* (pieces.py);
  the index says which part of which global tensor it is, so a loader in any
  other layout finds the bytes it needs. Padding is never written.

index.json:

    {"format": "pycollectives-checkpoint", "version": 1, "world_size": 4,
     "files": {"shard-00000-of-00004.safetensors": {"rank": 0, "bytes": 123456}, ...},
     "tensors": {"blocks.0.attn.qkv.weight": {"shape": [48, 16], "dtype": "F32"}, ...},
     "pieces": [{"tensor": "blocks.0.attn.qkv.weight", "file": "shard-00000-of-00004.safetensors",
                 "key": "blocks.0.attn.qkv.weight", "offsets": [0, 0], "sizes": [48, 16],
                 "flat": [0, 200]}, ...],
     "extra": {...}}

A piece's key in its file is its tensor's name (with "#k" appended when one
rank holds several pieces of a tensor); the stored tensor is 1-D when the
piece is a flat range, else shaped as its box.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

    from .pieces import Piece

__all__ = [
    "FORMAT",
    "INDEX",
    "ITEMSIZE",
    "dtype_from_name",
    "dtype_name",
    "file_name",
    "read_index",
    "read_range",
    "read_stats",
    "write_safetensors",
]

FORMAT, VERSION, INDEX = "pycollectives-checkpoint", 1, "index.json"
# safetensors dtype names and their sizes (this module imports torch only to
# write or name torch dtypes: consolidation.py itself uses none)
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
ITEMSIZE.update({"U8": 1, "BOOL": 1})
CHUNK = 16 << 20  # bytes per write call
_STATS = {"bytes_read": 0, "reads": 0, "header_bytes": 0}


def _torch_dtypes() -> dict[Any, str]:
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype (None: not storable)."""
    return _torch_dtypes().get(dtype)


def dtype_from_name(name: str, what: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ValueError naming `what` if unknown."""
    names = {v: k for k, v in _torch_dtypes().items()}
    if name not in names:
        raise ValueError(f"{what}: dtype {name!r} is not one of {sorted(names)}")
    return names[name]


# Test seam: called with (file, bytes written so far) after every chunk a
# writer writes (the kill-mid-save test kills the rank from here).
on_chunk: Callable[[str, int], None] | None = None


def file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def _keys(pieces: list[Piece]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for p in pieces:
        k = seen.get(p.tensor, 0)
        seen[p.tensor] = k + 1
        out.append(p.tensor if k == 0 else f"{p.tensor}#{k}")
    return out


def _stored_shape(p: Piece) -> list[int]:
    return [p.numel] if p.flat is not None else list(p.sizes or ())


def write_safetensors(path: Path, pieces: list[Piece], metadata: dict[str, str]) -> list[str]:
    """Writes `pieces` (their data) to a safetensors file at `path`, tensor by
    tensor, and fsyncs it; returns each piece's key. Raises OSError on I/O errors."""
    if sys.byteorder != "little":
        raise RuntimeError("checkpoint: safetensors is little-endian; this machine is not")
    keys = _keys(pieces)
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for k, p in zip(keys, pieces, strict=True):
        n = p.numel * p.dtype.itemsize
        header[k] = {
            "dtype": dtype_name(p.dtype),
            "shape": _stored_shape(p),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data 8-byte aligned, as the safetensors package does
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        done = 0
        for p in pieces:
            assert p.data is not None
            done = _write_tensor(f, str(path), p.data, done)
        f.flush()
        os.fsync(f.fileno())
    return keys


def _write_tensor(f: BinaryIO, name: str, t: torch.Tensor, done: int) -> int:
    """Streams `t`'s bytes (copied to the CPU contiguous first) in CHUNK pieces."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.contiguous().cpu()
    raw = flat.view(torch.uint8).numpy() if flat.numel() else b""
    for at in range(0, len(raw), CHUNK):
        f.write(raw[at : at + CHUNK])
        done += min(CHUNK, len(raw) - at)
        if on_chunk is not None:
            on_chunk(name, done)
    return done


def read_range(fd: int, offset: int, nbytes: int, path: str) -> bytearray:
    """nbytes of an open file from offset (os.pread: nothing else is read).
    Raises ValueError naming `path` if the file ends before."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{path}: ends at byte {offset + got}, expected {offset + nbytes}")
        got += n
    _STATS["bytes_read"] += nbytes
    _STATS["reads"] += 1
    return buf


def read_stats(reset: bool = False) -> dict[str, int]:
    """What this process has read from checkpoint files: tensor bytes
    (bytes_read), the number of those reads, and header bytes; `reset` zeroes
    them after reading."""
    out = dict(_STATS)
    if reset:
        _STATS.update(bytes_read=0, reads=0, header_bytes=0)
    return out


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The index of the checkpoint directory `path`, checked (validate.py:
    every field, the files it lists, their sizes). Raises FileNotFoundError
    (no such directory, or no index: not a complete checkpoint) or
    CheckpointError (not a well-formed checkpoint of this format)."""
    from .validate import Checkpoint

    with Checkpoint(path) as ck:
        return ck.index


def make_index(
    world_size: int, every: list[dict[str, Any]], files: dict[str, int], extra: Any
) -> dict[str, Any]:
    """The index from every rank's report ({"file", "rank", "tensors", "pieces"})."""
    tensors: dict[str, Any] = {}
    pieces = []
    for rep in every:
        tensors.update(rep["tensors"])
        pieces += [dict(p, file=rep["file"]) for p in rep["pieces"]]
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "files": {rep["file"]: {"rank": rep["rank"], "bytes": files[rep["file"]]} for rep in every},
        "tensors": dict(sorted(tensors.items())),
        "pieces": pieces,
        "extra": extra,
    }
