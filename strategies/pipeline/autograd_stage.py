"""What one stage does for one action: F, B, I or W of a micro-batch, with
autograd; and the count of activations held, taken as they run.

`AutogradStage` wraps a stage module (a GPTStage, or any nn.Module with
`input_spec`/`output_spec`, see runtime.py) and keeps, per micro-batch, what
its backward needs: the input (a leaf that collects the input gradient) and
the output (the root of the graph). The last stage's output is its loss
divided by m, so that the gradients of a step are the mean over
micro-batches, the same division a single process does before each
`backward()` when it accumulates.

- F(j): forward, saving the graph; returns the output (detached) to send.
- B(j): autograd backward from the output, its output gradient given;
  returns the input gradient. Weight gradients accumulate into .grad.
- I(j): the same backward with the linear layers' weight gradients (plain
  and tensor-parallel) left in the WeightGradStore (split_backward.py,
  split_layers.py); W(j) computes them.

Bytes held are counted exactly: during F, a saved-tensor hook sees every
tensor autograd saves for backward and records its storage (once, and not
the parameters'); the output kept for backward counts too. After I, what W
still needs (X and dY of each linear) is held instead; after B or W,
nothing. `ActivationLedger` samples this after every action of a rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .gpt_stage import TensorSpec
from .split_backward import WeightGradStore
from .split_layers import split_weight_gradients

__all__ = ["ActivationLedger", "AutogradStage"]


def _storage_bytes(tensors: list[torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages of `tensors`, leaving out `exclude`."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class AutogradStage:
    """F, B, I and W of `module` (stage `index` of a pipeline of
    `num_stages`) over `num_microbatches` micro-batches. With `split_weights`
    its linear layers (nn.Linear, the LM head, the tensor-parallel ones) are
    first made split versions (in place, split_weight_gradients) so that I
    and W can run apart.

    Raises TypeError if the module lacks input_spec/output_spec.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        num_microbatches: int,
        *,
        split_weights: bool = False,
    ) -> None:
        for name in ("input_spec", "output_spec"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"pipeline stage {index}: {type(module).__name__} has no {name}(inputs) "
                    "method: a stage must say what it receives and sends (see GPTStage)"
                )
        self.module, self.index, self.num_stages = module, index, num_stages
        self.m = num_microbatches
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.store = WeightGradStore()
        if split_weights:
            split_weight_gradients(module, self.store)
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._graph: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._held: dict[int, int] = {}  # micro-batch -> bytes kept for its backward

    # -- what the stage sends and receives ------------------------------------
    def input_spec(self, inputs: TensorSpec) -> TensorSpec:
        return self.module.input_spec(inputs)

    def output_spec(self, inputs: TensorSpec) -> TensorSpec | None:
        return self.module.output_spec(inputs)

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        fn = getattr(self.module, "tied_parameters", None)
        return fn() if fn is not None else {}

    def activations(self) -> tuple[int, int, int]:
        """(micro-batches whose graph is alive: F ran, B or I not yet;
        micro-batches holding anything for backward: F ran, B or W not yet;
        the bytes those hold)."""
        return len(self._graph), len(self._held), sum(self._held.values())

    # -- the four computations ---------------------------------------------------
    def forward(self, j: int, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """F(j) on input `x` (a received buffer is used in place as the leaf);
        returns the output detached, or on the last stage the loss (not
        divided by m)."""
        if not self.is_first:
            x = x.detach().requires_grad_(True)
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.store.microbatch(j):
            out = self.module(x, targets) if self.is_last else self.module(x)
        root = out / self.m if self.is_last else out
        self._graph[j] = (None if self.is_first else x, root)
        self._held[j] = _storage_bytes([*saved, root], self._params)
        return out.detach()

    def _backward(self, j: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        x, root = self._graph.pop(j)
        torch.autograd.backward(root, None if self.is_last else dy)
        return None if x is None else x.grad

    def backward(self, j: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        """B(j): every gradient; returns the input gradient (None on the first
        stage). With split linears, I and W back to back."""
        dx = self._backward(j, dy)
        self.store.backward_weight(j)  # nothing left there without split linears
        self._held.pop(j, None)
        return dx

    def backward_input(self, j: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        """I(j): the input gradient (returned) and the gradients of
        everything but the split linear layers' weights and biases."""
        dx = self._backward(j, dy)
        self._held[j] = _storage_bytes(self.store.held(j), self._params)
        return dx

    def backward_weight(self, j: int) -> None:
        """W(j): the split layers' weight and bias gradients."""
        self.store.backward_weight(j)
        self._held.pop(j, None)


@dataclass
class ActivationLedger:
    """Peaks of what one rank's stages hold, sampled after every action from
    the stages' own state (`activations()`), not from the schedule:

    - in_flight: micro-batches (of any of the rank's stages) whose graph is
      alive, i.e. whose F ran and whose B or I has not (what 1F1B bounds);
    - held: micro-batches keeping anything for their backward, i.e. whose F
      ran and whose B or W has not (simulate.peak_activations' count);
    - bytes: what those keep (saved tensors, outputs, W's inputs).
    """

    in_flight: int = 0
    held: int = 0
    bytes: int = 0
    peak_in_flight: int = 0
    peak_held: int = 0
    peak_bytes: int = 0

    def sample(self, stages: Iterable) -> None:
        counts = [st.activations() for st in stages]
        self.in_flight, self.held, self.bytes = (sum(c) for c in zip(*counts, strict=True))
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_held = max(self.peak_held, self.held)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
