"""The sharding engine behind ZeRO (strategies/data_parallel/zero.py) and FSDP
(strategies/data_parallel/fsdp.py): flat parameters per unit, padded so every rank holds an
equal shard, gathered and reduce-scattered on pycollectives.

    flat_param.py      FlatLayout (the metadata a checkpoint needs), FlatParam (this rank's tensors)
    unit.py            ShardedUnit: one module's flat parameters, gather / free, its hooks
    engine.py          ShardingEngine: forward / backward orchestration, prefetch, order checks
    meter.py           EngineMeter: exposed communication, copies, all-gathers in flight
    gradients.py       GradReducer: gradients to averaged shards, no_sync
    clip.py            clip_grad_norm_ from the shards, bitwise as torch on the full gradients
    communications.py  the collectives as named functions; OrderGuard and ShardingMismatch
    checks.py          what every rank agrees on before communicating (clear errors, no hangs)
"""

from .communications import ShardingMismatch
from .engine import ShardingEngine
from .flat_param import FlatLayout, FlatParam, ParamSlot
from .meter import EngineMeter
from .unit import ShardedUnit

__all__ = [
    "EngineMeter",
    "FlatLayout",
    "FlatParam",
    "ParamSlot",
    "ShardedUnit",
    "ShardingEngine",
    "ShardingMismatch",
]
