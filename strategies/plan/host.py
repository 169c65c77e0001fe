"""Hosts whose ranks outnumber their CPU cores (training on CPUs with more processes than
cores), and the CPU costs of a step that FLOPs alone miss.

When a host's ranks outnumber its cores, a rank idle in the pipeline's bubble, or waiting on
a collective, gives its core to another rank of the host: the bubble costs little, and the
step is bounded by the CPU work of all the host's ranks over its cores rather than by one
rank's critical path alone. layout.price then prices

    step = max(critical path, max over hosts of (sum over its ranks of busy CPU) / cores)
           + synchronizing collectives of the busiest rank x wait

- critical path: simulate() of the schedule with every rank at the rate of one core (the
  cluster's flops: the rate a rank has while the others idle), the exposed data-parallel
  communication and the optimizer's step, as on any cluster;
- busy CPU of a rank: its compute (FLOPs at that rate, plus `block_call_s` per block forward
  and backward: the per-operation costs of small layers), its collectives at their priced
  time (through shared memory the rank's own CPU copies and reduces the bytes) plus
  `sync_cpu_s` for each collective that waits for every member (sync_points: the call and
  the spinning and yielding of its wait), the optimizer's step (`optimizer_param_s` per
  parameter it steps) and its pipeline messages;
- wait: the wall time such a collective loses beyond that CPU when its members share cores
  with other ranks: it completes only once every member has reached it, and a member
  descheduled behind another rank's compute arrives late (`wait_s`).

`sync_cpu_s` and `wait_s` are measured on the host's ranks (local.collective_costs: a chunk
of compute with and without a small all-reduce after it).

The ranks of a host are devices_per_host consecutive ranks (tp fastest, then dp, then pp).
With as many cores as ranks per host, or no cores given (a GPU cluster: one rank per
device), nothing of this applies but the two per-call costs, 0 unless given: the step is
the critical path, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .units import PlanInputError

__all__ = ["HostCPU", "host_bound", "sync_points"]


@dataclass(frozen=True)
class HostCPU:
    """The CPU cores of a host and the CPU costs fitted on it (see the module docstring).

    cores: cores per host (0: not given, one per rank); block_call_s: CPU seconds of one
    block's forward and backward beyond its FLOPs; optimizer_param_s: CPU seconds of the
    optimizer's step per parameter; sync_cpu_s: CPU seconds a rank spends on each
    synchronizing collective where the ranks share cores (its calls, its waits' spinning
    and yielding), wait_s: the wall seconds each loses there beyond that CPU."""

    cores: int = 0
    block_call_s: float = 0.0
    optimizer_param_s: float = 0.0
    sync_cpu_s: float = 0.0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        costs = (self.block_call_s, self.optimizer_param_s, self.sync_cpu_s, self.wait_s)
        if self.cores < 0 or min(costs) < 0:
            raise PlanInputError(f"HostCPU: {self} has a negative entry")

    def shared(self, ranks_per_host: int) -> bool:
        """Whether `ranks_per_host` ranks outnumber the cores (cores given)."""
        return 0 < self.cores < ranks_per_host


def host_bound(busy: Sequence[float], per_host: int, cores: int) -> float:
    """Seconds the busiest host needs for its ranks' CPU work: `busy` per rank (seconds,
    rank order), `per_host` consecutive ranks on each host (the last may hold fewer), over
    min(cores, its ranks) cores. Raises PlanInputError for per_host or cores < 1."""
    if per_host < 1 or cores < 1:
        raise PlanInputError(f"host_bound: per_host={per_host} and cores={cores} must be >= 1")
    return max(
        (
            sum(busy[i : i + per_host]) / min(cores, len(busy[i : i + per_host]))
            for i in range(0, len(busy), per_host)
        ),
        default=0.0,
    )


def sync_points(
    *,
    dp: int,
    tp: int,
    pp: int,
    sharding: str,
    microbatches: int,
    blocks: int,
    stages: int,
    first: bool,
    last: bool,
) -> int:
    """Collectives of one training step on a rank (of Trainer3D) that complete only once
    every member of their group has reached them, for a rank holding `blocks` blocks in
    `stages` pipeline stages (the first / last stage among them):

    - tp > 1, per micro-batch: 4 per block (the two row-parallel outputs forward, the two
      column-parallel input gradients backward), 1 for the vocab-parallel embedding (first
      stage), 3 on the last stage (the loss's max and sums, the head's input gradient);
    - dp > 1: --zero 0 the bucketed all-reduces' wait (1); ZeRO-1 its reduce-scatter and
      all-gather (2); ZeRO-2 a reduce-scatter per unit (the blocks and the root) and the
      all-gather (units + 1); ZeRO-3 and FSDP with pp = 1 a gather per unit in each forward
      and backward and a reduce-scatter per unit (2 m units + units); FSDP with pp > 1 a
      gather and a reduce-scatter per unit (2 units);
    - pp > 1: the activation and the gradient a stage receives per micro-batch (2 m per
      stage) and the tied embedding's gradient sum (1);
    - the step's loss, summed over every rank (1)."""
    m, units = microbatches, blocks + 1
    n = 1
    if tp > 1:
        n += m * (4 * blocks + (1 if first else 0) + (3 if last else 0))
    if dp > 1:
        n += {
            "none": 1,
            "zero1": 2,
            "zero2": units + 1,
            "zero3": 2 * m * units + units,
            "fsdp": 2 * m * units + units if pp == 1 else 2 * units,
        }[sharding]
    if pp > 1:
        n += 2 * m * stages + 1
    return n
