"""One step of one rank: `RankStep` walks the rank's ops in order
(docs/pipeline.md, "The execution model") with what its PipelineRuntime
fixed for every step (`RankPlan`: the schedule, the communicator, the
stages, how a batch is issued).

- A batch becomes one asynchronous `batch_p2p` (its messages under their
  dtype views, communications.py); each receive gets a fresh buffer of its
  spec, each send the output or input gradient it carries (kept referenced
  until the step ends; the communicator keeps it too).
- A compute waits only for the batch holding its receive (and the batches
  issued before it, which complete first anyway), then runs F, B, I or W of
  its stage; a neighbouring stage on the same rank hands its tensor over
  directly.
- Stages on a CUDA device (`RankPlan.device`): pycollectives'
  batch_p2p takes CPU buffers only, so a sent tensor is copied to the host
  first and a received one is moved to the device when its compute takes
  it (the tensor-parallel and data-parallel collectives of the stages take
  the CUDA tensors themselves).
- Then every batch is waited for, neighbours exchange end marks, tied
  weights' gradients are summed, and one all-gather confirms that every
  rank finished (and held no more activations than the schedule says), so
  that a step fails on all ranks or on none.

Any failure becomes a PipelineError naming the rank, the stage, the
micro-batch and the step it was at; a failure of this rank's own compute
first sends its neighbours the stop signal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pycollectives import Communicator, PyCollectivesError

from .actions import Action, Kind
from .autograd_stage import ActivationLedger
from .communications import (
    MessageCodes,
    agree,
    exchange_end_marks,
    stop_peers,
    sum_tied_gradients,
)
from .execution_model import Record
from .gpt_stage import TensorSpec
from .schedule import Op, Schedule

__all__ = ["PipelineError", "RankPlan", "RankStep"]

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT
MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank; `rank`, `stage`, `microbatch`,
    `step` (in the rank's action list), `action` and `iteration` say where
    (stage and micro-batch None past the last action). The cause is chained."""

    def __init__(self, message: str, *, rank: int, where: tuple, iteration: int) -> None:
        super().__init__(message)
        self.rank, self.iteration = rank, iteration
        self.step, self.action = where[0], where[1]
        self.stage = None if self.action is None else self.action.stage
        self.microbatch = None if self.action is None else self.action.microbatch


@dataclass(frozen=True)
class RankPlan:
    """What one rank of a PipelineRuntime runs at every step: `schedule`,
    `comm` (the pipeline communicator, of which this is rank `rank`), its
    `stages` by index (AutogradStage or alike), `ops` (schedule.ops(rank)),
    its message `codes`, the `peers` it exchanges with, the `tied`
    parameters whose gradients the step sums over their `tie_holders`
    (empty: none), `predicted_held` (the most micro-batches of activations
    the schedule lets it hold), the `device` of its stages, the `timeout`
    of each communication, and `issue(actions, ops)`, which posts one
    batch and returns its Work."""

    schedule: Schedule
    comm: Communicator
    rank: int
    stages: dict
    ops: list[Op]
    codes: MessageCodes
    peers: list[int]
    tied: dict[str, nn.Parameter]
    tie_holders: dict[str, list[int]]
    predicted_held: int
    device: torch.device
    timeout: float | None
    issue: Callable[[Sequence[Action], list], object]


