"""Deterministic data for the strategies: a toy language whose loss falls, and
the global order of its samples, from which each data-parallel rank takes its
share.

Everything is a function of (seed, sample id) or (seed, step): no state, no
dependence on the parallel layout. Whatever dp x tp x pp trains, step k's
global batch is the same list of sample ids, each rank builds only the samples
it needs, and a run resumes at any step without replaying the ones before.

ElasticSampler walks the same per-epoch order with a cursor instead, for a
data-parallel size that changes mid-epoch (a rank lost, ElasticDataParallel):
the epoch's remaining samples are split over whoever is left, and its ledger
records which rank consumed which samples in each committed step.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

import torch

__all__ = ["ElasticSampler", "GlobalBatches", "LedgerEntry", "SyntheticSequences"]


def _generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from `key` alone (hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the samples (GlobalBatches, ElasticSampler)."""
    return torch.randperm(num_samples, generator=_generator(seed, epoch))


class SyntheticSequences:
    """Walks on a fixed sparse Markov chain over `vocab_size` tokens: each token
    is followed by one of `branching` successors (drawn once from the seed), so
    a model that learns the chain predicts the next token with loss
    log(branching) (`loss_floor`), against log(vocab_size) at the start.

    Sample i (0 <= i < num_samples) is seq_len + 1 tokens drawn from its own
    generator: inputs are the first seq_len, targets the last seq_len.

    Raises ValueError for sizes below 1 or branching > vocab_size.
    """

    def __init__(
        self, vocab_size: int, seq_len: int, num_samples: int, *, seed: int = 0, branching: int = 2
    ) -> None:
        if min(vocab_size, seq_len, num_samples, branching) < 1 or branching > vocab_size:
            raise ValueError(
                f"SyntheticSequences: vocab_size={vocab_size}, seq_len={seq_len}, "
                f"num_samples={num_samples}, branching={branching}: sizes must be >= 1 and "
                "branching <= vocab_size"
            )
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed = seed
        g = _generator("chain", seed)
        # successors[token] = `branching` distinct next tokens.
        self.successors = torch.stack(
            [torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)]
        )

    @property
    def loss_floor(self) -> float:
        """The cross-entropy of a model that knows the chain: each next token is one
        of `branching`, equally likely."""
        return math.log(self.successors.shape[1])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.samples(torch.tensor([i]))[0]

    def samples(self, ids: torch.Tensor) -> torch.Tensor:
        """The samples `ids` as a [len(ids), seq_len + 1] int64 tensor.

        Raises IndexError for an id outside [0, num_samples)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(
                f"SyntheticSequences: sample ids {ids.tolist()} outside [0, {self.num_samples})"
            )
        branching = self.successors.shape[1]
        if not len(ids):
            return torch.empty(0, self.seq_len + 1, dtype=torch.int64)
        draws = torch.stack(
            [
                torch.randint(self.vocab_size * branching, (self.seq_len + 1,), generator=g)
                for g in (_generator("sample", self.seed, int(i)) for i in ids)
            ]
        ).view(len(ids), self.seq_len + 1)
        tokens = torch.empty_like(draws)
        tokens[:, 0] = draws[:, 0] % self.vocab_size
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = self.successors[tokens[:, t - 1], draws[:, t] % branching]
        return tokens

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(ids), seq_len] (separate tensors), for the samples `ids`."""
        tokens = self.samples(ids)
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()


