"""Trainer3D's data-parallel modes behind one interface (DataParallelMode), so
that the trainer's step reads straight through whatever the mode:

    mode.zero_grad()
    with mode.accumulating():  # the backwards that must not complete the reduction
        ...                    # the pipeline step, or every micro-batch but the last
    mode.finish()              # the reduction left, then the optimizer's step

A mode wraps the stages when it is built (collective over dims.dp_comm):

- AllReduce (--zero 0): StepGradAverager, the bucketed all-reduces launched
  while the step runs (it counts the micro-batches' backwards itself), AdamW;
- Zero (--zero 1, 2, 3): ZeroOptimizer; ZeRO-1 reduce-scatters after the
  pipeline step, ZeRO-2/3 (pp = 1) in the last micro-batch's backward;
- FSDPOneStage (--fsdp, pp = 1): fully_shard the blocks and the stage, the
  reduce-scatters in the last micro-batch's backward;
- FSDPPipeline (--fsdp, pp > 1): fsdp_pipeline.py, every backward of the
  pipeline step unsynced, the tied sum and the reduce-scatters after it.

For a copy of a rank's training state (parallel3d/replacement.py) a mode
names the tensors that hold the parameters' values this rank keeps
(`masters`: the parameters, or under ZeRO and FSDP the flat parameters'
master shards, sharded over dp where the mode shards them) and what must
follow writing into them (`restored`: ZeRO-1/2 all-gather the full
parameters from the shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..data_parallel.fsdp import FSDPModule, fully_shard
from ..data_parallel.grad_average import StepGradAverager
from ..data_parallel.zero import ZeroOptimizer
from ..models.gpt import Block
from ..parallel_dims import ParallelDims
from ..pipeline import PipelineRuntime
from .fsdp_pipeline import reduce_after_step, shard_stages, unsynced

__all__ = ["AllReduce", "DataParallelMode", "FSDPOneStage", "FSDPPipeline", "Zero", "build_mode"]

NamedParams = list[tuple[str, nn.Parameter]]


class DataParallelMode:
    """How Trainer3D keeps its dp replicas in step (see the module docstring).

    Attributes: `optimizer` (what a checkpoint saves), and what checkpoints,
    tests and benchmarks look into: `zero` (the ZeroOptimizer or None),
    `averager` (the StepGradAverager or None), `fsdp_roots` (the FSDP roots
    of a pipeline step, or empty).
    """

    optimizer: torch.optim.Optimizer
    zero: ZeroOptimizer | None = None
    averager: StepGradAverager | None = None

    def __init__(self, named: NamedParams) -> None:
        self.named = named
        self.fsdp_roots: list[nn.Module] = []

    def zero_grad(self) -> None:
        """Drops the previous step's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def accumulating(self) -> AbstractContextManager[Any]:
        """Backwards inside accumulate into this step's gradients without
        completing its reduction (a backward outside, or finish(), does)."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Collective over dp: what is left of the gradients' reduction, then
        the optimizer's step."""
        self.optimizer.step()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters by name, gathered over dp where the
        mode shards them (collective over dp then)."""
        return {n: p.detach() for n, p in self.named}

    def masters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what holds the values of this rank's parameters,
        in an order alike on every rank of its place: the parameters (their
        tensor-parallel shards). Local."""
        return [(n, p.detach()) for n, p in self.named]

    def restored(self) -> None:
        """Call on every rank of dp after writing values into masters() of a
        trainer that has not stepped yet: what makes the parameters show them.
        Here nothing."""


