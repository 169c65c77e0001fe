"""A unit: one module whose own parameters (those no unit inside it owns) are
sharded together, gathered together and reduced together. A transformer block
is a unit; the rest of the model (embeddings, final norm, the tied head) is the
root unit.

The unit holds one FlatParam per (dtype, requires_grad) group of its
parameters, gathers and frees them, and reports to its engine from the hooks it
installs: forward pre/post hooks (sharded units), a post-accumulate-grad hook
per trainable parameter (every unit). What to do when is the engine's business.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Protocol

import torch
from torch import nn

from pycollectives import Communicator, Work

from ...autograd_threads import autograd_comm
from .checks import agree, describe_params, device_problems
from .communications import OrderGuard, all_gather_flat
from .flat_param import FlatLayout, FlatParam
from .meter import EngineMeter

__all__ = ["FREE", "FULL", "GATHERING", "ShardedUnit"]

FREE, GATHERING, FULL = "free", "gathering", "full"


class UnitHooks(Protocol):
    """What a unit's hooks call on the engine that owns it (engine.py's
    ShardingEngine): the unit does not import the engine, which imports it."""

    meter: EngineMeter

    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...

    def post_forward(self, unit: ShardedUnit, output: Any) -> Any: ...

    def grad_ready(self, unit: ShardedUnit, g: int, i: int) -> None: ...


class ShardedUnit:
    """Shards `module`'s own parameters over `comm` (collective).

    Args:
        shard_params: ZeRO-3/FSDP: parameters sharded, gathered around uses.
            False (ZeRO-1/2): full parameters stay, as views of a flat buffer
            (a symmetric window on the CPU) that the all-gather after each
            optimizer step refreshes in place.
        reshard_after_forward: free the gathered parameters after forward
            (gather again in backward). None: True except for the root.
        param_dtype / reduce_dtype / output_dtype / cast_forward_inputs: mixed
            precision: the parameters compute in param_dtype (sharded: copies
            gathered per use; unsharded: the full parameters themselves), the
            gradients reduce-scatter in reduce_dtype (default param_dtype), the
            master shards stay in the parameters' dtype. (Forward hooks, hence
            the input and output casts, exist on sharded units only.)
        what: the caller's name, for error messages.

    Raises ValueError on every rank (never a hang) when any rank finds a
    problem: parameters on several devices or on meta, a parameter already
    sharded by another unit (an ancestor sharded first, or a parameter shared
    between units), a module sharded twice, or models that differ between ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        shard_params: bool,
        reshard_after_forward: bool | None = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        cast_forward_inputs: bool = True,
        persistent_grads: bool = False,
        what: str = "sharding",
        settings: dict[str, Any] | None = None,
        problems: list[str] | None = None,
    ) -> None:
        self.module, self.comm = module, autograd_comm(comm)
        self.kind = type(module).__name__  # the module's class, before fully_shard extends it
        self.name = self.kind  # the engine renames it to its path in the model
        self.index = -1
        self.shard_params = shard_params
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.output_dtype = param_dtype, output_dtype
        self.reduce_dtype = reduce_dtype or param_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.persistent_grads = persistent_grads
        self.engine: UnitHooks | None = None
        self.lazy_engine: Any = None  # fsdp: builds the engine when this unit runs as the root
        # What an engine built with this unit as its root takes (fully_shard sets them).
        self.prefetch, self.check_order, self.reduce_buffers = 2, True, 3
        self.pending_sync = True  # set_requires_gradient_sync before the engine exists
        self.pending_reshard = True  # set_reshard_after_backward before the engine exists
        self.state = FREE if shard_params else FULL

        owned, found = _own_parameters(module)
        named = [(n, p) for n, _, p in owned]
        settings = dict(settings or {}, shard_params=shard_params)
        agree(
            comm,
            what,
            [["settings", settings], *describe_params(named)],
            found + device_problems(named) + list(problems or []),
        )
        groups: dict[tuple[torch.dtype, bool], list[tuple[str, tuple[str, ...], nn.Parameter]]] = {}
        for entry in owned:
            p = entry[2]
            groups.setdefault((p.dtype, p.requires_grad), []).append(entry)
        window = comm.alloc_shared if not shard_params else None
        self.flats: list[FlatParam] = []
        for (dtype, trainable), entries in groups.items():
            layout = FlatLayout.build(
                [(n, a, tuple(p.shape)) for n, a, p in entries], dtype, trainable, comm.world_size
            )
            params = [p for _, _, p in entries]
            on_cpu = params[0].device.type == "cpu"
            compute = param_dtype if dtype.is_floating_point else None
            self.flats.append(
                FlatParam(
                    layout,
                    params,
                    comm.rank,
                    sharded=shard_params,
                    compute_dtype=compute,
                    alloc_window=window if on_cpu else None,
                )
            )
        self.trainable = [f for f in self.flats if f.layout.requires_grad]
        self.all_trainable = len(self.trainable) == len(self.flats)
        self.n_trainable = sum(len(f.params) for f in self.trainable)
        # (flat, parameter) pairs whose gradient arrived in this backward
        self.ready: set[tuple[int, int]] = set()
        self.complete = False  # every trainable gradient arrived (or the backward ended)
        self._works: list[Work | None] = []
        self._check: Any = None
        module._sharding_unit = self
        for f in self.flats:
            for p in f.params:
                p._sharding_owner = self
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_hook, g, i))
            for g, f in enumerate(self.trainable)
            for i, p in enumerate(f.params)
        ]
        if shard_params:
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            )
            self._hooks.append(module.register_forward_hook(self._post_forward))

    # -- gather and free ----------------------------------------------------------
    def start_gather(self, check: Any) -> None:
        """Starts the all-gathers of every flat parameter (the fingerprint
        `check` was announced just before)."""
        self._check = check
        self._works = [all_gather_flat(self.comm, f) for f in self.flats]
        self.state = GATHERING

    def finish_gather(self, guard: OrderGuard) -> None:
        """Waits for the gathers (after verifying the fingerprints up to this
        one) and points the parameters at the full buffers."""
        if self.state != GATHERING:
            return
        t0 = time.perf_counter()
        guard.settle(self._check)
        for w in self._works:
            if w is not None:
                w.wait()
        if self.engine is not None:
            self.engine.meter.gather_finished(time.perf_counter() - t0)
        self._works, self._check = [], None
        for f in self.flats:
            f.use_full()
        self.state = FULL

    def free(self, guard: OrderGuard) -> None:
        """Frees the gathered parameters (sharded units): the parameters show
        their shard pieces again and the full buffers lose their storage."""
        if not self.shard_params or self.state == FREE:
            return
        self.finish_gather(guard)  # never free storage a collective still writes
        for f in self.flats:
            f.use_shard()
            f.free_full()
        self.state = FREE

    def detach(self) -> None:
        """Removes this unit's hooks and marks from its module and parameters
        (local): the module can be sharded again. What the parameters show is
        the caller's business (ZeroOptimizer.detach gives them their values)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self.module, "_sharding_unit", None) is self:
            del self.module._sharding_unit
        for f in self.flats:
            for p in f.params:
                if getattr(p, "_sharding_owner", None) is self:
                    del p._sharding_owner

    def param_names(self) -> list[str]:
        """The unit's parameters' names in the model (the engine's naming)."""
        prefix = "" if self.name in ("", "<root>") else self.name + "."
        return [prefix + s.name for f in self.flats for s in f.layout.slots]

    # -- hooks (the engine decides) -------------------------------------------------
    def _engine(self) -> UnitHooks:
        if self.engine is None:
            if self.lazy_engine is None:
                raise RuntimeError(f"sharding: unit {self.name} has no engine")
            self.lazy_engine(self)
        assert self.engine is not None
        return self.engine

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._engine().pre_forward(self, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self._engine().post_forward(self, output)

    def _grad_hook(self, g: int, i: int, param: torch.Tensor) -> None:
        self._engine().grad_ready(self, g, i)


def _own_parameters(
    module: nn.Module,
) -> tuple[list[tuple[str, tuple[str, ...], nn.Parameter]], list[str]]:
    """The parameters `module` owns: those no unit inside it owns, each once
    (with the other names of a tied one). Also the problems found: a module
    already sharded, a parameter owned by an ancestor or a sibling unit."""
    problems = []
    if getattr(module, "_sharding_unit", None) is not None:
        problems.append(f"{module._sharding_unit.kind} is already sharded")
    inner = [
        m._sharding_unit
        for m in module.modules()
        if m is not module and getattr(m, "_sharding_unit", None) is not None
    ]
    taken = {id(p) for u in inner for f in u.flats for p in f.params}
    entries: dict[int, list[Any]] = {}
    foreign: dict[int, tuple[Any, list[str]]] = {}  # unit -> the parameters of ours it owns
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in taken:
            continue
        if id(p) in entries:
            entries[id(p)][1].append(name)
            continue
        entries[id(p)] = [name, [], p]
        owner = getattr(p, "_sharding_owner", None)
        if owner is not None:
            foreign.setdefault(id(owner), (owner, []))[1].append(name)
    for owner, names in foreign.values():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        listed = f"{names[:3]}{more}"
        if any(m is module for m in owner.module.modules()):
            problems.append(
                f"parameters {listed} already belong to the unit of {owner.kind}, which contains "
                "this module: shard bottom-up (the blocks first, then their parent)"
            )
        else:
            problems.append(
                f"parameters {listed} are shared with the unit of {owner.kind}: a shared (tied) "
                "parameter must belong to one unit; shard a module that contains all its uses"
            )
    return [(n, tuple(a), p) for n, a, p in entries.values()], problems