class GlobalBatches:
    """The global order of samples: epoch e visits the num_samples ids in a
    permutation drawn from (seed, e), and step k's global batch is positions
    [k * global_batch_size, (k + 1) * global_batch_size) of the epochs laid end
    to end. Data-parallel rank r takes the r-th contiguous 1/dp_size of it, so
    the ranks' shares, concatenated in rank order, are the global batch.

    Raises ValueError when global_batch_size is not divisible by dp_size or
    dp_rank is outside [0, dp_size).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
    ) -> None:
        if min(num_samples, global_batch_size, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"GlobalBatches: num_samples={num_samples}, global_batch_size="
                f"{global_batch_size}, dp_rank={dp_rank}, dp_size={dp_size} out of range"
            )
        if global_batch_size % dp_size:
            raise ValueError(
                f"GlobalBatches: global_batch_size={global_batch_size} is not divisible by "
                f"dp={dp_size}: every data-parallel rank must take the same number of samples"
            )
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self._epoch: tuple[int, torch.Tensor] | None = None  # the last permutation drawn

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order in which epoch `epoch` visits the samples."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, _permutation(self.num_samples, self.seed, epoch))
        return self._epoch[1]

    def global_ids(self, step: int) -> torch.Tensor:
        """The sample ids of step `step`'s global batch (int64, global_batch_size of them)."""
        if step < 0:
            raise ValueError(f"GlobalBatches: step={step} must be >= 0")
        start = step * self.global_batch_size
        positions = torch.arange(start, start + self.global_batch_size)
        epochs = positions // self.num_samples
        out = torch.empty_like(positions)
        for e in epochs.unique().tolist():
            where = epochs == e
            out[where] = self.permutation(e)[positions[where] % self.num_samples]
        return out

    def ids(self, step: int) -> torch.Tensor:
        """This data-parallel rank's share of step `step`'s global batch."""
        n = self.local_batch_size
        return self.global_ids(step)[self.dp_rank * n : (self.dp_rank + 1) * n]


class LedgerEntry(NamedTuple):
    """One committed step of an ElasticSampler: its epoch, its index among the
    committed steps, and the sample ids each data-parallel rank consumed in it
    (`shares[r]`: rank r's, in the layout of that step; len(shares) is the
    data-parallel size it ran with)."""

    epoch: int
    step: int
    shares: tuple[torch.Tensor, ...]


