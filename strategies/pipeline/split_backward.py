"""The backward split into I (input gradient) and W (weight gradient), for
zero-bubble schedules: the autograd Functions that leave the weight
gradients for W, and the store W takes them from. The layers that run them
are in split_layers.py.

A linear layer y = x W^T + b has three gradients. I needs only one of them,
dX = dY W, to send to the previous stage; dW = dY^T X and db = sum(dY) wait
for W, off the critical path. `LinearFn`, an explicit autograd Function,
does exactly that: its backward computes dX and appends (layer, X, dY) to
the pending list of the micro-batch that ran its forward;
`WeightGradStore.backward_weight(j)` later computes dW and db for each entry
and accumulates them into `.grad`. `BiasFn` does the same for a bias added
apart (after a tensor-parallel all-reduce).

The arithmetic is torch's own: for contiguous inputs nn.Linear's autograd
computes dX = dY.mm(W), dW = dY^T.mm(X) and db = dY.sum(0) on the flattened
[tokens, features] views (`mm_mat1_backward`, `mm_mat2_backward` with a
transposed weight, `sum_to`); these functions run the same calls, so split
gradients are bitwise those of the full backward.

Other parameters get their gradients in I, from autograd, as before:

- layer norm: one kernel (native_layer_norm_backward) computes dX, dgamma
  and dbeta together from the same saved statistics; deferring dgamma and
  dbeta would keep x-hat and dY alive until W for O(d) work per token;
- embeddings: their gradient is an index-add of the output gradient, with
  no input gradient to hurry for;
- any other layer: unchanged, full backward in I.

Outside a pipeline step (no micro-batch open in the store) these Functions
compute every gradient in their backward, as nn.Linear does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["BiasFn", "LinearFn", "WeightGradStore"]


class _Pending(NamedTuple):
    """What W needs of one linear layer for one micro-batch."""

    weight: nn.Parameter | None  # None: a bias alone (BiasFn)
    bias: nn.Parameter | None
    x: torch.Tensor | None  # [tokens, in]; None with weight None
    dy: torch.Tensor  # [tokens, out]


def input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dX = dY W, on [tokens, out] x [out, in]."""
    return dy.mm(weight)


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X, on [tokens, out] and [tokens, in]."""
    return dy.t().mm(x)


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """db = the sum of dY over tokens."""
    return dy.sum(0)


def accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    """p.grad += g (p.grad = g the first time), as autograd's AccumulateGrad."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


class LinearFn(torch.autograd.Function):
    """y = F.linear(x, weight, bias). Backward: dX = dY W; with a pending list
    (a micro-batch open in the store at forward), dW and db are left for W;
    without, computed now."""

    @staticmethod
    def forward(ctx, x, weight, bias, pending):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.pending = (weight, bias), pending  # the Parameters W accumulates into
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = input_grad(dy2, weight).view(x.shape) if ctx.needs_input_grad[0] else None
        x2 = x.detach().reshape(-1, x.shape[-1])
        if ctx.pending is not None:
            # Detached, and the node let go of the list: an x with its grad_fn
            # would tie the list to the graph upstream, whose earlier linear
            # layers' nodes hold the same list: a cycle through autograd's C++
            # nodes, which the garbage collector cannot break.
            ctx.pending.append(_Pending(*ctx.params, x2, dy2.detach()))
            ctx.pending = None
            return dx, None, None, None
        db = bias_grad(dy2) if ctx.params[1] is not None else None
        return dx, weight_grad(dy2, x2), db, None


class BiasFn(torch.autograd.Function):
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


class WeightGradStore:
    """The W work of one stage, per micro-batch: forwards run inside
    `microbatch(j)` record into micro-batch j's list, which their backward
    (I) fills and `backward_weight(j)` empties."""

    def __init__(self) -> None:
        self._open: list[_Pending] | None = None
        self._pending: dict[int, list[_Pending]] = {}

    @contextlib.contextmanager
    def microbatch(self, j: int) -> Iterator[None]:
        """Forwards inside belong to micro-batch j (their W waits for
        backward_weight(j))."""
        self._open = self._pending.setdefault(j, [])
        try:
            yield
        finally:
            self._open = None

    @property
    def open(self) -> list[_Pending] | None:
        return self._open

    def held(self, j: int) -> list[torch.Tensor]:
        """The tensors micro-batch j keeps for its W (X and dY of each layer)."""
        return [t for e in self._pending.get(j, ()) for t in (e.x, e.dy) if t is not None]

    def parameters(self, j: int) -> list[nn.Parameter]:
        """The parameters W of micro-batch j will accumulate into, in order."""
        return [p for e in self._pending.get(j, ()) for p in (e.weight, e.bias) if p is not None]

    def backward_weight(self, j: int) -> None:
        """W of micro-batch j: dW = dY^T X and db = sum(dY) of every layer its I
        went through, accumulated into .grad.

        Raises RuntimeError if micro-batch j has no forward recorded.
        """
        entries = self._pending.pop(j, None)
        if entries is None:
            raise RuntimeError(f"WeightGradStore: W of micro-batch {j} before its forward")
        with torch.no_grad():
            for e in entries:
                if e.weight is not None:
                    accumulate(e.weight, weight_grad(e.dy, e.x))
                if e.bias is not None:
                    accumulate(e.bias, bias_grad(e.dy))

    def __len__(self) -> int:
        return len(self._pending)
