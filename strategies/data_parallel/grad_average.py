"""Data parallelism for a step whose gradients build up over many backwards
(a pipeline step: one backward per micro-batch and stage, ZB-H1's weight
gradients computed outside autograd, the tied weight summed at the end): the
gradients are averaged over the data-parallel communicator in buckets, each
bucket's all-reduce launched as soon as every gradient in it is final, so the
communication overlaps the rest of the step.

strategies.DDP decides at the end of each backward; here a gradient is final
when its post-accumulate hook has fired `accumulations` times (one per
micro-batch: the m-th backward through that parameter). Gradients that
arrive otherwise must be listed as `late` (`finish()` sends them after the
step): the tied weight's sum, and ZB-H1's split layers, whose weight
gradients W computes outside autograd while their hooks still fire in I
(torch runs a parameter's post-accumulate hooks even when the autograd
Function returned None for it). A parameter used twice per backward is
caught (RuntimeError in finish()). Buckets launch in one fixed order on every
rank (reverse parameter order, the late ones last), as DDP's do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pycollectives import Communicator, ReduceOp, Work
from pycollectives.bucketing import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, BucketSet

from .ddp import ranks_that_differ

__all__ = ["StepGradAverager"]


class StepGradAverager:
    """Averages the gradients of `named_params` over `comm` once per step.

    Args:
        named_params: (name, parameter) pairs, the same names, shapes and
            dtypes on every rank of `comm` (checked: ValueError on every rank).
        comm: the data-parallel communicator.
        accumulations: backwards per step through each parameter (the number
            of micro-batches); its gradient is final after that many.
        late: parameters whose gradient is final only after the step (the
            tied embedding/head weight); they go in the last buckets.
        overlap: False: every all-reduce waits for finish().

    Use: zero the .grad, run the step's backwards, then `finish()`.
    `early` counts the buckets of the last step whose all-reduce started
    before finish() (overlapping the step).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        comm: Communicator,
        *,
        accumulations: int,
        late: Iterable[nn.Parameter] = (),
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        overlap: bool = True,
    ) -> None:
        if accumulations < 1:
            raise ValueError(
                f"StepGradAverager: rank {comm.rank}: accumulations={accumulations} must be >= 1"
            )
        self.comm, self.accumulations, self.overlap = comm, accumulations, overlap
        late_ids = {id(p) for p in late}
        named = [(n, p) for n, p in named_params if p.requires_grad]
        _check_same(comm, named)
        early = [(n, p) for n, p in reversed(named) if id(p) not in late_ids]
        last = [(n, p) for n, p in reversed(named) if id(p) in late_ids]
        self.names = [n for n, _ in early + last]
        self.params = [p for _, p in early + last]
        device = self.params[0].device if self.params else torch.device("cpu")
        self._views: list[torch.Tensor] = []
        self._bucket_of: list[int] = []
        self._buffers: list[torch.Tensor] = []
        self._size: list[int] = []
        for group in (early, last):  # the late ones in buckets of their own
            if not group:
                continue
            bs = BucketSet(comm, [p for _, p in group], bucket_cap_mb=bucket_cap_mb,
                           first_bucket_cap_mb=first_bucket_cap_mb, device=device)  # fmt: skip
            base = len(self._buffers)
            self._views += [bs.view(i) for i in range(len(group))]
            self._bucket_of += [base + bs.bucket_of(i) for i in range(len(group))]
            self._buffers += [b.buffer for b in bs.buckets]
            self._size += [len(b.members) for b in bs.buckets]
        self.early = 0
        self._reset()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, p in enumerate(self.params)
            if id(p) not in late_ids
        ]

    def buffers(self) -> list[torch.Tensor]:
        """The buckets' buffers (the gradients' copies the all-reduces run on)."""
        return list(self._buffers)

    def _reset(self) -> None:
        self._count = [0] * len(self.params)
        self._sent = [False] * len(self.params)
        self._pending = list(self._size)
        self._works: list[Work | None] = [None] * len(self._size)
        self._next = 0
        self._early = 0
        self._overflow: list[str] = []

    def _hook(self, i: int):  # noqa: ANN202
        def hook(p: torch.Tensor) -> None:
            self._count[i] += 1
            if self._count[i] > self.accumulations and self._sent[i]:
                self._overflow.append(self.names[i])
            elif self._count[i] == self.accumulations:
                self._deposit(i)
                if self.overlap:
                    self._launch_ready()
                    self._early = self._next

        return hook

    def _deposit(self, i: int) -> None:
        g, view = self.params[i].grad, self._views[i]
        if g is None:
            view.zero_()
        else:
            view.copy_(g)
        self._sent[i] = True
        self._pending[self._bucket_of[i]] -= 1

    def _launch_ready(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            buf = self._buffers[self._next]
            self._works[self._next] = self.comm.all_reduce(buf, ReduceOp.AVG, async_op=True)
            self._next += 1

    def finish(self) -> None:
        """Collective: sends the gradients not yet sent, waits for every
        bucket and writes the averages into .grad (None becomes the average
        of the others' and zeros).

        Raises RuntimeError (after the communication, on every rank alike
        when the ranks run the same model) when a parameter got more than
        `accumulations` gradients after its bucket had been sent.
        """
        self.early = self._early
        try:
            for i in range(len(self.params)):
                if not self._sent[i]:
                    self._deposit(i)
            self._launch_ready()
            for w in self._works:
                if w is not None:
                    w.wait()
            for i, p in enumerate(self.params):
                view = self._views[i]
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
            if self._overflow:
                raise RuntimeError(
                    f"StepGradAverager: rank {self.comm.rank}: parameters {self._overflow} got "
                    f"more than accumulations={self.accumulations} gradients in one step, after "
                    "their bucket was sent; list them as `late`"
                )
        finally:
            self._reset()

    def remove(self) -> None:
        """Removes the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _check_same(comm: Communicator, named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """ValueError on every rank unless every rank passes the same names, shapes, dtypes."""
    h = hashlib.sha256()
    for n, p in named:
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
    signature = int.from_bytes(h.digest()[:8], "little") >> 1
    differ, counts = ranks_that_differ(comm, len(named), signature)
    if differ:
        raise ValueError(
            f"StepGradAverager: rank {comm.rank}: ranks {differ} average other parameters "
            f"(counts {counts}) than rank 0: every rank of the data-parallel "
            "group must hold the same parameter names, shapes and dtypes"
        )
