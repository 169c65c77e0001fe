"""FSDP on the data-parallel axis of a pipeline (Trainer3D with --fsdp and
--pp > 1), as torchtitan composes FSDP with PP:

- each stage a rank holds is sharded on its own over the dp communicator:
  its transformer blocks, then the stage as the root (embeddings, final
  norm, the head), with reshard_after_forward=False and
  set_reshard_after_backward(False): a unit gathered for the step's first
  forward stays gathered through every micro-batch's forward and backward
  until the reduction after the step frees it (one all-gather per unit and
  step, holding the stage's unsharded parameters through the step);
- every backward of the step runs without gradient sync (no_sync): the
  unsharded gradients accumulate in the sharding engine's buffers;
- after the step, the tied embedding/head gradient is summed across the
  first and the last stage (in those buffers: under FSDP the parameters'
  .grad are released after each backward), then every stage's units
  reduce-scatter (ShardingEngine.reduce_accumulated), and AdamW steps the
  shards.

torchtitan syncs in the last micro-batch's backward instead; here the last
stage's last backward comes before the first stage's, and the tied sum needs
both, so the reduction waits for the step's end (the same bytes; the
reduce-scatters no longer overlap the last backward). ZB-H1 is not
supported: its W computes weight gradients outside autograd, where the
engine's hooks do not see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pycollectives import Communicator

from ..data_parallel.fsdp import fully_shard
from ..models.gpt import Block
from ..pipeline import PipelineRuntime
from ..pipeline.communications import sum_tied_gradients
from ..pipeline.gpt_stage import TIED

__all__ = ["reduce_after_step", "shard_stages", "unsynced"]


def shard_stages(stages: Sequence[nn.Module], dp: Communicator) -> list[nn.Module]:
    """fully_shard over `dp`: each stage's blocks, then the stage (its root),
    every unit with reshard_after_forward=False, the roots with
    set_reshard_after_backward(False); the engines built now.
    Returns the stages (now FSDP modules). Collective over `dp`; raises as
    fully_shard does."""
    roots = []
    for st in stages:
        for b in st.blocks:
            if isinstance(b, Block):
                fully_shard(b, dp, reshard_after_forward=False)
        root = fully_shard(st, dp, reshard_after_forward=False)
        root.set_reshard_after_backward(False)
        root.sharding_unit.lazy_engine(root.sharding_unit)  # the engine now, not at forward
        roots.append(root)
    return roots


@contextlib.contextmanager
def unsynced(roots: Sequence[nn.Module]) -> Iterator[None]:
    """Every backward inside accumulates without communicating (no_sync on each root)."""
    with contextlib.ExitStack() as stack:
        for root in roots:
            stack.enter_context(root.no_sync())
        yield


class _Grad:
    """A stand-in parameter for sum_tied_gradients: the accumulated gradient."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def reduce_after_step(roots: Sequence[nn.Module], runtime: PipelineRuntime) -> None:
    """After an unsynced pipeline step: sums the tied weight's accumulated
    gradient over the stages holding it (runtime.comm, in rank order, as the
    runtime sums .grad), then reduce-scatters every root's units over dp.
    Collective over the pipeline and the dp communicators."""
    held = {}
    for root in roots:
        unit = root.sharding_unit
        for name, g in unit.engine.accumulated(unit).items():
            if name in ("embed.tok.weight", "head.weight") and TIED in runtime.tied:
                held[TIED] = g
    if held:
        tied = {k: _Grad(g) for k, g in held.items()}
        sum_tied_gradients(runtime.comm, tied, runtime.tie_holders, runtime.timeout)
        for k, g in held.items():
            g.copy_(tied[k].grad)
    for root in roots:
        root.sharding_unit.engine.reduce_accumulated()
