"""The communications of tensor and sequence parallelism, as named autograd
functions over a tensor-parallel communicator (`ParallelDims.tp_comm`).

Regions, as Megatron names them: an activation is *replicated* (every tp rank
holds all of it), *parallel* (each rank holds a slice of the features: heads,
MLP columns, vocabulary), *partial* (each rank holds a summand) or, with
sequence parallelism, *sharded* (each rank holds a slice of the sequence).
Each function moves a tensor between two regions; its backward moves the
gradient back:

    function                                    region              forward          backward
    copy_to_tp_region                           replicated->parallel identity        all-reduce
    reduce_from_tp_region                       partial->replicated all-reduce       identity
    gather_from_tp_region                       parallel->replicated all-gather      split
    scatter_to_tp_region                        replicated->parallel split           all-gather
    gather_from_sequence_parallel_region        sharded->replicated all-gather       reduce-scatter
    reduce_scatter_to_sequence_parallel_region  partial->sharded    reduce-scatter   all-gather
    scatter_to_sequence_parallel_region         replicated->sharded split            all-gather

column_parallel_linear fuses the first (or, sequence parallel, the fifth)
with a linear layer, so that its backward can overlap the input gradient's
all-reduce (reduce-scatter) with the weight gradient's computation.

On one rank every function is the identity (no copy, no autograd node), so
tp = 1 computes exactly what the plain model does. Every collective leaves the
same bits on every rank, so replicated tensors stay bitwise identical.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.autograd.function import once_differentiable

from pycollectives import Communicator, Work

__all__ = [
    "column_parallel_linear",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
]


# -- the collectives on tensors (new outputs; inputs are never written) -------------
def _chunks(x: torch.Tensor, comm: Communicator, dim: int, what: str) -> int:
    """The size of one rank's slice of `x` along `dim`; ValueError if it does not divide."""
    size, n = x.shape[dim], comm.world_size
    if size % n:
        raise ValueError(
            f"tensor parallel: rank {comm.rank}: {what}: dimension {dim} of a {tuple(x.shape)} "
            f"tensor ({size}) is not divisible by tp={n}"
        )
    return size // n


def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


def _gather_start(
    x: torch.Tensor, comm: Communicator, *, async_op: bool = False
) -> tuple[torch.Tensor, Work | None]:
    """Starts gathering the ranks' `x` into a [tp, *x.shape] tensor (filled once
    the returned Work, if any, completes)."""
    x = x.contiguous()
    out = x.new_empty((comm.world_size, *x.shape))
    return out, comm.all_gather(out, x, async_op=async_op)


