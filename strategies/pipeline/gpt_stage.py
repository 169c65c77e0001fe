"""The reference GPT split into pipeline stages.

A stage is a `GPTStage`: a GPT whose parts it does not run are gone. It has
the GPT's attributes under the GPT's names (`embed` on the first stage only,
`head` on the last only, `blocks` a full-length nn.ModuleList in which the
blocks of other stages are nn.Identity), so its parameters keep their global
names ("blocks.5.attn.qkv.weight" on whichever stage runs block 5): the
initial value of each is `initial_value(config, name, full shape)`, as in the
whole model, parallelize_gpt applies to a stage as to the GPT, and a
checkpoint's keys do not depend on the split.

How many blocks each stage runs: `layer_split` balances the parameter counts
(the embedding counts on the first stage, the head on the last) over
contiguous runs of blocks, or takes a given split. Every stage runs at least
one block.

Tied embeddings: the first stage's token embedding and the last stage's
output head are the same weight. Two stages on different ranks each hold a
copy (equal at the start) and must sum their gradients every step; each
names it in `tied_parameters()` and the runtime sums them through the
pipeline communicator (communications.sum_tied_gradients). Stages of one
rank share the Parameter itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..models.gpt import Block, Embedding, GPTConfig, LMHead, initial_value, materialize

__all__ = ["GPTStage", "TensorSpec", "balance", "gpt_stages", "layer_split"]

TIED = "embed.tok.weight"  # the tied weight's name in the whole GPT


class TensorSpec(NamedTuple):
    """Shape and dtype of a tensor a stage sends or receives."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)


def _block_params(config: GPTConfig) -> tuple[int, int, int]:
    """Parameter counts of (the embedding, one block, the head) of `config`."""
    with torch.device("meta"):
        embed, block, head = Embedding(config), Block(config), LMHead(config)
    return tuple(sum(p.numel() for p in m.parameters()) for m in (embed, block, head))


