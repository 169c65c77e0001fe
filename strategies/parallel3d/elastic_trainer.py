"""Data-parallel training of the GPT that goes on when ranks die
(`examples/train_gpt.py --survive`; docs/recovery.md).

`ElasticTrainer` trains the same model on the same global batches as
Trainer3D with dp = world size, tp = pp = 1 (AdamW, strategies.data's global
sample order), through ElasticDataParallel: the step in which a rank dies is
dropped on every survivor alike, the communicator shrinks to the survivors and
the step is retried with its global batch re-split over them (contiguous
shares, uneven when the batch does not divide; each share's loss weighted by
its samples, so the gradient is the global batch's mean whatever the split).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import torch

from pycollectives import Communicator, PyCollectivesError, ReduceOp

from ..data import GlobalBatches, SyntheticSequences
from ..data_parallel import ElasticDataParallel
from ..models.gpt import GPT, GPTConfig
from .trainer import TrainOptions

__all__ = ["ElasticStep", "ElasticTrainer", "Recovery"]


@dataclass(frozen=True)
class Recovery:
    """One recovery: the original ranks lost, the step they were lost in, how
    many ranks go on, and the seconds of the agreement and the shrink."""

    lost: tuple[int, ...]
    step: int
    world_size: int
    agree_s: float
    shrink_s: float

    def line(self) -> str:
        """The progress line, e.g. "rank 2 died at step 7: 3 ranks go on (...)"."""
        who = ", ".join(map(str, self.lost))
        return (f"rank{'s' if len(self.lost) > 1 else ''} {who} died at step {self.step}: "
                f"{self.world_size} rank{'s' if self.world_size > 1 else ''} go on "
                f"(agree {self.agree_s * 1e3:.1f} ms, shrink {self.shrink_s * 1e3:.1f} ms; "
                "the step is retried)")  # fmt: skip


@dataclass
class ElasticStep:
    """A committed step: its index, the global mean loss (nan when a rank
    died before it was summed), the global batch's tokens, this rank's wall
    time for the step (retries included) and the recoveries it went through."""

    step: int
    loss: float
    tokens: int
    seconds: float
    recoveries: list[Recovery] = field(default_factory=list)


class ElasticTrainer:
    """Trains `config` with `opts` on every rank of `comm` (data parallel
    only). `kills`: (original rank, step) pairs; that rank SIGKILLs itself in
    the backward of that step (for tests and demonstrations). `world_ranks`
    maps each rank of the current communicator to its original rank.

    Raises ValueError for options this trainer cannot survive with
    (tp/pp/ZeRO/FSDP are not its options: callers refuse them)."""

    def __init__(self, comm: Communicator, config: GPTConfig, opts: TrainOptions,
                 kills: tuple[tuple[int, int], ...] = ()) -> None:  # fmt: skip
        if opts.global_batch < comm.world_size or opts.global_batch % comm.world_size:
            raise ValueError(f"--batch {opts.global_batch} is not divisible by the "
                             f"{comm.world_size} ranks")  # fmt: skip
        if opts.microbatches < 1:
            raise ValueError(f"--microbatches {opts.microbatches} must be >= 1")
        self.config, self.opts = config, opts
        self.world_ranks = list(range(comm.world_size))
        self.model = GPT(config, dtype=opts.dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opts.lr,
                                           betas=opts.betas, weight_decay=opts.weight_decay)  # fmt: skip
        self.elastic = ElasticDataParallel(self.model, comm)
        self.data = SyntheticSequences(config.vocab_size, config.seq_len, opts.num_samples,
                                       seed=opts.data_seed)  # fmt: skip
        self.batches = GlobalBatches(opts.num_samples, opts.global_batch, seed=opts.data_seed)
        self.step_index = 0
        mine = sorted(step for rank, step in kills if rank == comm.rank)
        if mine:
            # The embedding's gradient is the backward's last: the other
            # buckets' all-reduces have started when this rank dies.
            def die(grad: torch.Tensor) -> torch.Tensor:
                if self.step_index == mine[0]:
                    os.kill(os.getpid(), signal.SIGKILL)
                return grad

            self.model.embed.tok.weight.register_hook(die)

    @property
    def comm(self) -> Communicator:
        """The current communicator (of the survivors, after a recovery)."""
        return self.elastic.comm

    @property
    def rank(self) -> int:
        return self.elastic.rank

    def _loss(self, ddp: torch.nn.Module, rank: int, size: int) -> torch.Tensor:
        """This rank's share of the step's global batch (contiguous, rank
        order), in micro-batches; returns the last one's loss for
        ElasticDataParallel to run backward (the others' backward ran here,
        unsynced). Each loss is weighted by its samples over the global batch
        times `size` (DDP divides the sum by `size`)."""
        ids = self.batches.global_ids(self.step_index)
        b = len(ids)
        x, y = self.data.batch(ids[rank * b // size : (rank + 1) * b // size])
        parts = list(zip(x.chunk(self.opts.microbatches), y.chunk(self.opts.microbatches),
                         strict=True))  # fmt: skip
        self._sum = 0.0
        for j, (xj, yj) in enumerate(parts):
            loss = ddp(xj, yj) * (len(xj) * size / b)
            self._sum += float(loss.detach()) / size
            if j == len(parts) - 1:
                return loss
            with ddp.no_sync():
                loss.backward()
        raise AssertionError("not reached")

    def step(self) -> ElasticStep:
        """Collective over the survivors: runs step `step_index` until it
        commits (retried after each recovery), then increments `step_index`.

        Raises CommunicatorAborted on a rank fenced out, PyCollectivesError
        when the survivors cannot shrink."""
        start, k, seen = time.perf_counter(), self.step_index, len(self.elastic.recoveries)
        done: list[Recovery] = []
        while not self.elastic.step(self._loss, self.optimizer):
            rec = self.elastic.recoveries[seen + len(done)]
            old = self.world_ranks
            self.world_ranks = [old[p] for p in self.comm.parent_ranks]
            lost = tuple(old[r] for r in rec["failed"])
            done.append(Recovery(lost, k, rec["world_size"], rec["agree_s"], rec["shrink_s"]))
        loss = torch.tensor([self._sum], dtype=torch.float64)
        try:
            self.comm.all_reduce(loss, ReduceOp.SUM)
        except PyCollectivesError:  # a rank died since the commit: the next step recovers
            loss.fill_(float("nan"))
        self.step_index += 1
        tokens = self.opts.global_batch * self.config.seq_len
        return ElasticStep(k, float(loss[0]), tokens, time.perf_counter() - start, done)

    def close(self) -> None:
        """Closes the current communicator (the original one was closed by
        the recovery, or is the caller's)."""
        self.comm.close()
