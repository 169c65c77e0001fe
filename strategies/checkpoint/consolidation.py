"""One safetensors file from a sharded checkpoint, streaming:

    python -m pycollectives.strategies.checkpoint consolidate ckpt/step-100 model.safetensors [--model-only]

Every global tensor is assembled in one buffer of its own size, straight
from the byte ranges of its pieces (os.preadv into the buffer: no second
copy), written, and dropped before the next: the peak memory is the largest
tensor plus the interpreter, whatever the checkpoint's size (DeepSpeed's
zero_to_fp32 holds the whole model). The module itself uses no torch (the
package pycollectives, which holds it, imports torch). The output is written under a temporary name, fsynced and renamed.

The file holds the checkpoint's tensors under their global names
(parameters and buffers as in the model's state_dict, optimizer state as
optim/<key>/<parameter>); --model-only keeps the model's alone, a file that
`safetensors.torch.load_file` turns into a state_dict for
`model.load_state_dict` (tied parameters appear once, under their first name:
load it with strict=False, or tie after loading).
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
from pathlib import Path
from typing import Any

from .format import ITEMSIZE, read_header, read_index
from .pieces import runs

__all__ = ["consolidate"]

OPTIM = "optim/"


def consolidate(
    src: str | os.PathLike, out: str | os.PathLike, *, model_only: bool = False
) -> dict[str, Any]:
    """Writes the checkpoint at `src` as the single safetensors file `out`;
    returns {"tensors", "bytes", "largest_tensor_bytes"}.

    Raises FileNotFoundError / ValueError naming the argument when `src` is
    not a complete checkpoint (a tensor some elements of which no piece holds)."""
    src, out = Path(src), Path(out)
    index = read_index(src)
    tensors = {
        n: m for n, m in index["tensors"].items() if not (model_only and n.startswith(OPTIM))
    }
    pieces: dict[str, list[dict[str, Any]]] = {n: [] for n in tensors}
    for p in index["pieces"]:
        if p["tensor"] in pieces:
            pieces[p["tensor"]].append(p)
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pycollectives-consolidated",
            "source": str(src),
            "extra": json.dumps(index.get("extra")),
        }
    }
    pos, largest = 0, 0
    for n, m in tensors.items():
        size = _numel(m["shape"]) * ITEMSIZE[m["dtype"]]
        header[n] = {"dtype": m["dtype"], "shape": m["shape"], "data_offsets": [pos, pos + size]}
        pos, largest = pos + size, max(largest, size)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    files: dict[str, tuple[int, int, dict[str, Any]]] = {}
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for n, m in tensors.items():
                buf = _assemble(src, n, m, pieces[n], files)
                with memoryview(buf) as view:
                    f.write(view[: _numel(m["shape"]) * ITEMSIZE[m["dtype"]]])
                buf.close()  # an anonymous mapping: its memory goes back to the system now
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd, _, _ in files.values():
            os.close(fd)
    return {"tensors": len(tensors), "bytes": 8 + len(head) + pos, "largest_tensor_bytes": largest}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _assemble(
    src: Path, name: str, meta: dict[str, Any], pieces: list[dict[str, Any]], files: dict
) -> mmap.mmap:
    """Tensor `name`'s bytes, read from its pieces' files into one buffer (an
    anonymous mapping, not the heap: malloc may keep a freed buffer resident)."""
    size = ITEMSIZE[meta["dtype"]]
    buf = mmap.mmap(-1, max(1, _numel(meta["shape"]) * size))
    view = memoryview(buf)[: _numel(meta["shape"]) * size]
    got = 0
    for p in pieces:
        if p["file"] not in files:
            start, head = read_header(src / p["file"])
            files[p["file"]] = (os.open(src / p["file"], os.O_RDONLY), start, head)
        fd, start, head = files[p["file"]]
        entry = head.get(p["key"])
        if entry is None or entry["dtype"] != meta["dtype"]:
            raise ValueError(
                f"consolidate: src={str(src)!r}: {p['file']} lacks {p['key']!r} as indexed"
            )
        base = start + entry["data_offsets"][0]
        for g, at, n in runs(meta["shape"], p["offsets"], p["sizes"], p["flat"]):
            _pread_into(fd, view[g * size : (g + n) * size], base + at * size, p["file"])
            got += n
    view.release()
    if got != _numel(meta["shape"]):
        buf.close()
        raise ValueError(
            f"consolidate: src={str(src)!r}: tensor {name!r} has {got} of its "
            f"{_numel(meta['shape'])} elements in the checkpoint"
        )
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"consolidate: {what} ends before byte {offset + len(view)}")
        done += n
