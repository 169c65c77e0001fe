"""Tensor and sequence parallelism on pycollectives (Megatron's split, applied
from outside the model as torchtitan does):

- communications: the region functions (copy-to / reduce-from / gather-from /
  scatter-to the tensor-parallel region, and their sequence-parallel forms) as
  named autograd functions, and the column-parallel linear whose backward
  overlaps the input gradient's all-reduce with the weight gradient;
- layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, the
  vocab-parallel cross-entropy and the sequence-parallel layer norm and dropout;
- parallelize: parallelize_gpt, which swaps the reference GPT's layers for them.

    dims = ParallelDims(comm, dp=2, tp=2)
    model = parallelize_gpt(GPT(GPTConfig()), dims, sequence_parallel=True)
"""

from .layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelDropout,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from .parallelize import (
    ParallelEmbedding,
    ParallelLMHead,
    parallelize_gpt,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "ParallelLMHead",
    "RowParallelLinear",
    "SequenceParallelDropout",
    "SequenceParallelLayerNorm",
    "VocabParallelEmbedding",
    "parallelize_gpt",
    "vocab_parallel_cross_entropy",
]
