"""FSDP2-style fully sharded data parallelism over the sharding engine
(strategies/sharding), on pycollectives' own collectives.

    for block in model.blocks:
        fully_shard(block, comm)
    fully_shard(model, comm)                # the root: the rest of the model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the shards
    loss_fn(model(x), y).backward()         # gathers per block, reduce-scatters per block
    opt.step()

Each fully_shard call makes one unit of the module's parameters that no inner
unit owns; call it bottom-up. Outside forward and backward, the module's
parameters are 1-D pieces of this rank's shard (what an optimizer updates;
their .grad are the reduced gradient's pieces after backward); during its
forward and backward they are the full tensors. As FSDP2:

- reshard_after_forward: True frees the gathered parameters after forward and
  gathers them again in backward (3P(N-1)/N bytes per step); False keeps them
  until the end of backward (2P(N-1)/N, more memory); None (the default, as
  torch 2.13's FSDP2): True for every unit but the root, whose forward encloses
  the others' and whose parameters backward needs first (no more memory: one
  all-gather of the root per step instead of two).
- MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype): compute in
  param_dtype copies of the fp32 master shards, reduce-scatter gradients in
  reduce_dtype (default param_dtype).
- set_requires_gradient_sync(False) / no_sync(): gradient accumulation without
  communication (unsharded gradients are kept until the next synced backward).
- prefetch (set on the root, or set_prefetch): the next units' all-gathers start
  while a unit computes, at most `prefetch` units ahead, in forward and in
  backward, following the order the previous iteration took.

fully_unshard(root, values) undoes it (locally): every parameter gets storage
of its own in its full shape, the given values (e.g. rebuilt after a lost
rank: elastic_fsdp.py), and the model can be sharded again on another
communicator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pycollectives import Communicator

from .sharding.checks import agree
from .sharding.communications import FORWARD
from .sharding.engine import ShardingEngine
from .sharding.unit import ShardedUnit

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "clip_grad_norm_",
    "fully_shard",
    "fully_unshard",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy: compute dtype, gradient reduction dtype, output dtype,
    and whether floating-point forward inputs are cast to param_dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class FSDPModule:
    """Mixed into every module fully_shard returns (as FSDP2 does): the methods
    below act on the module's unit and on the engine of its root."""

    @property
    def sharding_unit(self) -> ShardedUnit:
        return cast(Any, self)._sharding_unit

    def _root_engine(self) -> ShardingEngine | None:
        return self.sharding_unit.engine

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backwards accumulate unsharded gradients without communicating
        (the whole tree of units this module belongs to)."""
        engine = self._root_engine()
        if engine is None:
            self.sharding_unit.pending_sync = requires_gradient_sync
        else:
            engine.require_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """False: units gathered during backwards that do not reduce gradients
        (set_requires_gradient_sync(False)) stay gathered until the backward or
        reduction that does (the whole tree of units this module belongs to):
        gradient accumulation gathers each unit once per step instead of once per
        micro-batch, holding the unsharded parameters meanwhile (as FSDP2's)."""
        engine = self._root_engine()
        if engine is None:
            self.sharding_unit.pending_reshard = reshard_after_backward
        else:
            engine.reshard_after_backward = reshard_after_backward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context form of set_requires_gradient_sync(False)."""
        engine = self._root_engine()
        old = True if engine is None else engine.require_grad_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(old)

    def set_prefetch(self, units: int) -> None:
        """How many units' all-gathers may run ahead of the one computing (0: none)."""
        if units < 0:
            raise ValueError(f"fully_shard: set_prefetch({units}): must be >= 0")
        self.sharding_unit.prefetch = units
        engine = self._root_engine()
        if engine is not None:
            engine.prefetch = units

    def unshard(self) -> None:
        """Gathers this module's parameters now (collective; the engine must exist)."""
        engine = self._require_engine("unshard")
        engine._ensure_full(self.sharding_unit, FORWARD)

    def reshard(self) -> None:
        """Frees this module's gathered parameters."""
        engine = self._require_engine("reshard")
        self.sharding_unit.free(engine.guard)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: clips the gradients of the whole tree by their global norm,
        bitwise as torch.nn.utils.clip_grad_norm_ on the full fp32 gradients."""
        return self._require_engine("clip_grad_norm_").grads.clip_grad_norm_(max_norm, norm_type)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full value, by name in the root module."""
        return self._require_engine("full_parameters").full_parameters()

    def _require_engine(self, what: str) -> ShardingEngine:
        engine = self._root_engine()
        if engine is None:
            raise RuntimeError(
                f"fully_shard: {what}: the root has not run a forward yet (the engine that ties "
                "the units together is built at the root's first forward)"
            )
        return engine


_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module,
    comm: Communicator,
    *,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    prefetch: int = 2,
    check_order: bool = True,
    reduce_buffers: int = 3,
) -> nn.Module:
    """Shards `module`'s parameters (those no inner fully_shard owns) over
    `comm` and returns `module`, now also an FSDPModule. Collective: every rank
    calls it on the same module. `prefetch`, `check_order` and `reduce_buffers`
    are read from the root (the module sharded last, whose forward runs outermost).

    Raises ValueError on every rank for a module whose ancestor is already
    sharded, a parameter shared with another unit, parameters on several
    devices, a bad policy, or models that differ between ranks.
    """
    mp = mp_policy or MixedPrecisionPolicy()
    problems = []
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        problems.append(f"reshard_after_forward={reshard_after_forward!r} must be a bool or None")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dt = getattr(mp, name)
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            problems.append(f"mp_policy.{name}={dt!r} must be a floating-point torch.dtype")
    if prefetch < 0 or reduce_buffers < 0:
        problems.append(f"prefetch={prefetch}, reduce_buffers={reduce_buffers} must be >= 0")
    settings = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": repr(mp),
        "prefetch": prefetch,
        "check_order": check_order,
    }
    unit = ShardedUnit(
        module,
        comm,
        shard_params=True,
        reshard_after_forward=reshard_after_forward,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        output_dtype=mp.output_dtype,
        cast_forward_inputs=mp.cast_forward_inputs,
        what=f"fully_shard({type(module).__name__})",
        settings=settings,
        problems=problems,
    )
    unit.prefetch, unit.check_order, unit.reduce_buffers = prefetch, check_order, reduce_buffers
    unit.lazy_engine = _build_engine
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]
    return module


