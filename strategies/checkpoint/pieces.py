"""The piece: what one rank holds of one global tensor, and the arithmetic
that moves elements between pieces of different layouts.

A piece of a global tensor of shape S is a box (an offset and a size per
dimension: a tensor-parallel split along any dimension, or the whole tensor),
optionally narrowed to a range [start, end) of that box's row-major
flattening (a ZeRO/FSDP flat shard, which cuts a parameter anywhere):

    global [4, 6], box offsets (0, 3) sizes (4, 3), flat (2, 7):
        . . . a a X        box elements in row-major order: 0 1 2 | 3 4 5 | ...
        . . . X X X        the piece: box elements 2..6 (X), 5 values
        . . . X . .
        . . . . . .

Any piece is a sorted list of runs, contiguous stretches of the global
tensor's row-major flattening; the intersection of two run lists is the list
of copies (destination position, source position, length) that moves the
elements two pieces share. Nothing here touches a file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Piece", "copy_plan", "overlaps", "runs"]

Run = tuple[int, int, int]  # (global start, position in the piece, length)
Copy = tuple[int, int, int]  # (position in the destination, position in the source, length)


@dataclass
class Piece:
    """This rank's part of the global tensor `tensor` (shape `shape`, dtype `dtype`).

    Args:
        tensor: the global tensor's name (a parameter name, or e.g.
            "optim/exp_avg/<parameter name>").
        shape: the global tensor's shape.
        dtype: the global tensor's dtype (what is stored).
        offsets / sizes: the box, per dimension (default: the whole tensor).
        flat: [start, end) of the box's row-major flattening (default: all of it).
        data: the values (save_pieces) or where they go (load_pieces): a tensor
            of `numel` elements (its shape is free: a flat shard is 1-D).
    """

    tensor: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    flat: tuple[int, int] | None = None
    data: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        self.offsets = tuple(int(o) for o in (self.offsets or (0,) * len(self.shape)))
        self.sizes = tuple(int(s) for s in (self.shape if self.sizes is None else self.sizes))
        if self.flat is not None:
            self.flat = (int(self.flat[0]), int(self.flat[1]))

    @classmethod
    def whole(cls, tensor: str, data: torch.Tensor) -> Piece:
        """All of `data`, a global tensor by itself."""
        return cls(tensor, tuple(data.shape), data.dtype, data=data)

    @property
    def box_numel(self) -> int:
        return math.prod(self.sizes or ())

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        if self.flat is None:
            return self.box_numel
        return max(0, self.flat[1] - self.flat[0])

    def problems(self) -> list[str]:
        """What is wrong with this piece as a description (empty: nothing)."""
        out = []
        shape, off, size = self.shape, self.offsets or (), self.sizes or ()
        if not isinstance(self.tensor, str) or not self.tensor:
            out.append(f"tensor name {self.tensor!r} must be a non-empty str")
        if len(off) != len(shape) or len(size) != len(shape):
            out.append(
                f"'{self.tensor}': offsets {off} and sizes {size} need one entry per "
                f"dimension of shape {shape}"
            )
        elif any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, size, shape, strict=True)):
            out.append(f"'{self.tensor}': box offsets {off} sizes {size} outside shape {shape}")
        if self.flat is not None and not 0 <= self.flat[0] <= self.flat[1] <= self.box_numel:
            out.append(
                f"'{self.tensor}': flat range {list(self.flat)} outside the box's "
                f"{self.box_numel} elements"
            )
        if self.data is not None:
            if self.data.numel() != self.numel:
                out.append(
                    f"'{self.tensor}': data has {self.data.numel()} elements, "
                    f"the piece {self.numel}"
                )
            if self.data.dtype != self.dtype:
                out.append(f"'{self.tensor}': data is {self.data.dtype}, the piece {self.dtype}")
        return out

    def describe(self) -> dict:
        """The piece as plain data (no values): what the index records."""
        return {
            "tensor": self.tensor,
            "offsets": list(self.offsets or ()),
            "sizes": list(self.sizes or ()),
            "flat": None if self.flat is None else list(self.flat),
        }


def runs(
    shape: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    flat: tuple[int, int] | None = None,
) -> list[Run]:
    """The piece as (global start, position in the piece, length) runs of the
    global row-major flattening, sorted by global start.

    Trailing dimensions the box covers whole merge into one run per row of
    the first partial dimension, so a whole tensor or a split along dim 0 is
    one run, a split along the last dim one run per row."""
    if math.prod(sizes) == 0:
        return []
    nd = len(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    j = nd - 1  # the last dimension the box does not cover whole (-1: none)
    while j >= 0 and offsets[j] == 0 and sizes[j] == shape[j]:
        j -= 1
    if j < 0:
        start0, length, rows = 0, math.prod(shape), 1
    else:
        length = sizes[j] * strides[j]
        rows = math.prod(sizes[:j])
        start0 = sum(o * s for o, s in zip(offsets, strides, strict=True))
    lo, hi = (0, rows * length) if flat is None else flat
    first, last = lo // length, min(-(-hi // length), rows)
    out: list[Run] = []
    if first >= last:
        return out
    base = _row_starts(start0, sizes[:j], strides[:j], first, last - first) if j > 0 else [start0]
    for k in range(first, last):
        a, b = max(lo, k * length), min(hi, (k + 1) * length)
        if a < b:
            out.append((base[k - first] + a - k * length, a - lo, b - a))
    return out


def _row_starts(
    start0: int, sizes: Sequence[int], strides: Sequence[int], first: int, count: int
) -> list[int]:
    """Global starts of rows first..first+count-1 of the outer dimensions,
    row-major (only those: a flat range of a huge box costs its own rows)."""
    if len(sizes) == 1:
        return list(
            range(start0 + first * strides[0], start0 + (first + count) * strides[0], strides[0])
        )
    idx, k = [0] * len(sizes), first
    for d in range(len(sizes) - 1, -1, -1):
        k, idx[d] = divmod(k, sizes[d])
    pos = start0 + sum(i * s for i, s in zip(idx, strides, strict=True))
    out = []
    for _ in range(count):
        out.append(pos)
        d = len(sizes) - 1
        while d >= 0:  # the next row: an odometer over the outer dimensions
            idx[d] += 1
            pos += strides[d]
            if idx[d] < sizes[d]:
                break
            pos -= sizes[d] * strides[d]
            idx[d] = 0
            d -= 1
    return out


def copy_plan(dst: list[Run], src: list[Run]) -> list[Copy]:
    """Copies (position in dst's piece, position in src's piece, length) that
    move every element the two run lists share; consecutive copies merged."""
    out: list[Copy] = []
    i = j = 0
    while i < len(dst) and j < len(src):
        dg, dp, dn = dst[i]
        sg, sp, sn = src[j]
        lo, hi = max(dg, sg), min(dg + dn, sg + sn)
        if lo < hi:
            d, s, n = dp + lo - dg, sp + lo - sg, hi - lo
            if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((d, s, n))
        if dg + dn <= sg + sn:
            i += 1
        else:
            j += 1
    return out


def overlaps(pieces: list[list[Run]]) -> list[tuple[int, int]]:
    """Pairs (a, b) of indices of `pieces` (run lists of one tensor) that share elements."""
    flat = sorted((g, g + n, k) for k, rs in enumerate(pieces) for g, _, n in rs)
    out: set[tuple[int, int]] = set()
    end, owner = -1, -1
    for g, e, k in flat:
        if g < end and owner != k:
            out.add((min(owner, k), max(owner, k)))
        if e > end:
            end, owner = e, k
    return sorted(out)
