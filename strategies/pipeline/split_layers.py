"""The layers whose weight gradients wait for W, and `split_weight_gradients`,
which swaps them in for the plain ones (split_backward.py holds the autograd
Functions they run and the WeightGradStore).

`SplitLinear` (an nn.Linear, same parameters and names) runs LinearFn; so
does `SplitLMHead` for the LM head's output projection (F.linear by the tied
weight).

Tensor-parallel layers split too. Each runs the same named communications
as the layer it replaces (tensor_parallel/communications.py:
copy_to_tp_region, reduce_from_tp_region, ...) around LinearFn, which
computes dX = dY W in I and leaves dW = dY^T X (and db = sum(dY)) for W. So
every collective runs in I, where autograd runs the communications'
backwards, and W only multiplies what I stashed:

- ColumnParallelLinear: copy_to_tp_region (sequence parallel:
  gather_from_sequence_parallel_region), then the split linear. I: the
  partial dX, then its all-reduce (reduce-scatter) across tp. W: dW and db
  from the full (gathered) input and dY. The unsplit layer overlaps that
  all-reduce with dW; split, dW is no longer in I to overlap with, and with
  sequence parallelism the gathered input (not its shard) waits for W.
- RowParallelLinear: the split linear without bias, reduce_from_tp_region
  (sequence parallel: reduce_scatter_to_sequence_parallel_region), then the
  bias by a split add (BiasFn) whose W computes db = sum(dY). With sequence
  parallelism the bias sees only this rank's tokens and its gradient is
  summed across tp, a communication: that bias keeps its gradient in I
  (copy_to_tp_region, as unsplit).
- ParallelLMHead: the final layer norm, then the output projection by the
  vocabulary shard as a split column-parallel linear without bias.

Outside a pipeline step (no micro-batch open in the store) every gradient is
computed in the backward, as the unsplit layers do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ..models.gpt import LMHead
from ..tensor_parallel.communications import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from ..tensor_parallel.layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.parallelize import ParallelLMHead
from .split_backward import BiasFn, LinearFn, WeightGradStore

__all__ = [
    "SplitColumnParallelLinear",
    "SplitLMHead",
    "SplitLinear",
    "SplitParallelLMHead",
    "SplitRowParallelLinear",
    "deferred_parameters",
    "split_weight_gradients",
]


class SplitLinear(nn.Linear):
    """nn.Linear whose weight gradient waits for W (see the module docstring).
    Built from an nn.Linear, sharing its parameters."""

    store: WeightGradStore

    @classmethod
    def from_linear(cls, linear: nn.Linear, store: WeightGradStore) -> SplitLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.store = store
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearFn.apply(x, self.weight, self.bias, self.store.open)

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        return [p for p in (self.weight, self.bias) if p is not None]


class SplitLMHead(LMHead):
    """LMHead whose output projection's weight gradient waits for W."""

    store: WeightGradStore

    @classmethod
    def from_head(cls, head: LMHead, store: WeightGradStore) -> SplitLMHead:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.ln_f, layer.weight, layer.store = head.ln_f, head.weight, store
        return layer

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = LinearFn.apply(self.ln_f(x), self.weight, None, self.store.open)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        return [self.weight]


def _column(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The column-parallel product of `layer` (weight, comm, sequence_parallel, store)."""
    comm = layer.comm
    if layer.sequence_parallel:
        total = gather_from_sequence_parallel_region(x, comm, SEQUENCE_DIM)
    else:
        total = copy_to_tp_region(x, comm)
    return LinearFn.apply(total, layer.weight, bias, layer.store.open)


def _share(cls: type, layer: nn.Module, store: WeightGradStore) -> Any:
    """An instance of `cls` with `layer`'s attributes (its Parameters shared) and `store`."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    new._parameters = dict(layer._parameters)
    new._modules = dict(layer._modules)
    new._buffers = dict(layer._buffers)
    new.store = store
    return new


class SplitColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose weight and bias gradients wait for W."""

    store: WeightGradStore

    @classmethod
    def from_layer(
        cls, layer: ColumnParallelLinear, store: WeightGradStore
    ) -> SplitColumnParallelLinear:
        return _share(cls, layer, store)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _column(self, x, self.bias)
        return gather_from_tp_region(y, self.comm) if self.gather_output else y

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        return [p for p in (self.weight, self.bias) if p is not None]


class SplitRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose weight gradient waits for W, and its bias's
    too unless sequence parallelism sums that across tp."""

    store: WeightGradStore

    @classmethod
    def from_layer(cls, layer: RowParallelLinear, store: WeightGradStore) -> SplitRowParallelLinear:
        return _share(cls, layer, store)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = self.store.open
        if self.comm.world_size == 1:
            return LinearFn.apply(x, self.weight, self.bias, pending)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.comm)
        y = LinearFn.apply(x, self.weight, None, pending)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.comm, SEQUENCE_DIM)
            return y if self.bias is None else y + copy_to_tp_region(self.bias, self.comm)
        y = reduce_from_tp_region(y, self.comm)
        return y if self.bias is None else BiasFn.apply(y, self.bias, pending)

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        bias = None if self.sequence_parallel and self.comm.world_size > 1 else self.bias
        return [p for p in (self.weight, bias) if p is not None]


class SplitParallelLMHead(ParallelLMHead):
    """ParallelLMHead whose output projection's weight gradient waits for W."""

    store: WeightGradStore

    @classmethod
    def from_layer(cls, layer: ParallelLMHead, store: WeightGradStore) -> SplitParallelLMHead:
        return _share(cls, layer, store)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = _column(self, self.ln_f(x), None)
        if targets is None:
            return gather_from_tp_region(logits, self.comm)
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.comm, self.vocab_start
        )

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        return [self.weight]


def split_weight_gradients(module: nn.Module, store: WeightGradStore) -> int:
    """Replaces, in place, every nn.Linear and LMHead inside `module`, and
    every ColumnParallelLinear, RowParallelLinear and ParallelLMHead (exactly
    those classes, not subclasses), by its split version recording into
    `store`; parameters and their names are unchanged. Returns how many
    layers were replaced."""
    splits = {
        nn.Linear: SplitLinear.from_linear,
        LMHead: SplitLMHead.from_head,
        ColumnParallelLinear: SplitColumnParallelLinear.from_layer,
        RowParallelLinear: SplitRowParallelLinear.from_layer,
        ParallelLMHead: SplitParallelLMHead.from_layer,
    }
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            split = splits.get(type(child))
            if split is not None:
                setattr(parent, name, split(child, store))
                count += 1
    return count


def deferred_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters whose gradients W computes (those of the split layers
    inside `modules`), each once: their post-accumulate-grad hooks fire in I
    without a gradient, so a gradient averager must send them after W."""
    out: dict[int, nn.Parameter] = {}
    for root in modules:
        for mod in root.modules():
            fn = getattr(mod, "deferred_parameters", None)
            if fn is not None and isinstance(mod, nn.Module):
                out.update((id(p), p) for p in fn())
    return list(out.values())
