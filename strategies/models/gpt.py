"""The reference GPT that every strategy in this package trains: token and
position embeddings, pre-LN blocks (causal multi-head attention, GELU MLP),
a final layer norm and an output head tied to the token embedding.

Plain nn.Modules with no parallel code: strategies change the model from the
outside (parallelize_gpt swaps layers for tensor-parallel ones, a pipeline
takes a slice of `blocks`, ZeRO/FSDP shard per block). Three things make that
easy:

- the parts are separate: `embed`, `blocks` (an nn.ModuleList) and `head`;
  `head` computes the loss itself, so a last pipeline stage needs nothing else;
- every parameter's initial value depends only on (seed, its name, its full
  shape) and is drawn from its own generator (`initial_value`), so any layout
  that takes its shard of each full value starts from the same weights, and a
  stage or shard can be initialized without building the rest of the model;
- attention reads the number of heads from its qkv projection's output, whose
  features are laid out head by head (head, q/k/v, head_dim): a contiguous
  slice of those features is a whole number of heads.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "GPTConfig",
    "LMHead",
    "initial_value",
    "materialize",
]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and initialization of a GPT.

    Raises ValueError (from __post_init__) for a non-positive size or a
    d_model not divisible by n_head.
    """

    vocab_size: int = 64
    seq_len: int = 16  # the longest sequence (position embeddings)
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 32
    d_ff: int = 0  # MLP hidden size; 0 means 4 * d_model
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    init_std: float = 0.02
    seed: int = 0
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )
        if self.d_ff < 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: d_ff={self.d_ff}, dropout={self.dropout} out of range")

    @property
    def hidden(self) -> int:
        """The MLP's hidden size."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, name) alone (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_value(
    config: GPTConfig, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The full initial value of parameter `name` (as named in GPT.named_parameters())
    of the given full shape: the same on every rank and for every parallel layout.

    Layer norm weights are ones and biases zeros; other weights are normal with
    std init_std, scaled by 1/sqrt(2 * n_layer) for the projections that write
    into the residual stream (GPT-2). Drawn in float64 on the CPU, then cast.
    """
    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in f".{name}":
        value = torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    elif leaf == "bias":
        value = torch.zeros(shape)
    else:
        std = config.init_std
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            std /= math.sqrt(2 * config.n_layer)
        value = torch.empty(shape, dtype=torch.float64).normal_(
            0.0, std, generator=_generator(config.seed, name)
        )
    return value.to(dtype)


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Replaces every meta parameter of `module` by an uninitialized one on
    `device` (floating point ones in `dtype`), keeping shared parameters shared.
    (nn.Module.to_empty runs empty_like through torch._refs, whose first use
    imports sympy: seconds per process.)"""
    made: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                dt = dtype if p.is_floating_point() else p.dtype
                t = torch.empty(tuple(p.shape), dtype=dt, device=device)
                made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            setattr(mod, name, made[id(p)])


class Embedding(nn.Module):
    """Token plus learned position embeddings: [B, T] ids -> [B, T, d_model]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # Given tables: nn.Embedding's own init (normal_) on the meta device goes
        # through torch._refs and imports torch._dynamo (seconds per process).
        v, t, d = config.vocab_size, config.seq_len, config.d_model
        self.tok = nn.Embedding(v, d, _weight=torch.empty(v, d))
        self.pos = nn.Embedding(t, d, _weight=torch.empty(t, d))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. qkv's output features are ordered
    (head, q/k/v, head_dim), so the number of heads is read from its output:
    the layer works unchanged on any contiguous slice of whole heads."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # not x's: a sequence-parallel x holds a slice of t
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, head_dim]
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """fc (d_model -> hidden), GELU, proj (hidden -> d_model)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.hidden, bias=config.bias)
        self.proj = nn.Linear(config.hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(.)))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.ln_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.ln_eps, bias=config.bias)
        self.mlp = MLP(config)
        self.drop1 = nn.Dropout(config.dropout)
        self.drop2 = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class LMHead(nn.Module):
    """Final layer norm and output projection; with targets, the mean
    cross-entropy instead of the logits. `weight` is the token embedding's
    when the embeddings are tied (the same Parameter object)."""

    def __init__(self, config: GPTConfig, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.ln_eps, bias=config.bias)
        if weight is None:
            weight = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.weight = weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = F.linear(self.ln_f(x), self.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    """A GPT built and initialized from `config` alone (see initial_value): the
    layers are built on the meta device, so torch's random generator is not
    touched, then every parameter is set to its initial_value.

    forward(idx [B, T] int64, targets [B, T] | None) returns the logits
    [B, T, vocab_size], or with targets the mean cross-entropy. Raises
    ValueError when T exceeds config.seq_len.
    """

    def __init__(
        self,
        config: GPTConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.embed = Embedding(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.head = LMHead(config, self.embed.tok.weight if config.tie_embeddings else None)
        materialize(self, device, dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Sets every parameter to its initial_value (for its full shape)."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.config, name, tuple(p.shape), p.dtype))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(
                f"GPT: sequence of {idx.shape[1]} tokens is longer than seq_len={self.config.seq_len}"
            )
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)
