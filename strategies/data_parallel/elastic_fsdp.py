"""fully_shard (FSDP2-style) training that goes on when a rank dies (on one
host or across hosts; docs/recovery.md, "Sharded state: ElasticFSDP").

Each rank's shard state (its parameter shards, frozen ones included, and its
torch optimizer's state of them) has a buddy copy (redundancy.py's BuddyCopy:
in host memory on the rank and on its buddy, a rank on another host where the
ranks span hosts), refreshed every `copy_every`
steps, on ElasticDataParallel's step loop (elastic.py): backward, the
optimizer step (local under FSDP) and the refresh, then an agreement
(elastic_sharded.py's ElasticBuddyCopy gives that loop's hooks); where
every rank succeeded the step counts and the refresh becomes the copy.
Otherwise the survivors shrink the communicator, rebuild the full state of
the last copy (their own copies and the dead ranks' from their buddies), undo
fully_shard (fsdp.fully_unshard: full parameters holding the copy's values),
shard the model again over the survivors with the same plan, build a new
optimizer (the old one's hyperparameters) holding the copy's state of each
new piece, and roll back to the copy's step: `steps` is the step the caller
runs next.

    model = ElasticFSDP(gpt, torch.optim.AdamW, comm, copy_every=1, lr=1e-3)
    while model.steps < total:
        s = model.steps
        model.step(lambda m, rank, size: loss_of(m, batch(s, rank, size)))

`FSDPShards` lays out the state of a fully_shard model for BuddyCopy: a torch
optimizer over fully_shard's parameters keeps state per parameter piece (a
piece of another size on each rank, empty on some), so each elementwise state
is placed as its flat parameter's shard (every piece at its offset in it) and
every rank's packed state has the same entries; the scalar state (AdamW's
`step`) is kept per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator

from ..data import ElasticSampler
from .elastic_sharded import ElasticBuddyCopy
from .fsdp import FSDPModule, fully_shard, fully_unshard
from .redundancy import Entry, FullState
from .sharding.flat_param import FlatParam
from .zero import default_units

__all__ = ["ElasticFSDP", "FSDPShards", "shard_blocks"]

_ALIGN = 64  # bytes: every packed entry starts aligned (views of any dtype)


def shard_blocks(model: nn.Module, comm: Communicator) -> None:
    """The default sharding plan: fully_shard on each block (the elements of
    the model's outermost ModuleLists), then on the model (the root)."""
    for block in default_units(model):
        fully_shard(block, comm)
    fully_shard(model, comm)


def _units(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


class FSDPShards:
    """A fully_shard model's shard state on this rank, as a ShardSource
    (redundancy.py): per flat parameter (the units' in the model's module
    order) its master shard, then, for trainable ones, each elementwise
    optimizer state as a shard of the flat (this rank's pieces at their
    offsets) and each scalar state per parameter."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator):
        self.optimizer, self.comm = optimizer, comm
        # (the unit's path in the model, with a trailing dot, and the flat), kept: a
        # recovery unshards the units and shards the model anew
        self.named_flats: list[tuple[str, FlatParam]] = [
            (path + "." if path else "", f)
            for path, m in _units(model)
            for f in m.sharding_unit.flats
        ]
        self.flats = [f for _, f in self.named_flats]

    def _state(self, f: FlatParam) -> tuple[list[str], list[str]]:
        """(elementwise keys, scalar keys) of the state of `f`'s parameters,
        the same for each. Raises TypeError naming the parameter otherwise."""
        if not f.layout.requires_grad:
            return [], []
        states = [self.optimizer.state.get(p) or {} for p in f.params]
        keys = sorted(next((st for st in states if st), {}))
        for s, st, (lo, hi, _) in zip(f.layout.slots, states, f.layout.pieces(f.rank), strict=True):
            bad = sorted(st) != keys or any(
                not isinstance(t, torch.Tensor) or (t.dim() != 0 and tuple(t.shape) != (hi - lo,))
                for t in st.values()
            )
            if bad:
                held = {k: type(v).__name__ for k, v in st.items()}
                raise TypeError(
                    f"FSDPShards: rank {self.comm.rank}: the optimizer state of '{s.name}' "
                    f"({held}) has other keys than its flat's other parameters' ({keys}) or "
                    "holds what is neither a scalar tensor nor a tensor of its piece's shape"
                )
        first = next((st for st in states if st), {})
        return [k for k in keys if first[k].dim()], [k for k in keys if not first[k].dim()]

    def layout(self) -> tuple[list[Entry], list[torch.Tensor]]:
        entries: list[Entry] = []
        tensors: list[torch.Tensor] = []
        off = 0

        def add(i: int, key: str, t: torch.Tensor, shape: tuple, sharded: bool, slot: int) -> None:
            nonlocal off
            n = int(torch.Size(shape).numel()) * t.element_size()
            entries.append(Entry(i, key, t.dtype, shape, off, n, sharded, t.device, slot))
            off = -(-(off + n) // _ALIGN) * _ALIGN

        for i, f in enumerate(self.flats):
            c = f.layout.shard_numel
            add(i, "param", f.shard, (c,), True, -1)
            tensors.append(f.shard)
            arrays, scalars = self._state(f)
            for key in arrays:
                st = [self.optimizer.state[p][key] for p in f.params]
                add(i, key, st[0], (c,), True, -1)
                tensors += st
            for j, p in enumerate(f.params):
                for key in scalars:
                    t = self.optimizer.state[p][key]
                    add(i, key, t, (), False, j)
                    tensors.append(t)
        return entries, tensors

    def place(self, entries: list[Entry], rank: int) -> list[tuple[int, int]]:
        out = []
        for e in entries:
            if e.sharded and e.key != "param":  # a piece per parameter, at its offset
                size = e.dtype.itemsize
                pieces = self.flats[e.flat].layout.pieces(rank)
                out += [(e.offset + at * size, (hi - lo) * size) for lo, hi, at in pieces]
            else:
                out.append((e.offset, e.nbytes))
        return out


class ElasticFSDP(ElasticBuddyCopy):
    """A model sharded with fully_shard over `comm` (by `shard`), trained by
    `optimizer_class(model.parameters(), **optimizer_kwargs)`, whose shard
    state survives the loss of ranks (see the module docstring).

    Args:
        module: the model, not yet sharded; every rank builds the same.
        shard: shard(module, comm) applies fully_shard to it (bottom-up, the
            module itself last: the root), at start and again over the
            survivors after each recovery. Default: shard_blocks.
        copy_every: refresh the buddy copies every this many steps (k): up to
            k - 1 completed steps are redone after a failure, besides the
            failed one.
        placement: where the buddies are (BuddyCopy's; default "auto": on
            another host whenever the ranks span hosts).
        sampler: an ElasticSampler the loss function takes its ids from
            (committed with each step, rolled back with the copy).

    `optimizer` is the current torch optimizer (a new one after each
    recovery: a learning-rate scheduler must follow it); `steps` the steps
    that counted; `recoveries` as ElasticDataParallel's. Raises ValueError for
    a copy_every that is not a positive int, a placement that cannot be
    honoured or a `shard` that left the module unsharded, and what
    fully_shard raises.
    """

    optimizer: torch.optim.Optimizer

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        comm: Communicator,
        *,
        copy_every: int = 1,
        shard: Callable[[nn.Module, Communicator], Any] | None = None,
        placement: str = "auto",
        sampler: ElasticSampler | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        self._shard = shard or shard_blocks
        self._build = (optimizer_class, optimizer_kwargs)
        super().__init__(module, comm, copy_every, placement, sampler)

    def step(self, loss_fn: Callable[[nn.Module, int, int], torch.Tensor]) -> bool:  # type: ignore[override]
        """One training step: zero_grad, loss_fn(model, rank, world_size) (the
        forward on this rank's share of the batch) and its backward, the
        optimizer step, every copy_every steps the buddy refresh; then the
        agreement. Returns True when the step counted (`steps` advanced);
        False when a rank failed: the state was rebuilt on the survivors as of
        step `steps` (the last committed copy), from which the caller goes on.

        Raises what loss_fn raises other than a PyCollectivesError,
        CommunicatorAborted on a rank fenced out (it must leave), and
        RuntimeError when a rank and its buddy both failed (state lost)."""
        return super().step(loss_fn, self.optimizer)

    def wrap(self, comm: Communicator) -> nn.Module:
        """Shards the module over `comm` and builds its optimizer; after a
        failure, from the rebuilt state (`_full`): the module unsharded
        holding the copy's values, sharded again, and the new optimizer given
        the copy's state of each new piece and the old one's hyperparameters.
        Stages the first copy."""
        optimizer_class, kwargs = self._build
        full = self._full
        if full is not None:
            values, state = _unflatten(self.copy.source, full)  # type: ignore[arg-type]
            fully_unshard(self.module, values)
        self._shard(self.module, comm)
        if not isinstance(self.module, FSDPModule):
            raise ValueError(
                f"ElasticFSDP: rank {comm.rank}: shard= did not apply fully_shard to the module "
                "itself (the root)"
            )
        opt = optimizer_class(self.module.parameters(), **kwargs)
        if full is not None:
            for g_new, g_old in zip(opt.param_groups, self.optimizer.param_groups, strict=True):
                g_new.update({k: v for k, v in g_old.items() if k != "params"})  # e.g. the lr
            for _, m in _units(self.module):
                for f in m.sharding_unit.flats:
                    for p, (lo, hi, _) in zip(f.params, f.layout.pieces(comm.rank), strict=True):
                        st = {
                            k: (t[lo:hi] if t.dim() else t).to(p.device, copy=True)
                            for k, t in state.get(p, {}).items()
                        }
                        if st:
                            opt.state[p] = st
        self.optimizer = opt
        self._stage(FSDPShards(self.module, opt, comm))
        return self.module

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> None:
        self.optimizer.step()  # local: each rank steps its pieces


def _unflatten(
    source: FSDPShards, full: FullState
) -> tuple[dict[str, torch.Tensor], dict[nn.Parameter, dict[str, torch.Tensor]]]:
    """From the full state of `source`'s flats: every parameter's value by
    name, and its optimizer state (elementwise ones flattened whole, scalars
    as they are) by Parameter."""
    values: dict[str, torch.Tensor] = {}
    state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    by_flat: dict[int, list[tuple[str, int, torch.Tensor, Entry]]] = {}
    for (i, key, slot), (t, e) in full.items():
        by_flat.setdefault(i, []).append((key, slot, t, e))
    for i, (prefix, f) in enumerate(source.named_flats):
        for key, slot, t, e in by_flat.get(i, []):
            for j, (s, p) in enumerate(zip(f.layout.slots, f.params, strict=True)):
                if key == "param":
                    values[prefix + s.name] = t[s.offset : s.end].view(s.shape)
                elif e.sharded:
                    state.setdefault(p, {})[key] = t[s.offset : s.end]
                elif slot == j:
                    state.setdefault(p, {})[key] = t
    return values, state
