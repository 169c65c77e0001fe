"""Data parallelism: every rank of a data-parallel communicator trains the same
model on its share of the batch, and the ranks keep it in step.

    ddp.py           DistributedDataParallel (torch DDP): bucketed gradient all-reduces in backward
    elastic.py       ElasticDataParallel: DDP that drops the step a rank died in and goes on shrunk
    redundancy.py    BuddyCopy: each rank's shard state copied to its buddy's host memory
    buddies.py       where the buddies go: rank + 1 on one host, another host across hosts
    state_layout.py  the packed layout of a rank's state, its codec and checked exchange
    elastic_sharded.py  ElasticZero: ZeRO that rebuilds a lost rank's shards and re-shards
    elastic_fsdp.py  ElasticFSDP: fully_shard with buddy copies, sharded again on the survivors
    hybrid.py        HybridZero (HSDP: ZeRO within groups, replicated across) and ElasticHSDP
    grad_average.py  StepGradAverager: DDP's buckets for a driver with many backwards per step
                     (the pipeline's micro-batches, gradients computed outside autograd)
    zero.py          ZeroOptimizer (DeepSpeed ZeRO stages 1-3) on the sharding engine
    fsdp.py          fully_shard (torch FSDP2) on the sharding engine
    sharding/        the sharding engine: flat parameters, gather / reduce-scatter, prefetch

Imports go down only: ddp <- grad_average, elastic; sharding <- zero, fsdp;
ddp <- elastic <- elastic_sharded <- hybrid, elastic_fsdp; zero <- redundancy <- elastic_sharded;
buddies, state_layout <- redundancy; fsdp <- elastic_fsdp.
"""

from .ddp import CompressionHook, DistributedDataParallel
from .elastic import ElasticDataParallel
from .elastic_fsdp import ElasticFSDP
from .elastic_sharded import ElasticZero
from .fsdp import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_, fully_shard, fully_unshard
from .grad_average import StepGradAverager
from .hybrid import ElasticHSDP, HybridZero
from .zero import ZeroOptimizer

__all__ = [
    "CompressionHook",
    "DistributedDataParallel",
    "ElasticDataParallel",
    "ElasticFSDP",
    "ElasticHSDP",
    "ElasticZero",
    "FSDPModule",
    "HybridZero",
    "MixedPrecisionPolicy",
    "StepGradAverager",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "fully_shard",
    "fully_unshard",
]
