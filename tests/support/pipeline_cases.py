"""The tiny GPT, its micro-batches and one process's reference gradients,
shared by the pipeline runtime's tests (test_pipeline_runtime.py,
test_pipeline_split.py)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from pycollectives.strategies.models import GPT, GPTConfig
from pycollectives.strategies.pipeline.gpt_stage import TIED

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))
B, T = 2, 8


def config(num_stages: int, **change) -> GPTConfig:
    """The tiny GPT: one block per stage, d_model 16, vocab 32, seq 8."""
    cfg = GPTConfig(vocab_size=32, seq_len=T, n_layer=num_stages, n_head=2, d_model=16, seed=3)
    return dataclasses.replace(cfg, **change)


def microbatches(m: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 32, (B, T), generator=g), torch.randint(0, 32, (B, T), generator=g))
        for _ in range(m)
    ]


@functools.cache
def reference(cfg: GPTConfig, m: int, tied: bool = False) -> tuple[dict, list[float]]:
    """Gradients (by global name) and losses of one process accumulating the
    m micro-batches, loss / m each. Untied (default): the head's copy of the
    tied weight is a separate Parameter, its gradient added to the
    embedding's at the end, as the pipeline adds them."""
    model = GPT(cfg)
    if not tied:
        model.head.weight = nn.Parameter(model.embed.tok.weight.detach().clone())
    losses = []
    for x, y in microbatches(m):
        loss = model(x, y)
        (loss / m).backward()
        losses.append(float(loss.detach()))
    grads = {n: p.grad for n, p in model.named_parameters()}
    if not tied:
        grads[TIED] = grads[TIED] + grads.pop("head.weight")
    return grads, losses
