"""Deterministic data for the strategies: a toy language whose loss falls, and
the global order of its samples, from which each data-parallel rank takes its
share.

Everything is a function of (seed, sample id) or (seed, step): no state, no
dependence on the parallel layout. Whatever dp x tp x pp trains, step k's
global batch is the same list of sample ids, each rank builds only the samples
it needs, and a run resumes at any step without replaying the ones before.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["GlobalBatches", "SyntheticSequences"]


def _generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from `key` alone (hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


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
            self._epoch = (
                epoch,
                torch.randperm(self.num_samples, generator=_generator(self.seed, epoch)),
            )
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
