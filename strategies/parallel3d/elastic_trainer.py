"""Data-parallel training of the GPT that goes on when ranks die
(`examples/train_gpt.py --survive`, with or without --zero/--fsdp;
docs/recovery.md).

`ElasticTrainer` trains the same model on the same global batches as
Trainer3D with dp = world size, tp = pp = 1 (AdamW, strategies.data's
per-epoch sample order, walked by an ElasticSampler) through one of the
elastic data-parallel wrappers: ElasticDataParallel (zero=0, fsdp off),
ElasticZero (zero=1..3) or ElasticFSDP (fsdp), the last two with buddy copies
of the shard state refreshed every `copy_every` steps. The step in which a
rank dies is dropped on every survivor alike, the communicator shrinks to the
survivors (the sharded state rebuilt from the copies and re-sharded over
them, every survivor rolled back to the copy's step: the failed step with
copy_every=1), and training goes on with each step's global batch re-split
over the survivors (contiguous shares, uneven when the batch does not divide;
each share's loss weighted by its samples, so the gradient is the global
batch's mean whatever the split; the sampler rolled back with the copy).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pycollectives import Communicator, PyCollectivesError, ReduceOp

from ..data import ElasticSampler, SyntheticSequences
from ..data_parallel import ElasticDataParallel, ElasticFSDP, ElasticZero
from ..models.gpt import GPT, GPTConfig
from .trainer import TrainOptions

__all__ = ["ElasticStep", "ElasticTrainer", "Recovery"]


@dataclass(frozen=True)
class Recovery:
    """One recovery: the original ranks lost, the step they were lost in, how
    many ranks go on, the seconds of the agreement and of the whole recovery
    (shrink, rebuild, wrap), and the step training resumes at (`step` where
    the failed step is retried; the buddy copy's step with copy_every > 1)."""

    lost: tuple[int, ...]
    step: int
    world_size: int
    agree_s: float
    shrink_s: float
    resumes_at: int = -1  # -1: `step`

    def line(self) -> str:
        """The progress line, e.g. "rank 2 died at step 7: 3 ranks go on (...)"."""
        who = ", ".join(map(str, self.lost))
        back = self.step if self.resumes_at < 0 else self.resumes_at
        then = (
            "the step is retried" if back == self.step else f"back to step {back}, the buddy copy's"
        )
        return (f"rank{'s' if len(self.lost) > 1 else ''} {who} died at step {self.step}: "
                f"{self.world_size} rank{'s' if self.world_size > 1 else ''} go on "
                f"(agree {self.agree_s * 1e3:.1f} ms, shrink {self.shrink_s * 1e3:.1f} ms; "
                f"{then})")  # fmt: skip


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
    only: opts.zero 0 with DDP, 1-3 with ElasticZero, opts.fsdp with
    ElasticFSDP). `copy_every`: the buddy copies' refresh interval under
    ZeRO/FSDP (k: up to k - 1 completed steps are redone after a failure).
    `kills`: (original rank, step) pairs; that rank SIGKILLs itself in the
    backward of that step (for tests and demonstrations). `world_ranks`
    maps each rank of the current communicator to its original rank.

    Raises ValueError for a global batch the ranks do not divide, fewer than
    one micro-batch, a copy_every that is not an int >= 1, or zero and fsdp
    together."""

    def __init__(self, comm: Communicator, config: GPTConfig, opts: TrainOptions,
                 kills: tuple[tuple[int, int], ...] = (), *, copy_every: int = 1) -> None:  # fmt: skip
        if opts.global_batch < comm.world_size or opts.global_batch % comm.world_size:
            raise ValueError(f"--batch {opts.global_batch} is not divisible by the "
                             f"{comm.world_size} ranks")  # fmt: skip
        if opts.microbatches < 1:
            raise ValueError(f"--microbatches {opts.microbatches} must be >= 1")
        if opts.zero and opts.fsdp:
            raise ValueError(f"--zero {opts.zero} and --fsdp: choose one")
        self.config, self.opts = config, opts
        self.world_ranks = list(range(comm.world_size))
        self.model = GPT(config, dtype=opts.dtype)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        adamw: dict[str, Any] = dict(lr=opts.lr, betas=opts.betas, weight_decay=opts.weight_decay)
        self.sampler = ElasticSampler(opts.num_samples, global_batch_size=opts.global_batch,
                                      seed=opts.data_seed)  # fmt: skip
        self.optimizer: torch.optim.Optimizer | None = None
        self.elastic: ElasticDataParallel
        if opts.fsdp:
            self.mode = "ElasticFSDP"
            self.elastic = ElasticFSDP(self.model, torch.optim.AdamW, comm, copy_every=copy_every,
                                       sampler=self.sampler, **adamw)  # fmt: skip
        elif opts.zero:
            self.mode = f"ElasticZero stage {opts.zero}"
            self.elastic = ElasticZero(self.model, torch.optim.AdamW, comm, opts.zero,
                                       copy_every=copy_every, sampler=self.sampler, **adamw)  # fmt: skip
        else:
            self.mode = "ElasticDataParallel"
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **adamw)
            self.elastic = ElasticDataParallel(self.model, comm, sampler=self.sampler)
        self.data = SyntheticSequences(config.vocab_size, config.seq_len, opts.num_samples,
                                       seed=opts.data_seed)  # fmt: skip
        self._kill = min((s for r, s in kills if r == comm.rank), default=None)
        self._hook: Any = None
        self._arm()

    def _arm(self) -> None:
        """Registers this rank's kill, if any, on the current parameters (a
        recovery under ZeRO or FSDP may give the model new ones): a gradient
        hook of the first block's MLP, mid-backward (the later blocks'
        gradient communication is under way when this rank dies)."""
        if self._kill is None:
            return
        if self._hook is not None:
            self._hook.remove()

        def die(grad: torch.Tensor) -> torch.Tensor:
            if self.step_index == self._kill:
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        self._hook = self.model.blocks[0].mlp.fc.weight.register_hook(die)

    @property
    def step_index(self) -> int:
        """The next step to run (committed steps; rolled back by a recovery
        to the buddy copy's step under ZeRO/FSDP)."""
        return self.elastic.steps

    @property
    def comm(self) -> Communicator:
        """The current communicator (of the survivors, after a recovery)."""
        return self.elastic.comm

    @property
    def rank(self) -> int:
        return self.elastic.rank

    def _loss(self, model: Any, rank: int, size: int) -> torch.Tensor:
        """This rank's share of the step's global batch (the sampler's:
        contiguous, rank order), in micro-batches; returns the last one's
        loss for the wrapper to run backward (the others' backward ran here,
        unsynced). Each loss is weighted by its samples over the global batch
        times `size` (the wrappers divide the sum by `size`). A rank with no
        sample (more ranks than samples left in an epoch) runs one weighted 0."""
        ids = self.sampler.global_ids(size)
        b, mine = len(ids), self.sampler.ids(rank, size)
        x, y = self.data.batch(mine if len(mine) else ids[:1])
        # The same number of micro-batches on every rank (ZeRO-3 and FSDP gather
        # in each forward), none empty: at most the smallest share's samples.
        m = min(self.opts.microbatches, max(1, b // size))
        parts = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))
        unsynced = (
            self.elastic.zero.no_sync if isinstance(self.elastic, ElasticZero) else model.no_sync
        )
        self._sum = 0.0
        for j, (xj, yj) in enumerate(parts):
            loss = model(xj, yj) * (len(xj) * size / b if len(mine) else 0.0)
            self._sum += float(loss.detach()) / size
            if j == len(parts) - 1:
                return loss
            with unsynced():
                loss.backward()
        raise AssertionError("not reached")

    def _try(self) -> bool:
        if self.optimizer is not None:
            return self.elastic.step(self._loss, self.optimizer)
        return self.elastic.step(self._loss)  # type: ignore[call-arg]

    def step(self) -> ElasticStep:
        """Collective over the survivors: runs step `step_index` until a step
        commits (retried after each recovery, from the copy's step under
        ZeRO/FSDP with copy_every > 1), then returns it.

        Raises CommunicatorAborted on a rank fenced out, PyCollectivesError
        when the survivors cannot shrink, RuntimeError when a rank and its
        buddy were lost together (ZeRO/FSDP: the shard is gone)."""
        start, seen = time.perf_counter(), len(self.elastic.recoveries)
        while not self._try():
            self._arm()  # the step is retried (or an earlier one, from the copy)
        done = []
        for rec in self.elastic.recoveries[seen:]:
            old = self.world_ranks
            # `survivors`: each new rank's rank in the communicator of the failed
            # step, whatever number of shrinks (ranks lost during the recovery) it took.
            self.world_ranks = [old[p] for p in rec["survivors"]]
            lost = tuple(old[r] for r in rec["failed"])
            done.append(Recovery(lost, rec["step"], rec["world_size"], rec["agree_s"],
                                 rec["shrink_s"], rec["rolled_back_to"]))  # fmt: skip
        if done:
            self._arm()  # also after a recovery that followed the commit
        loss = torch.tensor([self._sum], dtype=torch.float64)
        try:
            self.comm.all_reduce(loss, ReduceOp.SUM)
        except PyCollectivesError:  # a rank died since the commit: the next step recovers
            loss.fill_(float("nan"))
        tokens = self.opts.global_batch * self.config.seq_len
        return ElasticStep(self.step_index - 1, float(loss[0]), tokens,
                           time.perf_counter() - start, done)  # fmt: skip

    def close(self) -> None:
        """Closes the current communicator (the original one was closed by
        the recovery, or is the caller's)."""
        self.comm.close()
