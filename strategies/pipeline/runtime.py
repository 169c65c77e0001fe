"""`PipelineRuntime`: runs a schedule's action lists on pycollectives.

Each rank walks `schedule.ops(rank)` (docs/pipeline.md, "The execution
model"): a batch of sends and receives is issued as one asynchronous
`batch_p2p` on the pipeline communicator, which runs it on its progress
thread while the rank computes; a compute waits only for the batch holding
its own receive; send buffers stay referenced until their batch is done (the
communicator keeps them too); every batch is waited for before the step
returns (batch_p2p progresses each message on its own, so a batch pairs with
its counterparts however the peer groups them). Stages on the same rank hand
tensors over without messages.

A stage is an nn.Module with `input_spec(inputs)` and `output_spec(inputs)`
(GPTStage), wrapped in an AutogradStage, or any object with the same
methods as AutogradStage (forward, backward, backward_input,
backward_weight, activations, input_spec, output_spec, tied_parameters),
such as the benchmark's fixed-duration stand-ins.

Nothing hangs on bad input; each case raises on every rank:

- at construction (one all-gather): a world size other than p, stages not
  those the rank holds, a schedule that fails `verify`, ranks holding other
  schedules (a digest of the action lists differs);
- at each step (one all-gather at the start): micro-batches whose number or
  shapes differ from the schedule's or another rank's; at the first step of
  a shape, the stages' specs are gathered and an output that is not what
  the next stage expects raises ValueError naming both stages and shapes;
- during the step: pycollectives' errors (a receive that does not match its
  send, see communications.py's message views; a timeout; a dead peer)
  abort the communicator, and each rank raises PipelineError naming its stage,
  micro-batch, step and the iteration; a rank whose own compute fails
  sends its neighbours the stop signal, so they fail too. After a
  PipelineError the communicator is aborted: create a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pycollectives import Communicator

from .actions import Action, Kind
from .autograd_stage import AutogradStage
from .communications import (
    MessageCodes,
    agree,
    digest,
    gather_specs,
    gather_tie_holders,
)
from .execution_model import Record, verify
from .gpt_stage import TensorSpec
from .rank_step import PipelineError, RankPlan, RankStep
from .schedule import Schedule
from .simulate import peak_activations

__all__ = ["PipelineError", "PipelineRuntime", "StepResult", "run_step"]

F, B, I_, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


@dataclass
class StepResult:
    """What one step did on this rank.

    - losses: per micro-batch, the last stage's loss (before the division by
      m) on the rank holding it, else None;
    - records: (rank, start, end, action) of every compute (from its start
      to its end) and every send and receive (from its batch's issue to when
      the rank saw it complete); perf_counter seconds, comparable across the
      processes of one host;
    - peak_in_flight, peak_held, peak_bytes: ActivationLedger's peaks.
    """

    iteration: int
    losses: list[float] | None
    records: list[Record]
    peak_in_flight: int
    peak_held: int
    peak_bytes: int


class PipelineRuntime:
    """Runs `schedule` on this rank of `comm` (the pipeline communicator:
    rank r runs `schedule.actions[r]`) with `stages`, the modules of
    `schedule.stages_of(comm.rank)` in that order. With I and W actions in
    the schedule, nn.Linear layers of module stages are made SplitLinear in
    place. `timeout` (seconds) bounds each communication (default: the
    communicator's). `device`: where received activations go, the device of
    the module stages' parameters (CPU without any); messages travel
    through the host (rank_step.py). `sum_tied=False`: the step leaves the
    tied parameters' gradients alone (`tie_holders` still says who holds
    each): the caller sums them, e.g. FSDP's, which are in its accumulation
    buffers, not in .grad.

    Collective; raises on every rank as the module docstring says.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Sequence[nn.Module | AutogradStage],
        comm: Communicator,
        *,
        timeout: float | None = None,
        sum_tied: bool = True,
    ) -> None:
        self.schedule, self.comm, self.timeout = schedule, comm, timeout
        self.sum_tied = sum_tied
        self.rank = rank = comm.rank
        self.iteration = 0
        params = [p for st in stages if isinstance(st, nn.Module) for p in st.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        self._specs: dict[str, dict[tuple[Kind, int], TensorSpec]] = {}
        name = f"PipelineRuntime({schedule.name or 'schedule'})"
        error = None
        try:
            self.stages = self._wrap(schedule, list(stages), comm)
            self.tied = self._tied(comm.rank)
            verify(schedule)
        except (ValueError, TypeError) as e:
            error = e
        shape = f"{schedule.p} {schedule.m} {schedule.v} {schedule.stage_to_rank}\n"
        agree(
            comm,
            name,
            error,
            digest(shape + schedule.to_csv()),
            "run another schedule (p, m, v, stage placement or action lists)",
            timeout,
        )
        self.ops = schedule.ops(rank)
        self.codes = MessageCodes(schedule, rank)
        self.peers = sorted({a.peer for a in schedule.actions[rank] if a.is_comm})
        self.predicted_held = peak_activations(schedule)[rank]
        self.tie_holders = gather_tie_holders(comm, self.tied, timeout)

    def _tied(self, rank: int) -> dict[str, nn.Parameter]:
        """The stages' tied parameters by name; ValueError if two stages of
        this rank hold different copies of one."""
        tied: dict[str, nn.Parameter] = {}
        for st in self.stages.values():
            for key, p in st.tied_parameters().items():
                if tied.setdefault(key, p) is not p:
                    raise ValueError(
                        f"PipelineRuntime: rank {rank}: two of its stages hold copies of {key}; "
                        "stages of one rank must share a tied parameter"
                    )
        return tied

    def _wrap(self, schedule: Schedule, stages: list, comm: Communicator) -> dict:
        """{stage index: executor}; raises ValueError/TypeError on bad input."""
        rank, where = comm.rank, f"PipelineRuntime: rank {comm.rank}"
        if comm.world_size != schedule.p:
            raise ValueError(
                f"{where}: the communicator has {comm.world_size} ranks, the schedule p={schedule.p}"
            )
        held = schedule.stages_of(rank)
        if len(stages) != len(held):
            raise ValueError(f"{where}: stages has {len(stages)} modules, the rank holds {held}")
        split = any(a.kind in (I_, W) for acts in schedule.actions for a in acts)
        out = {}
        for i, (s, st) in enumerate(zip(held, stages, strict=True)):
            index = getattr(st, "stage_index", getattr(st, "index", s))
            if index != s:
                raise ValueError(f"{where}: stages[{i}] is stage {index}, expected stage {s}")
            if isinstance(st, nn.Module):
                st = AutogradStage(st, s, schedule.num_stages, schedule.m, split_weights=split)
            out[s] = st
        return out

    # -- specs ------------------------------------------------------------------------
    def _check_microbatches(self, microbatches: Sequence[MicroBatch]) -> str:
        """A description of the micro-batches' specs; ValueError if bad."""
        where = f"pipeline: rank {self.rank}: microbatches"
        if len(microbatches) != self.schedule.m:
            raise ValueError(
                f"{where} has {len(microbatches)} entries, the schedule m={self.schedule.m}"
            )
        specs = set()
        for j, mb in enumerate(microbatches):
            if not (isinstance(mb, tuple | list) and len(mb) == 2):
                raise ValueError(f"{where}[{j}] is not an (inputs, targets) pair")
            specs.add(tuple(str(TensorSpec.of(t)) for t in mb))
        if len(specs) != 1:
            raise ValueError(f"{where}: micro-batches of different shapes {sorted(specs)}")
        return " ".join(specs.pop())

    def _stage_specs(self, inputs: TensorSpec) -> dict:
        return {s: (st.input_spec(inputs), st.output_spec(inputs)) for s, st in self.stages.items()}

    def _recv_specs(self, key: str, mine: dict | None) -> dict[tuple[Kind, int], TensorSpec]:
        """Gathers the stages' specs (collective), checks each boundary, and
        returns the spec of every receive this rank posts."""
        if key in self._specs:
            return self._specs[key]
        s2r = self.schedule.stage_to_rank
        table = gather_specs(self.comm, mine or {}, self.schedule, self.timeout)
        bad = []
        for s in range(self.schedule.num_stages - 1):
            out, nxt = table[s][1], table[s + 1][0]
            if out != nxt:
                bad.append(
                    f"stage {s} (rank {s2r[s]}) sends {out} but stage {s + 1} (rank {s2r[s + 1]}) "
                    f"expects {nxt}"
                )
        empty = [
            f"stage {s} sends {out}"
            for s, (_, out) in enumerate(table)
            if out and not all(out.shape)
        ]
        if empty:
            bad.append("; ".join(empty) + ": an empty activation cannot be a message")
        if bad:
            where = f"pipeline (raised on rank {self.rank})"
            raise ValueError(f"{where}: activation shapes disagree: " + "; ".join(bad))
        specs = {(Kind.RECV_F, s): table[s - 1][1] for s in range(1, len(table))}
        specs.update({(Kind.RECV_B, s): table[s][1] for s in range(len(table) - 1)})
        self._specs[key] = specs
        return specs

    # -- the step -------------------------------------------------------------------
    def step(self, microbatches: Sequence[MicroBatch]) -> StepResult:
        """Runs one step over `microbatches` (m pairs of (inputs, targets),
        the same on every rank: the first stage reads the inputs, the last
        the targets, every rank their shapes). Gradients accumulate into
        .grad (the mean over micro-batches); a tied weight gets the sum of
        its holders' gradients of the step.

        Collective; raises ValueError on every rank for bad micro-batches or
        disagreeing shapes, PipelineError when the step fails.
        """
        it, error, key, mine = self.iteration, None, "", None
        try:
            key = self._check_microbatches(microbatches)
            if key not in self._specs:
                mine = self._stage_specs(TensorSpec.of(microbatches[0][0]))
        except (ValueError, TypeError) as e:
            error = e
        agree(
            self.comm,
            f"pipeline iteration {it}",
            error,
            digest(key),
            "pass micro-batches of other shapes",
            self.timeout,
        )
        specs = self._recv_specs(key, mine)
        self.iteration += 1
        plan = RankPlan(
            schedule=self.schedule,
            comm=self.comm,
            rank=self.rank,
            stages=self.stages,
            ops=self.ops,
            codes=self.codes,
            peers=self.peers,
            tied=self.tied if self.sum_tied else {},
            tie_holders=self.tie_holders,
            predicted_held=self.predicted_held,
            device=self.device,
            timeout=self.timeout,
            issue=self._issue,
        )
        run = RankStep(plan, microbatches, specs, it)
        run.run()
        return StepResult(
            it,
            run.losses,
            run.records,
            run.ledger.peak_in_flight,
            run.ledger.peak_held,
            run.ledger.peak_bytes,
        )

    def _issue(self, actions: Sequence[Action], ops: list) -> object:
        """One batch on the progress thread (RankPlan.issue; the actions are
        for tests that plant faults)."""
        return self.comm.batch_p2p(ops, async_op=True, timeout=self.timeout)


def run_step(
    schedule: Schedule,
    stages: Sequence[nn.Module | AutogradStage],
    microbatches: Sequence[MicroBatch],
    comm: Communicator,
    **kwargs,
) -> StepResult:
    """One step of a new PipelineRuntime(schedule, stages, comm, **kwargs)."""
    return PipelineRuntime(schedule, stages, comm, **kwargs).step(microbatches)