def _build_engine(root: ShardedUnit) -> None:
    """The root's first forward: ties the units inside it into one engine
    (collective: allocates the reduce-scatter windows)."""
    units, names = [], {}
    for name, m in root.module.named_modules():
        u = getattr(m, "_sharding_unit", None)
        if u is not None:
            units.append(u)
            names[id(u)] = name or "<root>"
    for u in units:
        if u.engine is not None:
            raise RuntimeError(
                f"fully_shard: unit '{names[id(u)]}' already belongs to another root's engine"
            )
        if u.comm is not root.comm:
            raise ValueError(
                f"fully_shard: unit '{names[id(u)]}' uses another communicator than its root"
            )
        u.name = names[id(u)]
    agree(
        root.comm,
        "fully_shard",
        [[u.name, [f.layout.padded_numel for f in u.flats]] for u in units],
        [],
    )
    engine = ShardingEngine(
        root.comm,
        root,
        units,
        prefetch=root.prefetch,
        check_order=root.check_order,
        reduce_buffers=root.reduce_buffers,
        overlap_reduce=True,
    )
    engine.require_grad_sync = all(u.pending_sync for u in units)
    engine.reshard_after_backward = all(u.pending_reshard for u in units)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Collective: clips the gradients of a fully_shard tree (give the root) by
    their global norm, computed across the shards; returns the norm."""
    if not isinstance(module, FSDPModule):
        raise TypeError("fsdp.clip_grad_norm_: give the root module returned by fully_shard")
    return module.clip_grad_norm_(max_norm, norm_type)


def fully_unshard(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Undoes fully_shard on `module` and every unit inside it, locally (no
    collective): removes the units' hooks and marks, gives the modules their
    own classes back and each parameter storage of its own in its full shape
    and dtype, holding `values[name]` (names in `module`, as
    full_parameters() gives them; a tied parameter by any of its names),
    without gradient. The module can then be sharded again, e.g. over the
    survivors' communicator after a lost rank; an optimizer over the old
    shards must not be used any more.

    Raises ValueError, changing nothing, for a parameter without a value or
    with a value of another shape."""
    units = [(n, m) for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    new: list[tuple[nn.Parameter, torch.Tensor]] = []
    problems = []
    for path, m in units:
        prefix = path + "." if path else ""
        for f in m.sharding_unit.flats:
            for s, p in zip(f.layout.slots, f.params, strict=True):
                names = [prefix + n for n in (s.name, *s.aliases)]
                v = next((values[n] for n in names if n in values), None)
                if v is None:
                    problems.append(f"'{names[0]}' has no value")
                elif tuple(v.shape) != s.shape:
                    problems.append(f"'{names[0]}': shape {tuple(v.shape)} != {s.shape}")
                else:
                    new.append((p, v.detach().to(f.device, f.layout.dtype, copy=True)))
    if problems:
        raise ValueError("fully_unshard: values: " + "; ".join(problems[:8]))
    for _, m in units:
        m.sharding_unit.detach()
        m.__class__ = type(m).__bases__[1]  # fully_shard's class is (FSDPModule, its own)
    for p, v in new:
        p.data = v
        p.grad = None