def _gather_finish(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The gathered blocks concatenated along `dim`: a view for dim 0, else one copy."""
    return blocks.movedim(0, dim).flatten(dim, dim + 1)


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Concatenates the ranks' `x` along `dim`, in rank order."""
    return _gather_finish(_gather_start(x, comm)[0], dim)


def _reduce_scatter(
    x: torch.Tensor, comm: Communicator, dim: int, *, async_op: bool = False
) -> tuple[torch.Tensor, Work | None]:
    """Sums `x` over the ranks and leaves rank r the r-th slice along `dim`
    (being filled until the returned Work, if any, completes)."""
    n = comm.world_size
    blocks = x.unflatten(dim, (n, _chunks(x, comm, dim, "reduce_scatter"))).movedim(dim, 0)
    blocks = blocks.contiguous()  # no copy for dim 0 of a contiguous x
    out = x.new_empty(blocks.shape[1:])
    return out, comm.reduce_scatter(out, blocks, async_op=async_op)


def _split(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """This rank's slice of `x` along `dim` (a copy)."""
    size = _chunks(x, comm, dim, "split")
    return x.narrow(dim, comm.rank * size, size).contiguous()


# -- the regions ----------------------------------------------------------------------
class _CopyToTPRegion(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (sum) the gradient across tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) across tp; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    """Forward: all-gather along the last dimension; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split(grad, ctx.comm, grad.dim() - 1), None


class _ScatterToTPRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _split(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.comm, grad.dim() - 1), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the sequence; backward: reduce-scatter along it
    (the consumers are tensor-parallel, so each rank's gradient is a partial sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.comm, ctx.dim)[0], None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along the sequence; backward: all-gather along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.comm, ctx.dim), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence; backward: all-gather along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _split(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.comm, ctx.dim), None, None


class _ColumnParallelLinear(torch.autograd.Function):
    """Forward: y = x W^T + b on the replicated input (all-gathered along
    sequence_dim first with sequence parallelism); backward: dx all-reduced
    (reduce-scattered along sequence_dim) across tp, asynchronously, while dW
    and db are computed.

    With sequence parallelism only this rank's shard of x is kept for backward
    (1/tp of the activation memory, as Megatron does); backward all-gathers it
    again while it computes dx."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: Communicator,
        sequence_dim: int | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sequence_dim, ctx.has_bias = comm, sequence_dim, bias is not None
        total = x if sequence_dim is None else _all_gather(x, comm, sequence_dim)
        return F.linear(total, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        comm, dim = ctx.comm, ctx.sequence_dim
        dx = work = dw = db = None
        regather = dim is not None and ctx.needs_input_grad[1]
        if regather:  # the input, gathered on the progress thread while dx is computed
            blocks, gather = _gather_start(x, comm, async_op=True)
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight)  # partial: only this rank's output features
        if regather:
            gather.wait()
            x = _gather_finish(blocks, dim)
        if dx is not None:  # summed on the progress thread while dW is computed
            if dim is None:
                work = comm.all_reduce(dx, async_op=True)
            else:
                dx, work = _reduce_scatter(dx, comm, dim, async_op=True)
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if work is not None:
            work.wait()
        return dx, dw, db, None, None


# -- the functions to call --------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward; the gradient is summed across tp (x feeds tensor-parallel layers,
    or x is a replicated parameter applied to this rank's sequence shard)."""
    return x if comm.world_size == 1 else _CopyToTPRegion.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sums the ranks' partial `x` (all-reduce); the gradient passes unchanged."""
    return x if comm.world_size == 1 else _ReduceFromTPRegion.apply(x, comm)


def gather_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Concatenates the ranks' slices of the last dimension; the gradient is split back."""
    return x if comm.world_size == 1 else _GatherFromTPRegion.apply(x, comm)


def scatter_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's slice of the last dimension of a replicated `x`; the gradient is gathered.

    Raises ValueError when the last dimension is not divisible by tp."""
    return x if comm.world_size == 1 else _ScatterToTPRegion.apply(x, comm)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, comm: Communicator, dim: int = 1
) -> torch.Tensor:
    """Concatenates the ranks' sequence shards along `dim`; the gradient is reduce-scattered."""
    return x if comm.world_size == 1 else _GatherFromSequenceParallelRegion.apply(x, comm, dim)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, comm: Communicator, dim: int = 1
) -> torch.Tensor:
    """Sums the ranks' partial `x` and keeps this rank's slice along `dim`; the gradient
    is all-gathered. Raises ValueError when x.shape[dim] is not divisible by tp."""
    if comm.world_size == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, comm, dim)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, comm: Communicator, dim: int = 1
) -> torch.Tensor:
    """This rank's slice along `dim` of a replicated `x`; the gradient is all-gathered.

    Raises ValueError when x.shape[dim] is not divisible by tp."""
    return x if comm.world_size == 1 else _ScatterToSequenceParallelRegion.apply(x, comm, dim)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    comm: Communicator,
    *,
    sequence_dim: int | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for a weight holding this rank's slice of the output
    features, on an input replicated across tp (sequence_dim=None) or sharded
    along sequence_dim (sequence parallelism: all-gathered first).

    With overlap (the default) one fused function computes it, whose backward
    starts the all-reduce (reduce-scatter) of the input gradient on the
    progress thread and computes the weight gradient meanwhile (and keeps only
    the input's shard for backward). overlap=False composes copy_to_tp_region
    (or gather_from_sequence_parallel_region) with F.linear: autograd computes
    both gradients, then communicates; the results agree to rounding.
    """
    if comm.world_size == 1:
        return F.linear(x, weight, bias)
    if overlap:
        return _ColumnParallelLinear.apply(x, weight, bias, comm, sequence_dim)
    if sequence_dim is None:
        return F.linear(copy_to_tp_region(x, comm), weight, bias)
    return F.linear(gather_from_sequence_parallel_region(x, comm, sequence_dim), weight, bias)
