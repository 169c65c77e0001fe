"""The flat parameter of a unit: its parameters laid end to end in one padded
buffer, split into world_size equal shards.

    flat:   | p0 ....... |gap| p1 .. |gap| p2 ........... |  padding  |
    shards: |  rank 0        |  rank 1        |  rank 2        |
            0                c                2c               3c = padded_numel

Every parameter starts 64-byte aligned (so a view into the flat buffer is
aligned as a standalone tensor is, and computes the same bits), and the shard
size c is a multiple of 64 bytes, so every rank holds an equal, aligned shard
whatever the sizes. `FlatLayout` is the metadata alone (names, shapes, dtype,
offsets, padding, which rank holds which range): what a checkpoint needs to
move shards between layouts. `FlatParam` holds this rank's tensors: the master
shard the optimizer updates, the full buffer the forward computes with, and the
views that tie the model's own Parameter objects to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ALIGN_BYTES", "FlatLayout", "FlatParam", "GatherPool", "ParamSlot"]

ALIGN_BYTES = 64


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a flat parameter.

    `name` is relative to the unit's module; `aliases` are its other names
    there (a tied parameter reached through several modules)."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int  # elements from the start of the flat parameter
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """Where every parameter of one flat parameter lives, on every rank."""

    dtype: torch.dtype  # the parameters' (and the master shard's) dtype
    requires_grad: bool
    slots: tuple[ParamSlot, ...]
    world_size: int
    shard_numel: int  # c: elements per rank

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, tuple[str, ...], tuple[int, ...]]],
        dtype: torch.dtype,
        requires_grad: bool,
        world_size: int,
    ) -> FlatLayout:
        """Lays out (name, aliases, shape) entries in order, each aligned, and
        pads to world_size aligned shards."""
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        slots, off = [], 0
        for name, aliases, shape in params:
            numel = math.prod(shape)
            slots.append(ParamSlot(name, tuple(aliases), tuple(shape), off, numel))
            off = _round_up(off + numel, align)
        used = slots[-1].end if slots else 0
        shard = _round_up(-(-used // world_size), align) if used else 0
        return cls(dtype, requires_grad, tuple(slots), world_size, shard)

    @property
    def numel(self) -> int:
        """Elements of the parameters themselves (no alignment, no padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def padding(self) -> int:
        """Elements that belong to no parameter: alignment gaps and the tail."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard in the flat parameter."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """For every slot, the part rank `rank` holds: (start, end) inside the
        parameter's flattened elements, and where that starts in the shard.
        (start == end: none of it.) One entry per slot, in slot order."""
        a, b = self.shard_range(rank)
        out = []
        for s in self.slots:
            lo, hi = max(s.offset, a), min(s.end, b)
            out.append((lo - s.offset, hi - s.offset, lo - a) if lo < hi else (0, 0, 0))
        return out

    def holders(self, slot: int) -> list[tuple[int, int, int]]:
        """Which ranks hold parameter `slot`: (rank, start, end) in its flattened elements."""
        s = self.slots[slot]
        c = self.shard_numel
        if not s.numel:
            return []
        first, last = s.offset // c, (s.end - 1) // c
        return [
            (r, max(s.offset, r * c) - s.offset, min(s.end, (r + 1) * c) - s.offset)
            for r in range(first, last + 1)
        ]

    def gaps(self) -> list[tuple[int, int]]:
        """The [start, end) ranges of the flat parameter that hold no parameter."""
        out, pos = [], 0
        for s in self.slots:
            if s.offset > pos:
                out.append((pos, s.offset))
            pos = s.end
        if self.padded_numel > pos:
            out.append((pos, self.padded_numel))
        return out

    def to_dict(self, prefix: str = "") -> dict[str, Any]:
        """The layout as plain data (JSON-able), parameter names prefixed with
        `prefix` (the unit's name in the model, with a trailing dot)."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "requires_grad": self.requires_grad,
            "world_size": self.world_size,
            "shard_numel": self.shard_numel,
            "padded_numel": self.padded_numel,
            "params": [
                {
                    "name": prefix + s.name,
                    "aliases": [prefix + a for a in s.aliases],
                    "shape": list(s.shape),
                    "offset": s.offset,
                    "numel": s.numel,
                    "holders": [list(h) for h in self.holders(i)],
                }
                for i, s in enumerate(self.slots)
            ],
        }


class GatherPool:
    """Memory of freed full buffers (CPU), kept for the next gather of the same
    size: a unit freed after its forward or backward hands its memory to the
    unit gathered next, instead of giving it back to malloc and the next
    gather faulting fresh pages in (about as long as the gather's own copy).
    The memory moves between storages by swapping their data pointers, so a
    full buffer keeps its storage object and the views autograd saved stay
    valid (as with resize_). At most `per_size` buffers of each size are kept,
    and `clear()` (the end of a backward) returns them all.
    """

    def __init__(self, per_size: int = 1) -> None:
        self.per_size = per_size
        self._free: dict[int, list[torch.UntypedStorage]] = {}

    @staticmethod
    def supported(device: torch.device) -> bool:
        """The CPU, with a torch that can swap storages' data pointers."""
        return device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Gives the empty `storage` a kept buffer of `nbytes`, if there is one."""
        kept = self._free.get(nbytes)
        if not kept:
            return False
        storage._swap_data_ptr_(kept.pop())
        return True

    def give(self, storage: torch.UntypedStorage) -> bool:
        """Keeps `storage`'s memory (leaving it empty) unless enough of its size are kept."""
        kept = self._free.setdefault(storage.nbytes(), [])
        if len(kept) >= self.per_size:
            return False
        spare = torch.UntypedStorage(0)
        storage._swap_data_ptr_(spare)
        kept.append(spare)
        return True

    def clear(self) -> None:
        """Returns every kept buffer to the allocator."""
        self._free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes kept now."""
        return sum(s.nbytes() for kept in self._free.values() for s in kept)


class FlatParam:
    """This rank's tensors of one flat parameter.

    - `shard`: the master shard (the parameters' dtype), c elements; the
      optimizer updates it in place. Unsharded (ZeRO-1/2) without mixed
      precision it is a view of `full`'s own block; with it, a tensor of its
      own, cast into that block before each all-gather.
    - `full`: the whole padded flat parameter in the compute dtype. Sharded
      (ZeRO-3/FSDP), its storage is resized to 0 between uses and gathered back
      into the same storage, so views taken by autograd stay valid (with mixed
      precision, the master shard is cast into its own block at each gather:
      no compute-dtype copy of the shard is kept between uses); unsharded, it
      is permanent (a symmetric window on the CPU).
    - the model's Parameter objects: while gathered their `.data` are views of
      `full` (`use_full`), otherwise 1-D views of this rank's piece of the
      master shard (`use_shard`), so an optimizer over them updates `shard`.
    - `grad_shard`: the reduced gradient of this rank's shard (master dtype).

    """

    def __init__(
        self,
        layout: FlatLayout,
        params: list[nn.Parameter],
        rank: int,
        *,
        sharded: bool,
        compute_dtype: torch.dtype | None = None,
        alloc_window: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.layout, self.params, self.rank, self.sharded = layout, params, rank, sharded
        self.device = params[0].device
        self.compute_dtype = compute_dtype or layout.dtype
        # A master shard of its own: sharded, or full parameters in another dtype.
        self.own_master = sharded or self.compute_dtype != layout.dtype
        n, c = layout.padded_numel, layout.shard_numel
        a, b = layout.shard_range(rank)
        if alloc_window is not None and not sharded:
            self.full = alloc_window(n, self.compute_dtype)  # zero-filled
        elif sharded:  # storage freed below, before anything touches it
            self.full = torch.empty(n, dtype=self.compute_dtype, device=self.device)
        else:
            self.full = torch.zeros(n, dtype=self.compute_dtype, device=self.device)
        self.full_views = [self.full[s.offset : s.end].view(s.shape) for s in layout.slots]
        self._pieces = layout.pieces(rank)
        with torch.no_grad():
            if self.own_master:
                self.shard = torch.zeros(c, dtype=layout.dtype, device=self.device)
                for (lo, hi, at), p in zip(self._pieces, params, strict=True):
                    self.shard[at : at + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
            else:
                self.shard = self.full[a:b]
            if not sharded:
                for v, p in zip(self.full_views, params, strict=True):
                    v.copy_(p.detach())
        self.shard_pieces = [self.shard[at : at + hi - lo] for lo, hi, at in self._pieces]
        self.grad_shard: torch.Tensor | None = None
        self._opt_param: nn.Parameter | None = None
        self.grads_exposed = False
        self.allocated = True
        self.pool: GatherPool | None = None  # the engine's, for sharded flats on the CPU
        if sharded:
            self.use_shard()
            self.free_full()
        else:
            self.use_full()

    # -- the full buffer ------------------------------------------------------
    def alloc_full(self) -> None:
        """Gives `full` its storage back (its contents are undefined until gathered)."""
        if not self.allocated:
            st, n = self.full.untyped_storage(), self.layout.padded_numel * self.full.itemsize
            if self.pool is None or not self.pool.take(st, n):
                st.resize_(n)
            self.allocated = True

    def free_full(self) -> None:
        """Frees `full`'s storage (sharded only); the parameters must not view it."""
        if self.sharded and self.allocated:
            st = self.full.untyped_storage()
            if self.pool is None or not self.pool.give(st):
                st.resize_(0)
            self.allocated = False

    def gather_input(self) -> torch.Tensor:
        """The all-gather's input: this rank's block in the compute dtype. The
        master shard itself where it is in the compute dtype and not a block of
        `full`; otherwise `full`'s own block (allocated: the all-gather runs in
        place), into which a master shard of another dtype is cast now. So no
        compute-dtype copy of the shard outlives a gather (as FSDP2, which casts
        into its all-gather input at gather time)."""
        if self.sharded and self.compute_dtype == self.layout.dtype:
            return self.shard
        a, b = self.layout.shard_range(self.rank)
        own = self.full[a:b]  # in place: every rank's block of its own full buffer
        if self.own_master:
            own.copy_(self.shard)
        return own

    # -- what the Parameter objects show ----------------------------------------
    def use_full(self) -> None:
        """Points every parameter at its view of `full` (gathered). Gradients
        shown on the shard pieces are hidden meanwhile (use_shard shows them
        again); if the optimizer set them all to None since they were shown,
        grad_shard is dropped: the next reduction starts afresh instead of
        accumulating."""
        if self.grads_exposed:
            if all(p.grad is None for p in self.params):
                self.grad_shard = None
            for p in self.params:
                p.grad = None
            self.grads_exposed = False
        for p, v in zip(self.params, self.full_views, strict=True):
            p.data = v

    def use_shard(self) -> None:
        """Points every parameter at its 1-D piece of the master shard (and its
        .grad at its piece of grad_shard, if there is one)."""
        for p, v in zip(self.params, self.shard_pieces, strict=True):
            p.data = v
        if not self.grads_exposed:
            self.expose_grads()

    def expose_grads(self) -> None:
        """Sets every (sharded) parameter's .grad to its piece of grad_shard
        (when grad_shard has the parameters' dtype)."""
        if not self.sharded or self.grad_shard is None or self.grad_shard.dtype != self.shard.dtype:
            return
        g = self.grad_shard
        for p, (lo, hi, at) in zip(self.params, self._pieces, strict=True):
            p.grad = g[at : at + hi - lo]
        self.grads_exposed = True

    def clear_grads(self) -> None:
        """Drops the reduced gradient (optimizer.zero_grad(set_to_none=True))."""
        self.grad_shard = None
        if self.grads_exposed:
            for p in self.params:
                p.grad = None
            self.grads_exposed = False

    @property
    def opt_param(self) -> nn.Parameter:
        """The master shard as one Parameter sharing its storage: what a flat
        optimizer (ZeroOptimizer) steps, after setting its .grad."""
        if self._opt_param is None:
            self._opt_param = nn.Parameter(self.shard, requires_grad=self.layout.requires_grad)
        return self._opt_param

    def full_value(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Views of a gathered master-dtype flat `out` in the parameters' shapes."""
        return [out[s.offset : s.end].view(s.shape) for s in self.layout.slots]
