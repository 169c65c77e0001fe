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
import math
import mmap
import os
import uuid
from pathlib import Path
from typing import Any

from .format import ITEMSIZE
from .validate import Checkpoint, CheckpointError

__all__ = ["consolidate"]

OPTIM = "optim/"


def consolidate(
    src: str | os.PathLike, out: str | os.PathLike, *, model_only: bool = False
) -> dict[str, Any]:
    """Writes the checkpoint at `src` as the single safetensors file `out`;
    returns {"tensors", "bytes", "largest_tensor_bytes"}.

    The index and the header of every file read are checked first (as load
    does: validate.py), before `out` is created. Raises FileNotFoundError
    when `src` is not a checkpoint, CheckpointError naming the file, the
    tensor and the field when it is not a well-formed one."""
    src, out = Path(src), Path(out)
    with Checkpoint(src) as ck:
        index = ck.index
        tensors = {
            n: m for n, m in index["tensors"].items() if not (model_only and n.startswith(OPTIM))
        }
        pieces: dict[str, list[tuple[dict[str, Any], list]]] = {n: [] for n in tensors}
        for p, rs in zip(index["pieces"], ck.runs, strict=True):
            if p["tensor"] in pieces:
                pieces[p["tensor"]].append((p, rs))
                ck.file(p["file"])  # every header checked before anything is written
        return _write(ck, out, tensors, pieces)


def _write(ck: Checkpoint, out: Path, tensors: dict[str, Any], pieces: dict) -> dict[str, Any]:
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pycollectives-consolidated",
            "source": str(ck.path),
            "extra": json.dumps(ck.index.get("extra")),
        }
    }
    pos, largest = 0, 0
    for n, m in tensors.items():
        size = math.prod(m["shape"]) * ITEMSIZE[m["dtype"]]
        header[n] = {"dtype": m["dtype"], "shape": m["shape"], "data_offsets": [pos, pos + size]}
        pos, largest = pos + size, max(largest, size)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for n, m in tensors.items():
                buf = _assemble(ck, n, m, pieces[n])
                with memoryview(buf) as view:
                    f.write(view[: math.prod(m["shape"]) * ITEMSIZE[m["dtype"]]])
                buf.close()  # an anonymous mapping: its memory goes back to the system now
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"tensors": len(tensors), "bytes": 8 + len(head) + pos, "largest_tensor_bytes": largest}


def _assemble(ck: Checkpoint, name: str, meta: dict[str, Any], pieces: list) -> mmap.mmap:
    """Tensor `name`'s bytes, read from its pieces' files into one buffer (an
    anonymous mapping, not the heap: malloc may keep a freed buffer resident).
    Its pieces cover it exactly once (validate.py): no more than the files hold."""
    size, numel = ITEMSIZE[meta["dtype"]], math.prod(meta["shape"])
    buf = mmap.mmap(-1, max(1, numel * size))
    view = memoryview(buf)[: numel * size]
    try:
        for p, rs in pieces:
            fd, start, head = ck.file(p["file"])
            base = start + head[p["key"]]["data_offsets"][0]
            for g, at, n in rs:
                _pread_into(fd, view[g * size : (g + n) * size], base + at * size, p["file"])
    except BaseException:
        view.release()
        buf.close()
        raise
    view.release()
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"consolidate: {what} ends before byte {offset + len(view)}")
        done += n
