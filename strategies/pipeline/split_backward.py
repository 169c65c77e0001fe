"""The backward split into I (input gradient) and W (weight gradient), layer
by layer, for zero-bubble schedules.

A linear layer y = x W^T + b has three gradients. I needs only one of them,
dX = dY W, to send to the previous stage; dW = dY^T X and db = sum(dY) wait
for W, off the critical path. `SplitLinear` (an nn.Linear, same parameters
and names) does exactly that with an explicit autograd Function: its
backward computes dX and appends (layer, X, dY) to the pending list of the
micro-batch that ran its forward; `WeightGradStore.backward_weight(j)` later
computes dW and db for each entry and accumulates them into `.grad`. The
LM head's output projection (F.linear by the tied weight) is split the same
way (`SplitLMHead`).

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

Tensor-parallel layers split too (split_layers.py): their
communications stay the named autograd functions they are, around the same
split linear Function, so every collective runs in I and W computes
without communicating.

Outside a pipeline step (no micro-batch open) a SplitLinear computes every
gradient in its backward, as nn.Linear does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ..models.gpt import LMHead

__all__ = [
    "SplitLMHead",
    "SplitLinear",
    "WeightGradStore",
    "deferred_parameters",
    "split_weight_gradients",
]


class _Pending(NamedTuple):
    """What W needs of one linear layer for one micro-batch."""

    weight: nn.Parameter | None  # None: a bias alone (split_tensor_parallel's bias add)
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


class _LinearFn(torch.autograd.Function):
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
        return _LinearFn.apply(x, self.weight, self.bias, self.store.open)

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
        logits = _LinearFn.apply(self.ln_f(x), self.weight, None, self.store.open)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def deferred_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients W computes."""
        return [self.weight]


def split_weight_gradients(module: nn.Module, store: WeightGradStore) -> int:
    """Replaces, in place, every nn.Linear and LMHead inside `module`, and
    every ColumnParallelLinear, RowParallelLinear and ParallelLMHead (exactly
    those classes, not subclasses), by its split version recording into
    `store`; parameters and their names are unchanged. Returns how many
    layers were replaced."""
    # here, not at the top: split_tensor_parallel builds on this module
    from .split_layers import tensor_parallel_splits

    splits = {nn.Linear: SplitLinear.from_linear, LMHead: SplitLMHead.from_head}
    splits.update(tensor_parallel_splits())
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
