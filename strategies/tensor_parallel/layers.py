"""Tensor-parallel layers (Megatron-style) on a tensor-parallel communicator,
with optional sequence parallelism, and the vocab-parallel cross-entropy.

- ColumnParallelLinear: the weight's rows (output features) split across tp;
  replicated (or sequence-sharded) input, parallel output.
- RowParallelLinear: the weight's columns (input features) split; parallel
  input, output partial sums reduced: all-reduce, or with sequence
  parallelism reduce-scatter along the sequence.
- VocabParallelEmbedding: the vocabulary split; each rank looks up its rows,
  the partial embeddings are reduced as RowParallelLinear's outputs are.
- vocab_parallel_cross_entropy: the loss of vocab-sharded logits with 3
  numbers per token across the ranks, never the logits.
- SequenceParallelLayerNorm / SequenceParallelDropout: on sequence shards.

Activations are [batch, sequence, features]; sequence parallelism shards
dimension 1 (SEQUENCE_DIM). Each layer takes the tp communicator explicitly
(ParallelDims.tp_comm); the communications are in communications.py.
Parameters are shards of a full layer's: `full=` (or from_linear /
from_embedding) takes this rank's shard of a given layer; without it, of the
layer torch builds under torch.manual_seed(seed), so the same seed gives the
same full weights for every tp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.autograd.function import once_differentiable

from pycollectives import Communicator, ReduceOp

from ..autograd_threads import autograd_comm
from .communications import (
    column_parallel_linear,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelDropout",
    "SequenceParallelLayerNorm",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]

SEQUENCE_DIM = 1  # activations are [batch, sequence, features]


def check_divisible(layer: str, what: str, size: int, comm: Communicator) -> int:
    """size // tp; ValueError naming the layer, the size and tp when it does not divide."""
    if size % comm.world_size:
        raise ValueError(
            f"{layer}: rank {comm.rank}: {what}={size} is not divisible by tp={comm.world_size} "
            "(uneven shards are not supported)"
        )
    return size // comm.world_size


