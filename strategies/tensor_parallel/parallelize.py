"""Tensor (and sequence) parallelism applied to the reference GPT from outside,
as torchtitan's parallelize_llama does: the model is built whole (its
initial weights do not depend on the layout), then its layers are swapped for
tensor-parallel ones holding this rank's shard of the same weights.

Per block (Megatron's split): attention qkv column-parallel (whole heads per
rank), attention output row-parallel, MLP fc column-parallel and proj
row-parallel; layer norms replicated. The token embedding is vocab-parallel
and the tied output head multiplies by the same shard, giving vocab-sharded
logits whose loss is vocab_parallel_cross_entropy: the full logits are
never formed.

Communication per block: forward, an all-reduce after each row-parallel layer;
backward, an all-reduce of each column-parallel layer's input gradient
(overlapped with its weight gradient). With sequence parallelism each
all-reduce becomes an all-gather before the column-parallel layer and a
reduce-scatter after the row-parallel one (the same bytes), so the layer
norms, dropouts and residual adds run on 1/tp of the sequence; backward adds
a re-gather of each column-parallel input (kept sharded, as Megatron does, to
save activation memory) and small all-reduces of the replicated parameters'
gradients (layer norms, row-parallel biases), which see only this rank's tokens.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from pycollectives import Communicator

from ..autograd_threads import autograd_comm
from ..models.gpt import GPT, Block
from ..parallel_dims import ParallelDims
from .communications import (
    column_parallel_linear,
    gather_from_tp_region,
    scatter_to_sequence_parallel_region,
)
from .layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelDropout,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    check_divisible,
    shard,
    vocab_parallel_cross_entropy,
)

__all__ = ["ParallelEmbedding", "ParallelLMHead", "parallelize_gpt"]


class ParallelEmbedding(nn.Module):
    """The GPT's embedding with a vocab-parallel token table: returns the
    replicated [B, T, d] embeddings, or with sequence parallelism this rank's
    [B, T/tp, d] slice (the position embeddings sliced to match; their
    gradient is gathered back whole). Raises ValueError in forward when
    sequence parallelism gets a length not divisible by tp."""

    def __init__(
        self, tok: VocabParallelEmbedding, pos: nn.Embedding, drop: nn.Module, comm: Communicator
    ) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = tok, pos, drop
        self.comm = autograd_comm(comm)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = self.pos(torch.arange(t, device=idx.device))
        if self.tok.sequence_parallel:
            if t % self.comm.world_size:
                raise ValueError(
                    f"parallelize_gpt: rank {self.comm.rank}: sequence parallelism needs the "
                    f"sequence length ({t}) divisible by tp={self.comm.world_size}"
                )
            pos = scatter_to_sequence_parallel_region(pos, self.comm, 0)
        return self.drop(self.tok(idx) + pos)


class ParallelLMHead(nn.Module):
    """Final layer norm, then the output projection by this rank's vocabulary
    shard `weight` (column-parallel: its input is replicated, or gathered from
    sequence shards). With targets: the mean cross-entropy from the vocab-
    sharded logits (over the targets that are not -100), the same on every tp
    rank; without: the full logits (all-gathered, for evaluation and
    generation)."""

    def __init__(
        self,
        ln_f: nn.LayerNorm,
        weight: nn.Parameter,
        vocab_start: int,
        comm: Communicator,
        *,
        sequence_parallel: bool,
        overlap: bool,
    ) -> None:
        super().__init__()
        self.ln_f, self.weight, self.vocab_start = ln_f, weight, vocab_start
        self.comm = autograd_comm(comm)
        self.sequence_parallel, self.overlap = sequence_parallel, overlap

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        dim = SEQUENCE_DIM if self.sequence_parallel else None
        h = self.ln_f(x)
        logits = column_parallel_linear(
            h, self.weight, None, self.comm, sequence_dim=dim, overlap=self.overlap
        )
        if targets is None:
            return gather_from_tp_region(logits, self.comm)
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.comm, self.vocab_start
        )


def _check(model: nn.Module, tp: Communicator, options: str) -> None:
    """Raises the same ValueError on every tp rank for a model tp cannot split;
    first all-gathers a digest of each rank's config, parts and options, so
    that ranks given different models fail together too."""
    cfg = model.config
    parts = [p for p in ("embed", "blocks", "head") if getattr(model, p, None) is not None]
    text = f"{cfg}/{parts}/{len(getattr(model, 'blocks', ()))}/{options}"
    mine = torch.tensor([int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1])
    every = torch.empty(tp.world_size, dtype=torch.int64)
    tp.all_gather(every, mine)
    differ = [r for r in range(tp.world_size) if every[r] != every[0]]
    if differ:
        raise ValueError(
            f"parallelize_gpt: rank {tp.rank}: tp ranks {differ} parallelize another model "
            "(config, parts or options) than tp rank 0"
        )
    check_divisible("parallelize_gpt", "n_head", cfg.n_head, tp)
    check_divisible("parallelize_gpt", "vocab_size", cfg.vocab_size, tp)
    check_divisible("parallelize_gpt", "MLP hidden size", cfg.hidden, tp)
    if any(
        isinstance(m, (ParallelEmbedding, ParallelLMHead, ColumnParallelLinear))
        for m in model.modules()
    ):
        raise ValueError(f"parallelize_gpt: rank {tp.rank}: the model is already parallelized")


@torch.no_grad()
def parallelize_gpt(
    model: GPT, dims: ParallelDims, *, sequence_parallel: bool = False, overlap: bool = True
) -> GPT:
    """Makes `model` tensor-parallel over dims.tp_comm, in place, and returns it.

    Each rank keeps its shard of the model's current weights, so a model built
    from the same config (same seed) gathers back to the same full weights for
    every tp. The embedding, the blocks and the head are each parallelized
    where present: a pipeline stage may lack `embed` or `head` and replace
    the blocks it does not run with nn.Identity (which keeps the parameter
    names global). The embedding and the head stay tied. forward(idx, targets) then returns the same loss on
    every tp rank; forward(idx) the full logits.

    sequence_parallel: layer norms, dropouts and the residual stream on 1/tp
    of the sequence (sequence lengths must be divisible by tp); overlap: the
    column-parallel layers' input-gradient communication overlaps their
    weight-gradient computation. A pipeline stage (GPTStage) under sequence
    parallelism gets sequence_shards = tp: its hidden states in and out are
    [b, t/tp, d] sequence shards, sent between stages as they are. Dropout:
    seed torch's generator alike on the ranks of a tp group; the masks are
    then those of the unsharded model.

    Raises ValueError on every tp rank when n_head, vocab_size or the MLP
    hidden size is not divisible by tp, when the model is already
    parallelized, or when the tp ranks pass different models or options.
    """
    tp = dims.tp_comm
    _check(model, tp, f"sp={sequence_parallel}")
    sp = sequence_parallel

    def sp_norm(ln: nn.LayerNorm) -> nn.LayerNorm:
        return SequenceParallelLayerNorm.from_layer_norm(ln, tp) if sp else ln

    def sp_drop(drop: nn.Dropout) -> nn.Module:
        return SequenceParallelDropout(drop.p, tp) if sp else drop

    if hasattr(model, "sequence_shards"):  # a pipeline stage: it exchanges sequence shards
        model.sequence_shards = tp.world_size if sp else 1
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    tied = embed is not None and head is not None and head.weight is embed.tok.weight
    if embed is not None:
        tok = VocabParallelEmbedding.from_embedding(embed.tok, tp, sequence_parallel=sp)
        model.embed = ParallelEmbedding(tok, embed.pos, sp_drop(embed.drop), tp)
    for block in getattr(model, "blocks", ()):
        if not isinstance(block, Block):  # e.g. nn.Identity: another pipeline stage's block
            continue
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear.from_linear(
            attn.qkv, tp, sequence_parallel=sp, overlap=overlap
        )
        attn.proj = RowParallelLinear.from_linear(attn.proj, tp, sequence_parallel=sp)
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, tp, sequence_parallel=sp, overlap=overlap)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, tp, sequence_parallel=sp)
        block.ln1, block.ln2 = sp_norm(block.ln1), sp_norm(block.ln2)
        block.drop1, block.drop2 = sp_drop(block.drop1), sp_drop(block.drop2)
    if head is not None:
        per_rank = model.config.vocab_size // tp.world_size
        weight = model.embed.tok.weight if tied else nn.Parameter(shard(head.weight, tp, 0))
        model.head = ParallelLMHead(
            sp_norm(head.ln_f),
            weight,
            tp.rank * per_rank,
            tp,
            sequence_parallel=sp,
            overlap=overlap,
        )
    return model