class ElasticSampler:
    """The samples of each epoch, in the order GlobalBatches visits them
    (a permutation drawn from (seed, epoch)), consumed by a data-parallel
    size that may change between steps (ElasticDataParallel shrinks it when a
    rank dies).

    A cursor marks how far committed steps got into the current epoch. The
    step at the cursor takes the next global_batch_size samples (or
    local_batch_size per rank: local_batch_size x world_size), fewer where the
    epoch ends: a step never spans two epochs. ids(rank, world_size) is rank's
    contiguous share of it (shares differ by at most one sample where the
    step does not divide evenly). commit(world_size) records the step in the
    ledger and moves the cursor past it; a step that is dropped (a rank died
    in it) is never committed, so its samples are taken again by the next
    try, re-split over the survivors. Whatever sizes the steps ran with, every
    sample of an epoch is in exactly one committed step's share
    (consumed(epoch) shows it).

    With uneven shares (the last step of an epoch), DDP's average of the
    ranks' mean losses would weight samples unequally: take the per-sample
    losses' sum times scale(world_size) instead of their mean (equal to the
    mean where shares are even).

    Raises ValueError for num_samples < 1, or unless exactly one of
    global_batch_size and local_batch_size is given, >= 1.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int | None = None,
        local_batch_size: int | None = None,
        seed: int = 0,
    ) -> None:
        sizes = [b for b in (global_batch_size, local_batch_size) if b is not None]
        if not _positive(num_samples) or len(sizes) != 1 or not _positive(sizes[0]):
            raise ValueError(
                f"ElasticSampler: num_samples={num_samples!r}, global_batch_size="
                f"{global_batch_size!r}, local_batch_size={local_batch_size!r}: num_samples and "
                "exactly one of the batch sizes must be given, as ints >= 1"
            )
        self.num_samples, self.seed = num_samples, seed
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.epoch = 0  # of the next step
        self.position = 0  # samples of the epoch consumed by committed steps
        self.steps = 0  # committed steps, all epochs
        self.ledger: list[LedgerEntry] = []
        self._order = (0, _permutation(num_samples, seed, 0))

    def order(self, epoch: int) -> torch.Tensor:
        """The order in which epoch `epoch` visits the samples."""
        if self._order[0] != epoch:
            self._order = (epoch, _permutation(self.num_samples, self.seed, epoch))
        return self._order[1]

    def global_ids(self, world_size: int) -> torch.Tensor:
        """The sample ids of the next step, when it runs on `world_size` ranks."""
        self._check(0, world_size, "global_ids")
        if self.global_batch_size is not None:
            size = self.global_batch_size
        else:
            size = self.local_batch_size * world_size
        end = min(self.position + size, self.num_samples)
        return self.order(self.epoch)[self.position : end]

    def ids(self, rank: int, world_size: int) -> torch.Tensor:
        """Rank `rank`'s share of the next step on `world_size` ranks (possibly
        empty at the end of an epoch with more ranks than samples left).

        Raises ValueError for rank outside [0, world_size)."""
        self._check(rank, world_size, "ids")
        return _share(self.global_ids(world_size), rank, world_size)

    def scale(self, world_size: int) -> float:
        """world_size / the next step's sample count: a rank's summed
        per-sample loss times this, averaged by DDP, is the step's mean loss."""
        return world_size / len(self.global_ids(world_size))

    def commit(self, world_size: int) -> LedgerEntry:
        """Records the next step as run and committed on `world_size` ranks
        (every rank's share) and moves past it; the epoch ends when its last
        sample is consumed. Returns the ledger entry."""
        step = self.global_ids(world_size)
        n = len(step)
        shares = tuple(_share(step, r, world_size) for r in range(world_size))
        entry = LedgerEntry(self.epoch, self.steps, shares)
        self.ledger.append(entry)
        self.steps += 1
        self.position += n
        if self.position == self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        return entry

    def consumed(self, epoch: int, rank: int | None = None) -> torch.Tensor:
        """The sample ids committed steps of `epoch` consumed (those of data-
        parallel rank `rank` of each step's layout only, if given), in order."""
        out = [
            s
            for e in self.ledger
            if e.epoch == epoch
            for r, s in enumerate(e.shares)
            if rank is None or r == rank
        ]
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """The cursor (epoch, position, committed steps), for a checkpoint; the
        ledger is not kept."""
        return {"epoch": self.epoch, "position": self.position, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at a cursor from state_dict(). Raises ValueError for a state
        that is not one of this sampler's (from a checkpoint file: untrusted)."""
        keys = ("epoch", "position", "steps")
        if (
            not isinstance(state, dict)
            or set(state) != set(keys)
            or not all(_positive(state[k], zero=True) for k in keys)
            or state["position"] >= self.num_samples
        ):
            raise ValueError(
                f"ElasticSampler.load_state_dict: {state!r} is not a cursor of this sampler "
                f"(epoch, steps >= 0 and 0 <= position < num_samples={self.num_samples})"
            )
        self.epoch, self.position, self.steps = (state[k] for k in keys)

    def rewind(self, state: dict[str, Any]) -> None:
        """Goes back to a cursor this run's state_dict() gave earlier (a buddy
        copy's step): the steps committed since leave the ledger, to be taken
        again from the same samples. Raises ValueError as load_state_dict."""
        self.load_state_dict(state)
        self.ledger = [e for e in self.ledger if e.step < self.steps]

    def _check(self, rank: int, world_size: int, op: str) -> None:
        if not _positive(world_size) or not _positive(rank, zero=True) or rank >= world_size:
            raise ValueError(
                f"ElasticSampler.{op}: rank={rank!r}, world_size={world_size!r}: need "
                "0 <= rank < world_size, ints"
            )


def _share(step: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a step's sample ids (the first ranks get one
    fewer where the step does not divide)."""
    n = len(step)
    return step[rank * n // world_size : (rank + 1) * n // world_size]


def _positive(value: object, *, zero: bool = False) -> bool:
    """`value` is an int (not a bool) >= 1 (>= 0 with zero=True)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero else 1)
