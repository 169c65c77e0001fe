"""The sharding engine: one root unit and the units inside it, driven by their
hooks through forward and backward.

Forward: a unit's pre-forward hook gathers it (unless gathered already) and
prefetches the next `prefetch` units of the order the previous forward took;
its post-forward hook registers a pre-backward hook on its outputs and frees
it (reshard_after_forward). Backward: the first output hook of a unit to fire
gathers it again and prefetches the next units in the previous backward's
order; when every trainable parameter of a unit has its gradient, the unit is
freed and its gradients go to the GradReducer. An autograd callback at the end
of backward completes the units that got no gradient, waits for every
reduce-scatter and frees everything. With reshard_after_backward False
(FSDP2's set_reshard_after_backward), units gathered during no_sync
backwards stay gathered until the backward or reduce_accumulated that
reduces the gradients (an optimizer step follows it and changes the shards):
gradient accumulation and pipeline micro-batches gather each unit once per
step. Before each all-gather the ranks
exchange a fingerprint (OrderGuard): diverging ranks raise ShardingMismatch on
every rank instead of hanging or mixing units.

ZeRO-1/2 units are not sharded: no forward hooks, only gradients, and the
all-gather after the optimizer step (`gather_after_step`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from pycollectives import Communicator

from .communications import BACKWARD, FORWARD, STEP, OrderGuard, all_gather_flat
from .flat_param import GatherPool
from .gradients import GradReducer
from .meter import EngineMeter
from .unit import FREE, ShardedUnit

__all__ = ["ShardingEngine", "cast_floats", "count_storage"]


class ShardingEngine:
    """Drives `units` (the root among them) over `comm`. Collective to build
    (it may allocate symmetric windows).

    Args:
        prefetch: units gathered ahead of the one computing, in forward and in
            backward (0: gather on demand).
        check_order: exchange a fingerprint before every collective (see
            OrderGuard); False saves one small all-reduce per collective.
        reduce_buffers: window buffers for the gradients' reduce-scatters.
        overlap_reduce: reduce-scatter each unit during backward, as soon as
            its gradients are all produced (ZeRO-1/2/3, FSDP); False: all at
            the end of backward.
        master_grads: keep reduced gradients in the master dtype (FSDP: the
            parameters show them); False: in the reduce dtype (ZeroOptimizer
            casts them for its step).
        grad_hooks: False: the parameters' gradient hooks do nothing; the
            gradients stay in .grad until `reduce_gradients()` (unsharded
            units: a driver whose gradients arrive over many backwards and
            outside autograd, such as a pipeline step).

    Attribute `reshard_after_backward` (default True): False keeps gathered
    units gathered through the forwards and backwards that do not reduce
    gradients (no_sync); the reduction frees them.
    """

    def __init__(
        self,
        comm: Communicator,
        root: ShardedUnit,
        units: list[ShardedUnit],
        *,
        prefetch: int = 2,
        check_order: bool = True,
        reduce_buffers: int = 3,
        overlap_reduce: bool = True,
        master_grads: bool = True,
        grad_hooks: bool = True,
    ) -> None:
        if prefetch < 0 or reduce_buffers < 0:
            raise ValueError(
                f"sharding: prefetch={prefetch} and reduce_buffers={reduce_buffers} must be >= 0"
            )
        self.comm, self.root, self.units = comm, root, units
        for i, u in enumerate(units):
            u.index, u.engine = i, self
        self.prefetch = prefetch
        self.guard = OrderGuard(comm, [u.name for u in units], check_order)
        self.meter = EngineMeter()  # exposed communication, copies, gathers in flight
        self.grads = GradReducer(
            comm, root, units, guard=self.guard, meter=self.meter, announce=self.announce,
            overlap=overlap_reduce, buffers=reduce_buffers, master_grads=master_grads,
        )  # fmt: skip
        # freed full buffers handed to the next gather of the same size (CPU)
        self.gather_pool = GatherPool()
        for u in units:
            for f in u.flats:
                if f.sharded and GatherPool.supported(f.device):
                    f.pool = self.gather_pool
        self.require_grad_sync = True
        self.reshard_after_backward = True
        self.grad_hooks = grad_hooks
        self.step = 0  # synchronized backwards completed
        self.micro = 0  # backwards without synchronization since
        self.max_gathered = 0  # the most sharded units gathered at once (a measurement)
        self._depth = 0
        self._in_backward = False
        self._task = -1  # the autograd graph task of the backward in progress
        self._forwards = 0
        self._positions: dict[int, int] = {}
        self._fwd_prev: list[int] = []
        self._fwd_now: list[int] = []
        self._bwd_prev: list[int] = []
        self._bwd_now: list[int] = []
        self._bwd_seen: set[int] = set()
        self._ahead: list[ShardedUnit] = []

    # -- collectives ------------------------------------------------------------------
    def announce(self, unit: ShardedUnit, phase: int) -> Any:
        """Announces (fingerprint) the next collective of `unit` in `phase`."""
        pos = self._positions.get(phase, 0)
        self._positions[phase] = pos + 1
        return self.guard.announce(unit.index, phase, self.step, self.micro, pos, self._forwards)

    def _gather(self, unit: ShardedUnit, phase: int) -> None:
        if unit.state != FREE:
            return
        unit.start_gather(self.announce(unit, phase) if unit.flats else None)
        self.meter.gather_started()
        live = sum(u.state != FREE for u in self.units if u.shard_params and u.flats)
        self.max_gathered = max(self.max_gathered, live)

    def _ensure_full(self, unit: ShardedUnit, phase: int) -> None:
        if unit in self._ahead:
            self._ahead.remove(unit)
        self._gather(unit, phase)
        unit.finish_gather(self.guard)

    def _prefetch(self, phase: int) -> None:
        if self.prefetch <= 0:
            return
        if phase == FORWARD:
            now, prev = self._fwd_now, self._fwd_prev
        else:
            now, prev = self._bwd_now, self._bwd_prev or self._guess_backward()
        k = len(now)
        if prev[:k] != now:  # this pass left the previous one's order: no guessing
            return
        for i in prev[k : k + self.prefetch]:
            u = self.units[i]
            if u.shard_params and u.state == FREE and u.flats:
                self._gather(u, phase)
                self._ahead.append(u)

    def _guess_backward(self) -> list[int]:
        """The first backward's order: the root (its output starts backward),
        then the other units in reverse order of their last forward."""
        seen: list[int] = []
        for i in reversed(self._fwd_now):
            if i not in seen and i != self.root.index:
                seen.append(i)
        return [self.root.index, *seen]

    def _free_all(self) -> None:
        for u in self.units:
            u.free(self.guard)
        self._ahead.clear()
        self.gather_pool.clear()  # nothing gathered, nothing kept (between steps)

    # -- forward ----------------------------------------------------------------------
    def pre_forward(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A unit's forward begins: gather it, prefetch, cast inputs (mixed precision)."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._in_backward = False  # a backward raised before its final callback ran
        if self._in_backward:  # recomputation inside backward (activation checkpointing)
            self._ensure_full(unit, BACKWARD)
            return self._cast_inputs(unit, args, kwargs)
        if unit is self.root and self._depth == 0:
            if self.reshard_after_backward:  # a forward without backward may have left units
                self._free_all()
            self._fwd_prev = self._fwd_now or self._fwd_prev
            self._fwd_now, self._forwards, self._positions = [], 0, {}
        elif self._depth == 0:
            raise RuntimeError(
                f"sharding: rank {self.comm.rank}: unit '{unit.name}' ran its forward outside its "
                "root's forward; call the root module (the one sharded last)"
            )
        if unit is self.root:
            self._depth += 1
        self._forwards += 1
        self._fwd_now.append(unit.index)
        self._ensure_full(unit, FORWARD)
        self._prefetch(FORWARD)
        return self._cast_inputs(unit, args, kwargs)

    def post_forward(self, unit: ShardedUnit, output: Any) -> Any:
        """A unit's forward ended: hook its outputs for backward, free it."""
        if self._in_backward:
            return output
        grad = torch.is_grad_enabled()
        if grad:
            hook = functools.partial(self._output_hook, unit)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        if unit.output_dtype is not None:
            output = cast_floats(output, unit.output_dtype)
        reshard = unit.reshard_after_forward
        if reshard is None:
            reshard = unit is not self.root
        if unit is self.root:
            self._depth -= 1
            if self._depth == 0:
                for u in list(self._ahead):  # prefetched for a forward that did not come
                    u.free(self.guard)
                self._ahead.clear()
                if not grad:  # no backward will follow
                    self._free_all()
        if reshard or not grad:
            unit.free(self.guard)
        return output

    def _cast_inputs(self, unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit.param_dtype is None or not unit.cast_forward_inputs:
            return args, kwargs
        return cast_floats(args, unit.param_dtype), cast_floats(kwargs, unit.param_dtype)

    # -- backward ---------------------------------------------------------------------
    def _begin_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._in_backward and task == self._task:
            return
        self._in_backward, self._task = True, task  # (a stale flag: that backward raised)
        for u in self.units:
            u.ready.clear()
            u.complete = False
        self._bwd_now, self._bwd_seen = [], set()
        self.grads.begin(self.require_grad_sync)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _output_hook(self, unit: ShardedUnit, grad: torch.Tensor) -> None:
        self._begin_backward()
        if unit.index in self._bwd_seen or unit.complete:
            return
        self._bwd_seen.add(unit.index)
        self._bwd_now.append(unit.index)
        self._ensure_full(unit, BACKWARD)
        self._prefetch(BACKWARD)

    def grad_ready(self, unit: ShardedUnit, g: int, i: int) -> None:
        """Post-accumulate-grad hook of parameter i of unit's trainable flat g."""
        if not self.grad_hooks:
            return
        self._begin_backward()
        if unit.complete or (g, i) in unit.ready:
            name = unit.trainable[g].layout.slots[i].name
            raise RuntimeError(
                f"sharding: rank {self.comm.rank}: parameter '{name}' of unit '{unit.name}' got a "
                "second gradient in one backward, after its unit's gradients were reduced"
            )
        unit.ready.add((g, i))
        if len(unit.ready) == unit.n_trainable:
            self._complete(unit)

    def _complete(self, unit: ShardedUnit) -> None:
        unit.complete = True
        self.grads.unit_complete(unit)
        keep = not (self.reshard_after_backward or self.grads.sync)
        if unit.shard_params and unit.all_trainable and not keep:  # its backward is over
            unit.free(self.guard)

    def _finalize_backward(self) -> None:
        try:
            self._end_backward()
            self._bwd_prev = self._bwd_now
        finally:
            self._in_backward = False

    def _end_backward(self) -> None:
        """The end of a backward: the units that got no gradient (some of their
        parameters unused) completed; if it synchronizes, every reduce-scatter
        launched and waited for, the units freed and the shards exposed;
        without sync, the units freed unless reshard_after_backward is False."""
        for u in self.grads.order:
            if not u.complete:
                self._complete(u)
        sync = self.grads.sync
        if sync:
            self.grads.launch_ready(everything=True)
            self.grads.finish_all()
        if self.reshard_after_backward or sync:
            self._free_all()
        self.guard.settle()
        if sync:
            for u in self.units:
                for f in u.trainable:
                    f.expose_grads()
            self.step, self.micro = self.step + 1, 0
        else:
            self.micro += 1

    def reduce_gradients(self) -> None:
        """Collective: reduces the gradients the parameters hold now in .grad,
        as the end of a synchronized backward does (every unit complete, the
        reduce-scatters in the fixed order), then releases .grad. For an
        engine built with grad_hooks=False and unsharded units.

        Raises RuntimeError when the hooks are on or a unit is sharded."""
        if self.grad_hooks or any(u.shard_params for u in self.units):
            raise RuntimeError(
                f"sharding: rank {self.comm.rank}: reduce_gradients needs grad_hooks=False and "
                "unsharded units (ZeRO-1/2)"
            )
        self._reduce_now()

    def reduce_accumulated(self) -> None:
        """Collective: reduce-scatters the gradients that no_sync backwards
        accumulated (`accumulated`), as a synchronized backward adding
        nothing would: every unit in the fixed order, then the shards exposed.
        For a driver whose last backward cannot reduce yet (a pipeline step:
        the tied embedding/head gradient is summed across stages after every
        stage's last backward, and only then reduced).

        Raises RuntimeError inside a backward or with the hooks off."""
        if self._in_backward or not self.grad_hooks:
            raise RuntimeError(
                f"sharding: rank {self.comm.rank}: reduce_accumulated runs between backwards, "
                "with the gradient hooks on"
            )
        self._reduce_now()

    def accumulated(self, unit: ShardedUnit) -> dict[str, torch.Tensor]:
        """The gradients no_sync backwards accumulated for `unit`'s parameters
        since the last reduction: views of the accumulation buffers (writable:
        what reduce_accumulated reduces), by name in the unit."""
        out = {}
        for f in unit.trainable:
            acc = self.grads.accum.get(f)
            if acc is not None:
                for s in f.layout.slots:
                    out[s.name] = acc[s.offset : s.end].view(s.shape)
        return out

    def _reduce_now(self) -> None:
        """Every unit complete, its gradients reduce-scattered in the fixed
        order, the shards exposed: the end of a synchronized backward."""
        self.grads.begin(True)
        for u in self.units:
            u.ready.clear()
            u.complete = False
        self._end_backward()

    # -- between steps ------------------------------------------------------------------
    def gather_after_step(self) -> None:
        """ZeRO-1/2: every rank's updated shard into every rank's full parameters (in place)."""
        t0 = time.perf_counter()
        self._positions.pop(STEP, None)
        pending = []
        for u in self.grads.order:
            for f in u.trainable:
                pending.append((self.announce(u, STEP), all_gather_flat(self.comm, f)))
        for check, work in pending:
            self.guard.settle(check)
            if work is not None:
                work.wait()
        self.meter.step_gather_s += time.perf_counter() - t0

    def shards_written(self) -> None:
        """Collective: call after writing new values into the master shards (a
        checkpoint load): gathered units are freed (their next use gathers the
        new values) and unsharded units' full parameters are all-gathered,
        frozen ones included (sharded units have nothing to gather)."""
        self._free_all()
        self._positions.pop(STEP, None)
        pending = [
            (self.announce(u, STEP), all_gather_flat(self.comm, f))
            for u in self.units
            if not u.shard_params
            for f in u.flats
        ]
        for check, work in pending:
            self.guard.settle(check)
            if work is not None:
                work.wait()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate unsharded gradients without communication;
        the first synchronized backward after reduces their sum."""
        old = self.require_grad_sync
        self.require_grad_sync = False
        try:
            yield
        finally:
            self.require_grad_sync = old

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full value (master dtype), by name in the model."""
        out = {}
        for u in self.units:
            for f in u.flats:
                if f.sharded:
                    buf = torch.empty(f.layout.padded_numel, dtype=f.layout.dtype, device=f.device)
                    self.comm.all_gather(buf, f.shard)
                    values = f.full_value(buf)
                else:
                    values = f.full_views
                prefix = "" if u is self.root else u.name + "."
                for s, v in zip(f.layout.slots, values, strict=True):
                    out[prefix + s.name] = v.detach().clone()
        return out

    def layouts(self) -> list[dict[str, Any]]:
        """Every flat parameter's layout as plain data (see FlatLayout.to_dict)."""
        return [
            dict(unit=u.name, group=g, **f.layout.to_dict("" if u is self.root else u.name + "."))
            for u in self.units
            for g, f in enumerate(u.flats)
        ]

    def storage(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes held on this rank by role, each storage counted once: the
        parameters (full buffers now allocated, and freed ones kept for the
        next gather), the sharded parameters, the gradients (shards, ZeRO-1
        windows, no_sync buffers), the reduce-scatter window pool, and the
        optimizer's state if given."""
        out = count_storage(self.storage_roles(optimizer))
        out["params"] += self.gather_pool.nbytes  # freed full buffers awaiting the next gather
        return out

    def storage_roles(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """The tensors `storage` counts, by role (to count several engines' and other
        tensors together, each storage once: count_storage); the gather pool's kept
        buffers are not tensors, and none is kept between steps."""
        roles: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("params", "param_shards", "grads", "reduce_buffers", "optimizer")
        }
        for u in self.units:
            for f in u.flats:
                if f.allocated:
                    roles["params"].append(f.full)
                if f.own_master:
                    roles["param_shards"].append(f.shard)
                if f.grad_shard is not None:
                    roles["grads"].append(f.grad_shard)
        roles["grads"] += list(self.grads.persistent.values()) + list(self.grads.accum.values())
        roles["reduce_buffers"] = list(self.grads.pool.all) if self.grads.pool else []
        if optimizer is not None:
            roles["optimizer"] = [
                t
                for st in optimizer.state.values()
                for t in st.values()
                if isinstance(t, torch.Tensor)
            ]
        return roles


def count_storage(roles: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per role, each storage counted once (in the first role that holds it)."""
    seen: set[int] = set()
    out = {}
    for role, tensors in roles.items():
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        out[role] = total
    return out


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its floating-point tensors cast to `dtype`."""
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )
