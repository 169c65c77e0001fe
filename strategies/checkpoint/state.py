"""What a model and its optimizer hold on this rank, named per parameter:
the bridge between the strategies' layouts and pieces.

Every parameter (and persistent buffer) of the model becomes one Entry per
rank: its global name and shape, this rank's part of it (a flat range for
ZeRO and FSDP shards, all of it for a plain model), whether this rank writes
it, and where the optimizer keeps its state. Three layouts are recognized:

- ZeroOptimizer (stages 1, 2, 3): the units' flat parameters
  (`model._sharding_unit` on every unit module, FlatLayout.pieces per rank);
  the inner optimizer's parameter per flat is `FlatParam.opt_param`, and a
  parameter's state is the slice [at, at + n) of that flat's state tensors.
- fully_shard: the same flat parameters; the torch optimizer's parameters are
  the model's own Parameter objects (1-D pieces of the shard), each with
  state of the piece's size.
- a plain model (one process, or replicated as under DDP): whole tensors;
  rank 0 writes, every rank reads.

Optimizer state tensors of zero dimensions (AdamW's `step`) are saved once
per parameter (by the first rank holding it) as a scalar; the others are
elementwise, sharded like their parameter. A ZeroOptimizer keeps one scalar
per flat parameter (a unit's parameters of one dtype), saved as every one of
its parameters' value; loading into a ZeroOptimizer a checkpoint whose
parameters of one flat saved different values (fully_shard or a plain torch
optimizer that skipped a parameter without gradient in some steps) raises
ValueError on every rank instead of keeping one of them (loading.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator

from ..data_parallel.sharding.engine import ShardingEngine
from ..data_parallel.zero import ZeroOptimizer

__all__ = ["Entry", "Layout", "collect", "jsonable"]


@dataclass
class Entry:
    """One parameter or buffer, as this rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    flat: tuple[int, int] | None  # this rank's range of its flattening (None: all of it)
    value: torch.Tensor  # this rank's part, sharing the live storage
    write: bool  # this rank saves `value` (False: another rank saves the same elements)
    opt_param: torch.Tensor | None  # what the optimizer keys this entry's state by
    span: tuple[int, int] | None  # the slice of opt_param's state that is this entry (None: all)
    write_scalars: bool  # this rank saves the entry's scalar state (the first holder)


@dataclass
class Layout:
    """A model and optimizer as entries, with what loading needs."""

    kind: str  # "zero1" / "zero2" / "zero3" / "fsdp" / "plain"
    entries: list[Entry]
    optimizer: torch.optim.Optimizer | None  # the torch optimizer that holds the state
    engine: ShardingEngine | None  # to refresh after a load (None: nothing to refresh)


def collect(model: nn.Module, optimizer: Any, comm: Communicator | None, what: str) -> Layout:
    """The Layout of `model` and `optimizer` (a ZeroOptimizer, a torch
    optimizer or None) on this rank. Raises TypeError for another optimizer."""
    rank = 0 if comm is None else comm.rank
    zero = optimizer if isinstance(optimizer, ZeroOptimizer) else None
    if zero is not None:
        inner: torch.optim.Optimizer | None = zero.optimizer
        if zero.model is not model:
            raise ValueError(f"{what}: rank {rank}: optimizer is a ZeroOptimizer of another model")
    elif optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        inner = optimizer
    else:
        raise TypeError(
            f"{what}: rank {rank}: optimizer={type(optimizer).__name__} is neither a "
            "ZeroOptimizer nor a torch.optim.Optimizer"
        )
    units = [(n, m._sharding_unit) for n, m in model.named_modules() if _unit(m)]
    entries: list[Entry] = []
    if units:
        for path, unit in units:
            prefix = path + "." if path else ""
            for f in unit.flats:
                layout = f.layout
                for i, (s, (lo, hi, at)) in enumerate(
                    zip(layout.slots, layout.pieces(f.rank), strict=True)
                ):
                    holders = layout.holders(i)
                    first = holders[0][0] if holders else 0
                    trainable = layout.requires_grad
                    entries.append(
                        Entry(
                            prefix + s.name,
                            s.shape,
                            layout.dtype,
                            (lo, hi),
                            f.shard[at : at + hi - lo],
                            hi > lo,
                            (f.opt_param if zero else f.params[i]) if trainable else None,
                            (at, at + hi - lo) if zero else None,
                            f.rank == first,
                        )
                    )
        engine = zero.engine if zero else units[0][1].engine
        kind = f"zero{zero.stage}" if zero else "fsdp"
    else:
        if zero is not None:
            raise ValueError(f"{what}: rank {rank}: the ZeroOptimizer's model has no units")
        for name, p in model.named_parameters():
            entries.append(
                Entry(
                    name,
                    tuple(p.shape),
                    p.dtype,
                    None,
                    p.detach(),
                    rank == 0,
                    p if p.requires_grad else None,
                    None,
                    rank == 0,
                )
            )
        engine, kind = None, "plain"
    kept = model.state_dict(keep_vars=True)
    for name, b in model.named_buffers():
        if name in kept:  # persistent buffers (replicated in every layout): rank 0 writes
            entries.append(
                Entry(name, tuple(b.shape), b.dtype, None, b, rank == 0, None, None, False)
            )
    return Layout(kind, entries, inner, engine)


def _unit(m: nn.Module) -> bool:
    return getattr(m, "_sharding_unit", None) is not None


def jsonable(v: Any) -> bool:
    """A hyperparameter that JSON keeps (numbers, strings, None, lists of them)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, (list, tuple)) and all(jsonable(x) for x in v)


def state_of(opt: torch.optim.Optimizer, e: Entry) -> dict[str, torch.Tensor]:
    """The optimizer state of entry `e`: scalars (0-dim) whole, the others sliced
    to the entry. Raises ValueError for state that is not a tensor."""
    if e.opt_param is None:
        return {}
    st = opt.state.get(e.opt_param) or {}
    out = {}
    for k, v in st.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"optimizer state '{k}' of '{e.name}' is a {type(v).__name__}, not a tensor"
            )
        out[k] = v if v.dim() == 0 or e.span is None else v[e.span[0] : e.span[1]]
    return out