def balance(costs: Sequence[int], num_stages: int, *, first: int = 0, last: int = 0) -> list[int]:
    """Cuts `costs` (one per layer) into `num_stages` contiguous non-empty
    runs minimizing the largest run's cost, where the first run also costs
    `first` and the last `last`; among those, the one with the smallest sum
    of squared costs (the most even). Returns the number of layers per run.

    Raises ValueError when there are fewer layers than stages.
    """
    n, k = len(costs), num_stages
    if k < 1 or n < k:
        raise ValueError(f"balance: {n} layers cannot fill {k} stages (at least one layer each)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, s: int) -> int:  # layers i..j-1 as stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + (last if s == k - 1 else 0)

    def solve(score, limit: float) -> tuple[float, list[int]]:
        """Dynamic programme over (stage, layers placed): the cut minimizing
        the combined `score` of the stage costs, each at most `limit`."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(k)]
        cut = [[0] * (n + 1) for _ in range(k)]
        for j in range(1, n + 1):
            if cost(0, j, 0) <= limit:
                best[0][j] = score(0, cost(0, j, 0))
        for s in range(1, k):
            for j in range(s + 1, n + 1):
                for i in range(s, j):  # stage s holds layers i..j-1
                    c = cost(i, j, s)
                    if c <= limit and (v := score(best[s - 1][i], c)) < best[s][j]:
                        best[s][j], cut[s][j] = v, i
        sizes, j = [], n
        for s in range(k - 1, 0, -1):
            sizes.append(j - cut[s][j])
            j = cut[s][j]
        return best[k - 1][n], [j, *sizes[::-1]]

    top, _ = solve(max, float("inf"))
    return solve(lambda acc, c: acc + c * c, top)[1]


def layer_split(
    config: GPTConfig, num_stages: int, split: Sequence[int] | None = None
) -> list[range]:
    """The blocks each of `num_stages` stages runs: `split` (blocks per stage)
    if given, else balanced by parameter count (`balance`).

    Raises ValueError naming the numbers when n_layer < num_stages, or when
    `split` has the wrong length, a stage with no block, or does not sum to
    n_layer.
    """
    n = config.n_layer
    if num_stages < 1 or n < num_stages:
        raise ValueError(
            f"pipeline: fewer layers than stages: n_layer={n} blocks cannot fill "
            f"{num_stages} stages (each stage runs at least one block)"
        )
    if split is None:
        embed, block, head = _block_params(config)  # head: its copy of a tied weight too
        sizes = balance([block] * n, num_stages, first=embed, last=head)
    else:
        sizes = list(split)
        if len(sizes) != num_stages or min(sizes) < 1 or sum(sizes) != n:
            raise ValueError(
                f"pipeline: split={sizes} must give each of the {num_stages} stages at least one "
                f"block and sum to n_layer={n}"
            )
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + size) for a, size in zip(starts, sizes, strict=True)]


class GPTStage(nn.Module):
    """Stage `stage_index` of `num_stages` of the GPT of `config`, running
    blocks `layers`: the embedding first if it is stage 0, the head (and the
    loss) last if it is the last stage. Parameters are created on the meta
    device and set to their initial_value under their global names, so no
    other stage's weights are ever built.

    forward(x, targets=None): token ids [b, t] (first stage) or hidden states
    [b, t, d_model] in; hidden states out, or the mean cross-entropy on the
    last stage (with targets).

    `sequence_shards`: the hidden states it receives and sends are this
    rank's [b, t / sequence_shards, d_model] slice of the sequence (1: the
    whole sequence; parallelize_gpt sets tp under sequence parallelism, so
    the stages exchange sequence shards, 1/tp of the bytes, as Megatron's).
    """

    sequence_shards: int = 1

    def __init__(
        self,
        config: GPTConfig,
        stage_index: int,
        num_stages: int,
        layers: range,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config, self.stage_index, self.num_stages = config, stage_index, num_stages
        self.layers = layers
        first, last = stage_index == 0, stage_index == num_stages - 1
        with torch.device("meta"):
            self.embed = Embedding(config) if first else None
            self.blocks = nn.ModuleList(
                Block(config) if i in layers else nn.Identity() for i in range(config.n_layer)
            )
            self.head = LMHead(config) if last else None
        materialize(self, device, dtype)
        if first and last and config.tie_embeddings:
            self.head.weight = self.embed.tok.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                full = TIED if name == "head.weight" and config.tie_embeddings else name
                p.copy_(initial_value(config, full, tuple(p.shape), p.dtype))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            if x.shape[1] > self.config.seq_len:
                raise ValueError(
                    f"GPTStage {self.stage_index}: sequence of {x.shape[1]} tokens is longer "
                    f"than seq_len={self.config.seq_len}"
                )
            x = self.embed(x)
        for i in self.layers:
            x = self.blocks[i](x)
        return self.head(x, targets) if self.head is not None else x

    def _hidden(self, inputs: TensorSpec) -> TensorSpec:
        dtype = next(p.dtype for p in self.parameters() if p.is_floating_point())
        b, t = inputs.shape[:2]
        return TensorSpec((b, t // self.sequence_shards, self.config.d_model), dtype)

    def input_spec(self, inputs: TensorSpec) -> TensorSpec:
        """What forward takes for micro-batches of token ids `inputs`: the ids
        on the first stage, else [b, t / sequence_shards, d_model] hidden
        states in the dtype of the parameters (computed from the config,
        before any step runs)."""
        return inputs if self.is_first else self._hidden(inputs)

    def output_spec(self, inputs: TensorSpec) -> TensorSpec | None:
        """What forward returns and sends on (None on the last stage)."""
        return None if self.is_last else self._hidden(inputs)

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """The tied embedding/head weight under its global name, on the first
        and the last stage (when the embeddings are tied); else empty."""
        if not self.config.tie_embeddings:
            return {}
        if self.embed is not None:
            return {TIED: self.embed.tok.weight}
        if self.head is not None:
            return {TIED: self.head.weight}
        return {}


def gpt_stages(
    config: GPTConfig,
    stages: Sequence[int],
    num_stages: int,
    *,
    split: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[GPTStage]:
    """The GPTStages `stages` (those one rank holds, e.g.
    `schedule.stages_of(rank)`) of a GPT cut into `num_stages` by `layer_split`.
    When the first and the last stage are both here, they share the tied
    weight. Parameters on `device` in `dtype`.

    Raises ValueError (from layer_split) for fewer layers than stages or a
    bad split, and for a stage index out of range.
    """
    ranges = layer_split(config, num_stages, split)
    bad = [s for s in stages if not 0 <= s < num_stages]
    if bad:
        raise ValueError(f"gpt_stages: stages {bad} out of range for num_stages={num_stages}")
    out = [GPTStage(config, s, num_stages, ranges[s], dtype, device) for s in stages]
    ends = [m for m in out if m.is_first], [m for m in out if m.is_last]
    if config.tie_embeddings and all(ends) and num_stages > 1:
        ends[1][0].head.weight = ends[0][0].embed.tok.weight
    return out
