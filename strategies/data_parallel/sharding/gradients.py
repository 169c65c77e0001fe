"""Gradients of the sharding engine: from the Parameters' .grad to averaged
shards, per unit.

When every trainable parameter of a unit has its gradient (post-accumulate
hooks), the unit's gradients are deposited into one flat buffer laid out as
its FlatParam, and reduce-scattered (ReduceOp.AVG) into this rank's shard:

- ZeRO-2/3, FSDP: the flat buffer is taken from a small pool of symmetric
  windows (`comm.alloc_shared`: the reduce-scatter reads every rank's block in
  place), the reduce-scatter starts at once, during the rest of backward;
  under no_sync the gradients accumulate in an unsharded buffer instead, added
  in at the next synchronized backward.
- ZeRO-1: each unit keeps a persistent full gradient window (the 4P bytes of
  gradients stage 1 does not shard); every reduce-scatter runs at the end of
  backward, in place (this rank's block of the window is its shard).

Reduce-scatters start in one fixed order on every rank (the units in reverse
order of creation, the root last: the order backward produces them), so ranks
whose backward reaches the units in another order still issue the same
sequence of collectives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pycollectives import Communicator, Work

from .clip import clip_grad_norm
from .communications import REDUCE, OrderGuard, reduce_scatter_flat
from .flat_param import FlatParam
from .meter import EngineMeter
from .unit import ShardedUnit

__all__ = ["GradReducer", "write_grads"]


def write_grads(flat: FlatParam, dst: torch.Tensor, base: torch.Tensor | None) -> None:
    """dst[param] = base[param] + param.grad for every parameter of `flat`
    (base is None: the gradient alone; a missing gradient counts as zero;
    base may be dst itself: accumulate in place), alignment gaps and padding
    zeroed. The parameters' .grad are released."""
    for s, p in zip(flat.layout.slots, flat.params, strict=True):
        d, g = dst[s.offset : s.end], p.grad
        if g is None:
            if base is None:
                d.zero_()
            elif base is not dst:
                d.copy_(base[s.offset : s.end])
            continue
        g = g.reshape(-1)
        if base is None:
            d.copy_(g)
        elif base is dst:
            d.add_(g)
        else:
            torch.add(base[s.offset : s.end], g, out=d)
        p.grad = None
    if base is None or base is not dst:
        for a, b in flat.layout.gaps():
            dst[a:b].zero_()


@dataclass
class _Reduce:
    unit: ShardedUnit
    flat: FlatParam
    buffer: torch.Tensor
    owner: torch.Tensor | None  # the pool buffer `buffer` is a view of
    out: torch.Tensor
    work: Work | None
    check: Any


class _Pool:
    """`count` flat buffers per reduce dtype, each as large as the largest flat
    parameter of that dtype: symmetric windows on the CPU (taken in the same
    order on every rank, so the reduce-scatter finds them placed alike)."""

    def __init__(
        self, comm: Communicator, sizes: dict[torch.dtype, int], count: int, device: torch.device
    ) -> None:
        self.free: dict[torch.dtype, deque[torch.Tensor]] = {}
        for dtype, n in sizes.items():
            make = (
                (lambda n=n, dt=dtype: comm.alloc_shared(n, dt))
                if device.type == "cpu"
                else (lambda n=n, dt=dtype: torch.empty(n, dtype=dt, device=device))
            )
            self.free[dtype] = deque(make() for _ in range(count))
        self.all = [b for q in self.free.values() for b in q]

    def take(self, dtype: torch.dtype) -> torch.Tensor | None:
        q = self.free.get(dtype)
        return q.popleft() if q else None

    def give(self, buf: torch.Tensor) -> None:
        self.free[buf.dtype].append(buf)


