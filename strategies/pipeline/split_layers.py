"""The backward split into I and W for tensor-parallel layers (see
split_backward.py for the plain ones).

Each split layer runs the same named communications as the layer it
replaces (communications.py: copy_to_tp_region, reduce_from_tp_region, ...)
around split_backward's linear Function, which computes dX = dY W in I and
leaves dW = dY^T X (and db = sum(dY)) for W. So every collective runs in I,
where autograd runs the communications' backwards, and W only multiplies
what I stashed:

- ColumnParallelLinear: copy_to_tp_region (sequence parallel:
  gather_from_sequence_parallel_region), then the split linear. I: the
  partial dX, then its all-reduce (reduce-scatter) across tp. W: dW and db
  from the full (gathered) input and dY. The unsplit layer overlaps that
  all-reduce with dW; split, dW is no longer in I to overlap with, and with
  sequence parallelism the gathered input (not its shard) waits for W.
- RowParallelLinear: the split linear without bias, reduce_from_tp_region
  (sequence parallel: reduce_scatter_to_sequence_parallel_region), then the
  bias by a split add whose W computes db = sum(dY). With sequence
  parallelism the bias sees only this rank's tokens and its gradient is
  summed across tp, a communication: that bias keeps its gradient in I
  (copy_to_tp_region, as unsplit).
- ParallelLMHead: the final layer norm, then the output projection by the
  vocabulary shard as a split column-parallel linear without bias.

Outside a pipeline step (no micro-batch open in the store) every gradient is
computed in the backward, as the unsplit layers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
from .split_backward import (
    WeightGradStore,
    _LinearFn,
    _Pending,
    bias_grad,
)

__all__ = [
    "SplitColumnParallelLinear",
    "SplitParallelLMHead",
    "SplitRowParallelLinear",
    "tensor_parallel_splits",
]


class _BiasFn(torch.autograd.Function):
    """Forward: y + b; backward: dY passes to y; with a pending list, db = sum(dY)
    is left for W; without, computed now."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, bias: torch.Tensor, pending: list | None
    ) -> torch.Tensor:
        ctx.bias, ctx.pending = bias, pending
        return y + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.pending is not None:
            ctx.pending.append(_Pending(None, ctx.bias, None, dy2.detach()))
            ctx.pending = None
            return dy, None, None
        return dy, bias_grad(dy2), None


def _column(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The column-parallel product of `layer` (weight, comm, sequence_parallel, store)."""
    comm = layer.comm
    if layer.sequence_parallel:
        total = gather_from_sequence_parallel_region(x, comm, SEQUENCE_DIM)
    else:
        total = copy_to_tp_region(x, comm)
    return _LinearFn.apply(total, layer.weight, bias, layer.store.open)


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
            return _LinearFn.apply(x, self.weight, self.bias, pending)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.comm)
        y = _LinearFn.apply(x, self.weight, None, pending)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.comm, SEQUENCE_DIM)
            return y if self.bias is None else y + copy_to_tp_region(self.bias, self.comm)
        y = reduce_from_tp_region(y, self.comm)
        return y if self.bias is None else _BiasFn.apply(y, self.bias, pending)

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


def tensor_parallel_splits() -> dict[type, Callable[[Any, WeightGradStore], nn.Module]]:
    """Each tensor-parallel layer class and the function making its split
    version (for split_weight_gradients)."""
    return {
        ColumnParallelLinear: SplitColumnParallelLinear.from_layer,
        RowParallelLinear: SplitRowParallelLinear.from_layer,
        ParallelLMHead: SplitParallelLMHead.from_layer,
    }
