"""Shared by test_zero*.py and test_fsdp*.py (no tests here): a tiny GPT, its
data, and training loops for every strategy, each returning the full
parameters after training so that they compare by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import pycollectives as pc
from pycollectives.strategies.data import SyntheticSequences
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel
from pycollectives.strategies.data_parallel.fsdp import MixedPrecisionPolicy, fully_shard
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig

# Embedding, attention, MLP, layer norms, a head tied to the embedding: 2
# blocks of d_model 16 (3,296 parameters each) and a root of 832.
CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
# 5 steps: the first builds the engines and records the units' order, the next
# ones prefetch by it; equality with DDP (bitwise on 2 ranks) holds at any count.
STEPS, BATCH = 5, 2  # per rank
DATA = SyntheticSequences(CFG.vocab_size, CFG.seq_len, 4096, seed=1)
# AdamW (single-tensor implementation on the CPU, for the references and the
# shards alike: foreach/fused left at their defaults). eps well above rounding
# noise, as tests/strategies/data_parallel/test_ddp.py: the attention's key bias has a true gradient of
# zero, and the ~1e-9 of noise that differs between summation orders would
# become full lr-sized steps with eps=1e-8 (against one process on the whole
# batch only: against DDP the bits are the same anyway).
OPT: dict[str, Any] = {"lr": 1e-2, "eps": 1e-3}
Params = dict[str, torch.Tensor]


def global_batch(world: int, step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch for `world` ranks (rank r takes rows [r*batch, (r+1)*batch))."""
    g = world * batch
    return DATA.batch(torch.arange(step * g, (step + 1) * g) % len(DATA))


def local_batch(
    comm: pc.Communicator, step: int, batch: int = BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(comm.world_size, step, batch)
    sl = slice(comm.rank * batch, (comm.rank + 1) * batch)
    return x[sl], y[sl]


def named(model: torch.nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_single(world: int, steps: int = STEPS) -> Params:
    """One process on the concatenated global batch."""
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    for step in range(steps):
        opt.zero_grad()
        model(*global_batch(world, step)).backward()
        opt.step()
    return named(model)


def train_ddp(
    comm: pc.Communicator,
    steps: int = STEPS,
    micro: int = 1,
    clip: float | None = None,
    norms: list[torch.Tensor] | None = None,
) -> Params:
    """strategies.DDP, the reference; `micro` micro-batches per step (no_sync
    for all but the last), gradients clipped to `clip` (the total norms
    torch.nn.utils.clip_grad_norm_ returns appended to `norms`)."""
    model = GPT(CFG)
    ddp = DistributedDataParallel(model, comm)
    opt = torch.optim.AdamW(ddp.parameters(), **OPT)
    for step in range(steps):
        opt.zero_grad()
        for k in range(micro):
            x, y = local_batch(comm, step * micro + k)
            if k < micro - 1:
                with ddp.no_sync():
                    (ddp(x, y) / micro).backward()
            else:
                (ddp(x, y) / micro).backward()
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            if norms is not None:
                norms.append(total)
        opt.step()
    return named(model)


def build(comm: pc.Communicator, mode: str, model: GPT | None = None, **kw: Any) -> tuple[GPT, Any]:
    """(model, optimizer) for mode zero1 / zero2 / zero3 / fsdp; `kw` go to
    ZeroOptimizer, or to fully_shard (reshard_after_forward, prefetch, mp_policy)."""
    model = model or GPT(CFG)
    if mode.startswith("zero"):
        return model, ZeroOptimizer(
            model, torch.optim.AdamW, comm, stage=int(mode[-1]), **kw, **OPT
        )
    prefetch = kw.pop("prefetch", 2)
    for block in model.blocks:
        fully_shard(block, comm, **kw)
    fully_shard(model, comm, prefetch=prefetch, **kw)
    return model, torch.optim.AdamW(model.parameters(), **OPT)


def full_params(model: GPT, opt: Any) -> Params:
    return opt.full_parameters() if hasattr(opt, "full_parameters") else model.full_parameters()


def no_sync(model: GPT, opt: Any) -> Any:
    return opt.no_sync() if hasattr(opt, "no_sync") else model.no_sync()


def clip(model: GPT, opt: Any, max_norm: float) -> torch.Tensor:
    if hasattr(opt, "clip_grad_norm_"):
        return opt.clip_grad_norm_(max_norm)
    return model.clip_grad_norm_(max_norm)


def train(
    comm: pc.Communicator,
    mode: str,
    steps: int = STEPS,
    micro: int = 1,
    clip_to: float | None = None,
    each_step: Callable[[int, GPT, Any], None] | None = None,
    norms: list[torch.Tensor] | None = None,
    **kw: Any,
) -> tuple[Params, GPT, Any]:
    """Trains under `mode` as train_ddp does; returns (full parameters, model, optimizer)."""
    model, opt = build(comm, mode, **kw)
    for step in range(steps):
        opt.zero_grad()
        for k in range(micro):
            x, y = local_batch(comm, step * micro + k)
            if k < micro - 1:
                with no_sync(model, opt):
                    (model(x, y) / micro).backward()
            else:
                (model(x, y) / micro).backward()
        if clip_to is not None:
            total = clip(model, opt, clip_to)
            if norms is not None:
                norms.append(total)
        opt.step()
        if each_step is not None:
            each_step(step, model, opt)
    return full_params(model, opt), model, opt


def differ(a: Params, b: Params, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None if every parameter of `a` equals `b`'s (bitwise with zero
    tolerances), else the first that differs and by how much."""
    if set(a) != set(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    worst = None
    for n in a:
        x, y = a[n], b[n]
        ok = torch.equal(x, y) if rtol == atol == 0 else torch.allclose(x, y, rtol=rtol, atol=atol)
        if not ok:
            d = (x.float() - y.float()).abs().max().item()
            if worst is None or d > worst[1]:
                worst = (n, d)
    return None if worst is None else f"{worst[0]}: max |diff| {worst[1]:.3g}"


def fsdp_kw(reshard: bool | None, prefetch: int, mp: MixedPrecisionPolicy | None = None) -> dict:
    return {"reshard_after_forward": reshard, "prefetch": prefetch, "mp_policy": mp}