class RankStep:
    """Step `it` of the rank of `plan` over `mbs` with receive specs `specs`
    (by (RECV_F or RECV_B, stage)): issued batches, received and local
    tensors, records, the activation ledger. `where` is (step, action, what
    the rank is doing), for errors."""

    def __init__(self, plan: RankPlan, mbs: Sequence[MicroBatch], specs: dict, it: int) -> None:
        self.plan, self.mbs, self.specs, self.it = plan, mbs, specs, it
        self.works: list = []  # (Work, Op, issue time, its ops: the buffers stay referenced)
        self.seen: list[float | None] = []  # when each work was seen complete
        self.waited = 0  # works[:waited] are waited for
        self.recv_work: dict[tuple[Kind, int, int], int] = {}
        self.inbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self.local: dict[tuple[Kind, int, int], torch.Tensor] = {}  # outputs, input gradients
        self.records: list[Record] = []
        self.ledger = ActivationLedger()
        last = plan.schedule.num_stages - 1
        self.losses: list[float] | None = [0.0] * len(mbs) if last in plan.stages else None
        self.where: tuple[int, Action | None, str] = (0, None, "")
        self.waiting_on: Op | None = None  # the batch being waited for
        self.collective = False  # in the final agreement

    def run(self) -> None:
        plan = self.plan
        # This step's gradient of a tied weight is summed over its holders;
        # what earlier steps accumulated (already summed) is added back after.
        tied = plan.tied
        before = {k: p.grad for k, p in tied.items() if len(plan.tie_holders[k]) > 1}
        for k in before:
            tied[k].grad = None
        try:
            for op in plan.ops:
                if op.is_batch:
                    self.where = (op.step, op.actions[0], "issuing its batch")
                    self.post(op)
                else:
                    self.compute(op)
                self.poll()
            end = len(plan.schedule.actions[plan.rank])
            self.where = (end, None, "waiting for its last batches")
            self.wait(len(self.works))
            self.where = (end, None, f"exchanging end marks with ranks {plan.peers}")
            exchange_end_marks(plan.comm, plan.peers, plan.timeout)
            self.where = (end, None, "summing the tied gradients")
            sum_tied_gradients(plan.comm, tied, plan.tie_holders, plan.timeout)
            for k, g in before.items():
                if g is not None:
                    tied[k].grad = g.add_(tied[k].grad)
            self.where = (end, None, "agreeing that every rank finished")
            self.collective = True  # no stop signal from here on: every rank raises alike
            leak = None
            if self.ledger.peak_held > plan.predicted_held:
                leak = RuntimeError(
                    f"rank {plan.rank} held {self.ledger.peak_held} micro-batches of activations, "
                    f"the schedule at most {plan.predicted_held}: a stage keeps them too long"
                )
            agree(plan.comm, f"pipeline iteration {self.it}", leak, timeout=plan.timeout)
        except KeyboardInterrupt:
            # Not the stop signal: a peer would report it as a failed step (or,
            # waiting for an end mark, as a send/recv mismatch). The abort says why.
            plan.comm.abort(f"rank {plan.comm.rank} was interrupted (SIGINT)")
            raise
        except Exception as e:
            raise self.fail(e) from e

    def fail(self, e: Exception) -> PipelineError:
        """The error of this rank for `e`, naming where it was."""
        plan = self.plan
        step, action, doing = self.where
        if not isinstance(e, PyCollectivesError) and not self.collective:
            stop_peers(plan.comm, plan.peers)
        place = (
            f"stage {action.stage}, micro-batch {action.microbatch}, step {step} ({action})"
            if action is not None
            else f"after its last action (step {step})"
        )
        if self.waiting_on is not None:
            batch = self.waiting_on
            doing += f" (its batch of step {batch.step}: {', '.join(map(str, batch.actions))})"
        why = plan.codes.explain(str(e))
        msg = (
            f"pipeline iteration {self.it} ({plan.schedule.name or 'schedule'}): rank {plan.rank}, "
            f"{place}, {doing}: {type(e).__name__}: {e}" + (f"\n  {why}" if why else "")
        )
        return PipelineError(msg, rank=plan.rank, where=(step, action), iteration=self.it)

    # -- communication --------------------------------------------------------------
    def post(self, op: Op) -> None:
        codes, ops = self.plan.codes, []
        for a in op.actions:
            key = (a.kind, a.stage, a.microbatch)
            if a.kind.is_send:
                data = self.local.pop((F if a.kind is Kind.SEND_F else B, a.stage, a.microbatch))
                data = data.cpu()  # a no-op on the CPU; batch_p2p takes host buffers
                ops.append(("send", codes.view(a, data), a.peer))
            else:
                spec = self.specs[(a.kind, a.stage)]
                self.inbox[key] = buf = torch.empty(spec.shape, dtype=spec.dtype)
                self.recv_work[key] = len(self.works)
                ops.append(("recv", codes.view(a, buf), a.peer))
        work = self.plan.issue(op.actions, ops)
        self.works.append((work, op, time.perf_counter(), ops))
        self.seen.append(None)

    def poll(self) -> None:
        """Stamps the batches found complete since the last look."""
        for k in range(self.waited, len(self.works)):
            if self.seen[k] is not None:
                continue
            if not self.works[k][0].is_completed():
                break
            self.seen[k] = time.perf_counter()

    def wait(self, upto: int) -> None:
        """Waits for works[:upto], in issue order (the first failure is the
        cause), and records their sends and receives."""
        rank = self.plan.rank
        for k in range(self.waited, upto):
            work, op, issued, _ = self.works[k]
            self.waiting_on = op
            work.wait()
            self.waiting_on = None
            done = self.seen[k] or time.perf_counter()
            self.records += [Record(rank, issued, done, a) for a in op.actions]
        self.waited = max(self.waited, upto)

    # -- compute -----------------------------------------------------------------------
    def _input(self, a: Action, recv: Kind, peer_stage: int, local: Kind) -> torch.Tensor:
        """The received or locally handed-over input of compute `a`."""
        plan = self.plan
        if plan.schedule.rank_of(peer_stage) == plan.rank:
            return self.local.pop((local, peer_stage, a.microbatch))
        key = (recv, a.stage, a.microbatch)
        self.wait(self.recv_work.pop(key) + 1)
        return self.inbox.pop(key).to(plan.device)  # a no-op on the CPU

    def compute(self, op: Op) -> None:
        plan, a = self.plan, op.actions[0]
        s, j, st = a.stage, a.microbatch, plan.stages[a.stage]
        last = s == plan.schedule.num_stages - 1
        self.where = (op.step, a, "waiting for its input")
        if a.kind is F:
            x = self.mbs[j][0] if s == 0 else self._input(a, Kind.RECV_F, s - 1, F)
        elif a.kind is not W and not last:
            dy = self._input(a, Kind.RECV_B, s + 1, B)
        self.where = (op.step, a, "computing")
        start = time.perf_counter()
        if a.kind is F:
            y = st.forward(j, x, self.mbs[j][1] if last else None)
            if last:
                self.losses[j] = float(y)
            else:
                want = self.specs[(Kind.RECV_B, s)]  # the output spec the stage declared
                if TensorSpec.of(y) != want:
                    raise ValueError(f"stage {s} output is {TensorSpec.of(y)}, it declared {want}")
                self.local[(F, s, j)] = y
        elif a.kind is W:
            st.backward_weight(j)
        else:
            fn = st.backward if a.kind is B else st.backward_input
            dx = fn(j, None if last else dy)
            if s > 0:
                self.local[(B, s, j)] = dx.contiguous()
        self.records.append(Record(plan.rank, start, time.perf_counter(), a))
        self.ledger.sample(plan.stages.values())