class GradReducer:
    """The gradient bookkeeping of one engine (see the module docstring).

    Args:
        comm: the data-parallel communicator the engine's units shard over.
        root, units: the engine's root unit and all its units (the root among
            them), in order of creation.
        guard: the engine's OrderGuard (a reduce-scatter settles its check).
        meter: the engine's EngineMeter (copy and wait times are added to it).
        announce: the engine's announce(unit, phase): the check to settle
            before the reduce-scatter of `unit` is waited for.
        overlap, buffers, master_grads: as ShardingEngine's overlap_reduce,
            reduce_buffers and master_grads.
    """

    def __init__(
        self,
        comm: Communicator,
        root: ShardedUnit,
        units: list[ShardedUnit],
        *,
        guard: OrderGuard,
        meter: EngineMeter,
        announce: Callable[[ShardedUnit, int], Any],
        overlap: bool,
        buffers: int,
        master_grads: bool = True,
    ) -> None:
        self.comm, self.root = comm, root
        self.guard, self.meter, self.announce = guard, meter, announce
        self.overlap = overlap
        # True: reduced gradients are kept in the master dtype (what an optimizer
        # over the parameters needs: FSDP). False: in the reduce dtype, cast for
        # the optimizer's step only (ZeroOptimizer: 2 bytes a gradient in bf16).
        self.master_grads = master_grads
        self.order = [u for u in reversed(units) if u is not root and u.trainable]
        self.order += [root] if root.trainable else []
        self.persistent: dict[FlatParam, torch.Tensor] = {}
        self.window_state: dict[FlatParam, str] = {}  # "empty" | "local" | "reduced"
        self.carry: dict[FlatParam, torch.Tensor] = {}
        self.accum: dict[FlatParam, torch.Tensor] = {}
        self.staged: dict[FlatParam, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pending: deque[_Reduce] = deque()
        self.next = 0
        self.sync = True
        sizes: dict[torch.dtype, int] = {}
        device = torch.device("cpu")
        for u in self.order:
            for f in u.trainable:
                device = f.device
                if u.persistent_grads:
                    n, dt = f.layout.padded_numel, self.reduce_dtype(u, f)
                    self.persistent[f] = (
                        self.comm.alloc_shared(n, dt)
                        if f.device.type == "cpu"
                        else torch.zeros(n, dtype=dt, device=f.device)
                    )
                    self.window_state[f] = "empty"
                else:
                    dt = self.reduce_dtype(u, f)
                    sizes[dt] = max(sizes.get(dt, 0), f.layout.padded_numel)
        self.pool = _Pool(self.comm, sizes, buffers, device) if sizes and buffers > 0 else None

    @staticmethod
    def reduce_dtype(unit: ShardedUnit, flat: FlatParam) -> torch.dtype:
        return unit.reduce_dtype or flat.compute_dtype

    # -- one backward ---------------------------------------------------------------
    def begin(self, sync: bool) -> None:
        self.sync, self.next = sync, 0

    def unit_complete(self, unit: ShardedUnit) -> None:
        """Deposits a unit's gradients (all arrived, or the backward ended) and
        starts whatever reduce-scatters the fixed order allows."""
        t0, waited = time.perf_counter(), self.meter.reduce_wait_s
        for f in unit.trainable:
            if f in self.persistent:
                self._deposit_persistent(f)
            elif not self.sync:
                acc = self.accum.get(f)
                if acc is None:
                    acc = self.accum[f] = torch.empty(
                        f.layout.padded_numel, dtype=self.reduce_dtype(unit, f), device=f.device
                    )
                    write_grads(f, acc, None)
                else:
                    write_grads(f, acc, acc)
            else:
                buf, owner = self._take(unit, f)
                write_grads(f, buf, self.accum.pop(f, None))
                self.staged[f] = (buf, owner)
        waited = self.meter.reduce_wait_s - waited  # _take may wait for a buffer
        self.meter.grad_copy_s += time.perf_counter() - t0 - waited
        if self.sync and self.overlap:
            self.launch_ready()

    def _deposit_persistent(self, f: FlatParam) -> None:
        win, state = self.persistent[f], self.window_state[f]
        if state == "reduced":
            if f.grad_shard is not None:  # no zero_grad since: the next shard adds to this one
                self.carry[f] = f.grad_shard.clone()
            state = "empty"
        write_grads(f, win, win if state == "local" else None)
        self.window_state[f] = "local"

    def _take(self, unit: ShardedUnit, f: FlatParam) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A flat buffer for the unit's gradients and the pool buffer it views (None: private)."""
        dt, n = self.reduce_dtype(unit, f), f.layout.padded_numel
        buf = self.pool.take(dt) if self.pool else None
        while buf is None and self.pending and self.pool:
            self.finish(self.pending.popleft())  # the oldest reduce-scatter frees its buffer
            buf = self.pool.take(dt)
        if buf is None:  # every buffer held by units not yet launched: a private one
            return torch.empty(n, dtype=dt, device=f.device), None
        return buf[:n], buf

    def launch_ready(self, everything: bool = False) -> None:
        """Starts the reduce-scatters of the units next in the fixed order whose
        gradients are deposited (all remaining ones with `everything`)."""
        while self.next < len(self.order):
            u = self.order[self.next]
            if not (u.complete or everything):
                break
            for f in u.trainable:
                self._launch(u, f)
            self.next += 1

    def _launch(self, unit: ShardedUnit, f: FlatParam) -> None:
        c, r = f.layout.shard_numel, self.comm.rank
        if f in self.persistent:
            buf, owner = self.persistent[f], None
            out = buf[r * c : (r + 1) * c]  # in place: this rank's block is its shard
        else:
            buf, owner = self.staged.pop(f)
            out = torch.empty(c, dtype=buf.dtype, device=buf.device)
        check = self.announce(unit, REDUCE)
        work = reduce_scatter_flat(self.comm, out, buf)
        self.pending.append(_Reduce(unit, f, buf, owner, out, work, check))

    def finish(self, r: _Reduce) -> None:
        """Waits for one reduce-scatter and folds its result into the flat's grad_shard."""
        t0 = time.perf_counter()
        self.guard.settle(r.check)
        if r.work is not None:
            r.work.wait()
        self.meter.reduce_wait_s += time.perf_counter() - t0
        f, res = r.flat, r.out
        if f in self.persistent:
            carry = self.carry.pop(f, None)
            if carry is not None:
                res.add_(carry)
            f.grad_shard = res
            self.window_state[f] = "reduced"
        elif f.grad_shard is None:
            keep = f.layout.dtype if self.master_grads else res.dtype
            f.grad_shard = res if res.dtype == keep else res.to(keep)
        else:
            f.grad_shard.add_(res)
        if r.owner is not None and self.pool:
            self.pool.give(r.owner)

    def finish_all(self) -> None:
        while self.pending:
            self.finish(self.pending.popleft())

    # -- between steps ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drops every reduced and accumulated gradient."""
        for u in self.order:
            for f in u.trainable:
                f.clear_grads()
                if f in self.window_state:
                    self.window_state[f] = "empty"
        self.carry.clear()
        self.accum.clear()

    def grad_shards(self) -> list[torch.Tensor]:
        return [f.grad_shard for u in self.order for f in u.trainable if f.grad_shard is not None]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Collective: clips the gradient shards by the whole model's norm,
        bitwise as torch.nn.utils.clip_grad_norm_ on the full gradients (see
        clip.py); returns the total norm. Raises RuntimeError on every rank for
        a non-finite norm with error_if_nonfinite."""
        flats = [f for u in self.order for f in u.trainable]
        return clip_grad_norm(
            self.comm, flats, self.root.module, max_norm, norm_type, error_if_nonfinite
        )

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer held (for storage accounting)."""
        out = list(self.persistent.values()) + list(self.accum.values())
        return out + (self.pool.all if self.pool else [])