def shard(full: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """This rank's contiguous slice (a copy) of `full` along `dim`."""
    n = full.shape[dim] // comm.world_size
    return full.detach().narrow(dim, comm.rank * n, n).clone()


def _seeded(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """factory() with torch's default generator seeded to `seed` (restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def _parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows split across tp: rank r holds rows
    [r * out/tp, (r+1) * out/tp) of W and b and computes that slice of y.

    Input replicated (or, with sequence_parallel, this rank's slice of the
    sequence: all-gathered first); output this rank's slice of the features,
    or with gather_output the whole y. overlap: the input gradient's
    all-reduce (reduce-scatter) runs while the weight gradient is computed.
    Raises ValueError when out_features is not divisible by tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        overlap: bool = True,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        full: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        check_divisible("ColumnParallelLinear", "out_features", out_features, comm)
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output and sequence_parallel exclude each other"
            )
        self.in_features, self.out_features = in_features, out_features
        self.comm = autograd_comm(comm)
        self.gather_output, self.sequence_parallel, self.overlap = (
            gather_output,
            sequence_parallel,
            overlap,
        )
        if full is None:
            full = _seeded(seed, lambda: nn.Linear(in_features, out_features, bias, dtype=dtype))
        self.weight = nn.Parameter(shard(full.weight, comm, 0))
        self.bias = _parameter(None if full.bias is None else shard(full.bias, comm, 0))

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator, **kw: Any) -> ColumnParallelLinear:
        """The tp shard of `linear` (which is left as it was)."""
        bias = linear.bias is not None
        return cls(linear.in_features, linear.out_features, comm, bias=bias, full=linear, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = SEQUENCE_DIM if self.sequence_parallel else None
        y = column_parallel_linear(
            x, self.weight, self.bias, self.comm, sequence_dim=dim, overlap=self.overlap
        )
        return gather_from_tp_region(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.weight.shape[0]} here), tp={self.comm.world_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns split across tp: rank r holds columns
    [r * in/tp, (r+1) * in/tp) and multiplies its slice of x's features; the
    partial products are summed across tp (all-reduce, or with
    sequence_parallel a reduce-scatter leaving this rank its slice of the
    sequence), then b (replicated) is added.

    input_is_parallel=False takes a replicated x and slices it first.
    Raises ValueError when in_features is not divisible by tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        full: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        check_divisible("RowParallelLinear", "in_features", in_features, comm)
        self.in_features, self.out_features = in_features, out_features
        self.comm = autograd_comm(comm)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        if full is None:
            full = _seeded(seed, lambda: nn.Linear(in_features, out_features, bias, dtype=dtype))
        self.weight = nn.Parameter(shard(full.weight, comm, 1))
        self.bias = _parameter(None if full.bias is None else full.bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator, **kw: Any) -> RowParallelLinear:
        """The tp shard of `linear` (which is left as it was)."""
        bias = linear.bias is not None
        return cls(linear.in_features, linear.out_features, comm, bias=bias, full=linear, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:  # the bias fused as nn.Linear fuses it: the same bits
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.comm)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.comm, SEQUENCE_DIM)
            # b meets only this rank's tokens: its gradient is summed across tp.
            return y if self.bias is None else y + copy_to_tp_region(self.bias, self.comm)
        y = reduce_from_tp_region(y, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.weight.shape[1]} here), "
            f"out_features={self.out_features}, tp={self.comm.world_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary split across tp: rank r holds rows
    [vocab_start, vocab_start + num_embeddings/tp). Each rank looks up the ids
    in its range (zeros elsewhere) and the ranks' outputs are summed: all-
    reduce, or with sequence_parallel a reduce-scatter along the sequence.

    forward raises ValueError for ids outside [0, num_embeddings) (on every
    rank: the ids are replicated). The constructor raises ValueError when
    num_embeddings is not divisible by tp (pad the vocabulary).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Communicator,
        *,
        sequence_parallel: bool = False,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        full: nn.Embedding | None = None,
    ) -> None:
        super().__init__()
        per_rank = check_divisible("VocabParallelEmbedding", "vocab size", num_embeddings, comm)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.comm = autograd_comm(comm)
        self.sequence_parallel = sequence_parallel
        self.vocab_start = comm.rank * per_rank
        if full is None:
            full = _seeded(seed, lambda: nn.Embedding(num_embeddings, embedding_dim, dtype=dtype))
        self.weight = nn.Parameter(shard(full.weight, comm, 0))

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, comm: Communicator, **kw: Any
    ) -> VocabParallelEmbedding:
        """The tp shard of `emb` (which is left as it was)."""
        return cls(emb.num_embeddings, emb.embedding_dim, comm, full=emb, **kw)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise ValueError(
                f"VocabParallelEmbedding: rank {self.comm.rank}: token ids in "
                f"[{idx.min().item()}, {idx.max().item()}] outside [0, {self.num_embeddings})"
            )
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.comm, SEQUENCE_DIM)
        return reduce_from_tp_region(out, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token cross-entropy of vocab-sharded logits, all-reducing the
    max, then (sum of exponentials, target logit), never the logits; backward:
    softmax minus one-hot on this rank's shard, no communication."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        comm: Communicator,
        vocab_start: int,
        ignore_index: int,
    ) -> torch.Tensor:
        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0)
        exp = shifted.exp_()
        stats = torch.stack([exp.sum(-1), target_logit])
        comm.all_reduce(stats)  # one call for both sums
        sum_exp, target_logit = stats.unbind(0)
        keep = targets != ignore_index
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, for backward
        ctx.save_for_backward(exp, local, mine, keep)
        return (sum_exp.log() - target_logit) * keep

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        softmax, local, mine, keep = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * keep).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    comm: Communicator,
    vocab_start: int,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(full_logits, targets, ignore_index=, reduction=) from this
    rank's slice of the logits' last dimension, columns [vocab_start,
    vocab_start + logits.shape[-1]), with 2 all-reduces of 1 and 2 numbers per
    token.

    logits: [..., vocab/tp] (float); targets: [...] int64, full vocabulary ids,
    the same on every tp rank; tokens whose target is ignore_index count 0 and
    are left out of the mean. reduction: "mean", "sum" or "none" (per-token
    losses, shaped as targets). The result is the same on every tp rank.
    Raises ValueError for another reduction.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}")
    if comm.world_size == 1:  # exactly F.cross_entropy
        loss = F.cross_entropy(
            logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction=reduction
        )
        return loss.view(targets.shape) if reduction == "none" else loss
    losses = _VocabParallelCrossEntropy.apply(logits, targets, comm, vocab_start, ignore_index)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / (targets != ignore_index).sum()


class SequenceParallelLayerNorm(nn.LayerNorm):
    """nn.LayerNorm on this rank's slice of the sequence; its (replicated)
    weight and bias see only this rank's tokens, so their gradients are summed
    across tp (copy_to_tp_region on the parameters)."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        comm: Communicator,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, dtype=dtype, device=device
        )
        self.comm = autograd_comm(comm)

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, comm: Communicator) -> SequenceParallelLayerNorm:
        """A copy of `ln` (same parameters' values, dtype and device) whose
        gradients are summed across tp."""
        m = cls(
            ln.normalized_shape,
            comm,
            eps=ln.eps,
            elementwise_affine=ln.elementwise_affine,
            bias=ln.bias is not None,
            dtype=None if ln.weight is None else ln.weight.dtype,
            device=None if ln.weight is None else ln.weight.device,
        )
        m.load_state_dict(ln.state_dict())
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_tp_region(self.weight, self.comm)
        b = None if self.bias is None else copy_to_tp_region(self.bias, self.comm)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelDropout(nn.Module):
    """Dropout on this rank's slice of the sequence, with the mask the
    unsharded dropout would draw: every tp rank draws the full mask from
    torch's generator (seeded alike on the tp ranks, so they stay in step)
    and keeps its slice. So sequence parallelism drops exactly what plain
    tensor parallelism and one process drop, at tp times the drawing."""

    def __init__(self, p: float, comm: Communicator) -> None:
        super().__init__()
        self.p, self.comm = p, autograd_comm(comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[SEQUENCE_DIM] *= self.comm.world_size
        scale = F.dropout(x.new_ones(shape), self.p)  # 0 or 1 / (1 - p)
        n = x.shape[SEQUENCE_DIM]
        return x * scale.narrow(SEQUENCE_DIM, self.comm.rank * n, n)