class AllReduce(DataParallelMode):
    """--zero 0: gradients averaged by a StepGradAverager (none with dp = 1)."""

    def __init__(self, named: NamedParams, dims: ParallelDims, late: list[nn.Parameter],
                 accumulations: int, overlap: bool, adamw: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(named)
        if dims.dp > 1:
            self.averager = StepGradAverager(
                named, dims.dp_comm, accumulations=accumulations, late=late, overlap=overlap
            )
        self.optimizer = torch.optim.AdamW([p for _, p in named], **adamw)

    def finish(self) -> None:
        if self.averager is not None:
            self.averager.finish()
        self.optimizer.step()


class Zero(DataParallelMode):
    """--zero 1, 2, 3: a ZeroOptimizer over the stages (one stage unless
    ZeRO-1), the blocks its units; ZeRO-1's gradients come from the pipeline
    step (external) and are reduce-scattered in finish()."""

    def __init__(self, named: NamedParams, model: nn.Module, blocks: list[nn.Module],
                 dims: ParallelDims, stage: int, adamw: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(named)
        self.zero = ZeroOptimizer(model, torch.optim.AdamW, dims.dp_comm, stage=stage,
                                  units=blocks, external_gradients=stage == 1, **adamw)  # fmt: skip
        self.optimizer = self.zero.optimizer

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def accumulating(self) -> AbstractContextManager[Any]:
        return self.zero.no_sync() if self.zero.stage > 1 else contextlib.nullcontext()

    def finish(self) -> None:
        if self.zero.stage == 1:
            self.zero.reduce_gradients()
        self.zero.step()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.zero.full_parameters() if self.zero.stage > 1 else super().full_parameters()

    def masters(self) -> list[tuple[str, torch.Tensor]]:
        """Each flat parameter's master shard (frozen ones included): this dp
        rank's 1/dp of its stages' tensor-parallel shards."""
        return [(f"{u.name}/flat{g}", f.shard)
                for u in self.zero.engine.units for g, f in enumerate(u.flats)]  # fmt: skip

    def restored(self) -> None:
        """Collective over dp: ZeRO-1/2 all-gather the full parameters from the shards."""
        self.zero.engine.shards_written()


class _FSDP(DataParallelMode):
    """--fsdp: the stages' full parameters gathered by their FSDP roots."""

    def __init__(self, named: NamedParams, stages: Sequence[nn.Module]) -> None:
        super().__init__(named)
        self.stages = stages

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: t for st in self.stages for n, t in st.full_parameters().items()}

    def masters(self) -> list[tuple[str, torch.Tensor]]:
        """Each unit's flat parameters' master shards (frozen ones included),
        the units in the stages' module order: this dp rank's 1/dp of its
        stages' tensor-parallel shards. (The parameters, as the optimizer
        sees them, are views of these pieces between steps.)"""
        out = []
        for i, st in enumerate(self.stages):
            for path, m in st.named_modules():
                if isinstance(m, FSDPModule):
                    for g, f in enumerate(m.sharding_unit.flats):
                        out.append((f"stage{i}.{path or '<root>'}/flat{g}", f.shard))
        return out


class FSDPOneStage(_FSDP):
    """--fsdp with pp = 1: fully_shard each block, then the stage (the root)."""

    def __init__(self, named: NamedParams, stages: Sequence[nn.Module], blocks: list[nn.Module],
                 dims: ParallelDims, adamw: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(named, stages)
        for b in blocks:
            fully_shard(b, dims.dp_comm)
        self.root = fully_shard(stages[0], dims.dp_comm)
        self.root.sharding_unit.lazy_engine(self.root.sharding_unit)  # the engine now
        self.optimizer = torch.optim.AdamW(self.root.parameters(), **adamw)

    def accumulating(self) -> AbstractContextManager[Any]:
        return self.root.no_sync()


class FSDPPipeline(_FSDP):
    """--fsdp with pp > 1: every stage sharded on its own (fsdp_pipeline.py)."""

    def __init__(self, named: NamedParams, stages: Sequence[nn.Module], runtime: PipelineRuntime,
                 dims: ParallelDims, adamw: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(named, stages)
        self.runtime = runtime
        self.fsdp_roots = shard_stages(stages, dims.dp_comm)
        params = [p for root in self.fsdp_roots for p in root.parameters()]
        self.optimizer = torch.optim.AdamW(params, **adamw)

    def accumulating(self) -> AbstractContextManager[Any]:
        return unsynced(self.fsdp_roots)

    def finish(self) -> None:
        reduce_after_step(self.fsdp_roots, self.runtime)
        self.optimizer.step()


def build_mode(
    dims: ParallelDims,
    stages: Sequence[nn.Module],
    named: NamedParams,
    late: list[nn.Parameter],
    runtime: PipelineRuntime | None,
    *,
    zero: int,
    fsdp: bool,
    microbatches: int,
    overlap: bool,
    adamw: dict[str, Any],
) -> DataParallelMode:
    """The mode of --zero `zero` / --fsdp over `stages` (runtime None: the
    one-stage modes that accumulate the micro-batches themselves, ZeRO-2/3
    and FSDP with pp = 1). Collective over dims.dp_comm; raises as
    ZeroOptimizer and fully_shard do."""
    blocks = [b for st in stages for b in st.blocks if isinstance(b, Block)]
    if fsdp and runtime is not None:
        return FSDPPipeline(named, stages, runtime, dims, adamw)
    if fsdp:
        return FSDPOneStage(named, stages, blocks, dims, adamw)
    if zero:
        model = stages[0] if runtime is None else nn.ModuleList(stages)
        return Zero(named, model, blocks, dims, zero, adamw)
    return AllReduce(named, dims, late, microbatches, overlap, adamw)
