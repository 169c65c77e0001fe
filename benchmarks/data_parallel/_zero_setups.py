"""The training setups the ZeRO benchmarks compare, each over one GPT on a
pycollectives communicator: strategies.DDP ("dp"), ZeroOptimizer stages 1-3
("zero1".."zero3") and fully_shard ("fsdp"), with AdamW, in fp32 or with
bf16 compute on fp32 master weights. Each gives a training step and the
bytes of tensor storage it holds on this rank by role."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import pycollectives as pc
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel
from pycollectives.strategies.data_parallel.fsdp import MixedPrecisionPolicy, fully_shard
from pycollectives.strategies.data_parallel.sharding import EngineMeter
from pycollectives.strategies.data_parallel.sharding.engine import count_storage
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig

__all__ = [
    "MODES",
    "ROLES",
    "Setup",
    "build",
    "count_storage",
    "fresh_gpt",
    "preload_initial",
    "save_initial",
]

MODES = ("dp", "zero1", "zero2", "zero3", "fsdp")
ROLES = ("params", "param_shards", "grads", "optimizer", "reduce_buffers")
OPT: dict[str, Any] = {"lr": 1e-4}


@dataclass
class Setup:
    """One strategy, built: `backward(x, y)` zeroes the gradients, runs forward
    and backward (with their communication) and returns the loss; `update()`
    steps the optimizer (with what follows it: ZeRO-1/2's all-gather, the DP
    master copies); `step(x, y)` does both."""

    mode: str
    backward: Callable[[torch.Tensor, torch.Tensor], float]
    update: Callable[[], None]
    storage: Callable[[], dict[str, int]]
    meter: EngineMeter | None = None
    keep: list[Any] = field(default_factory=list)  # what must live as long as the setup

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step; the loss."""
        loss = self.backward(x, y)
        self.update()
        return loss


_INITIAL: dict[GPTConfig, dict[str, torch.Tensor]] = {}


class _CachedGPT(GPT):
    """GPT whose initial values are computed once per process and copied after
    (GPT's own per-parameter generators take seconds at 50M parameters)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cached = _INITIAL.get(self.config)
        if cached is None:
            super().reset_parameters()
            _INITIAL[self.config] = {n: p.detach().clone() for n, p in self.named_parameters()}
            return
        for name, p in self.named_parameters():
            p.copy_(cached[name])


def save_initial(config: GPTConfig, path: str) -> None:
    """Computes GPT(config)'s initial values once and saves them to `path`."""
    torch.save({n: p.detach() for n, p in GPT(config).named_parameters()}, path)


def preload_initial(config: GPTConfig, path: str) -> None:
    """Loads the initial values save_initial wrote: fresh_gpt(config) copies them."""
    _INITIAL[config] = torch.load(path)


def fresh_gpt(config: GPTConfig) -> GPT:
    """A new GPT(config) with GPT's initial values (cached per process)."""
    return _CachedGPT(config)


def _opt_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def _dp(model: GPT, comm: pc.Communicator, mixed: bool) -> Setup:
    """strategies.DDP, gradients as views of its buckets. Mixed: the model in
    bf16 (parameters and bucketed gradients), fp32 master copies that AdamW
    steps, copied back into the model after each step (2 + 2 + 4 + 8 bytes)."""
    master = [p.detach().clone() for p in model.parameters()] if mixed else []
    if mixed:
        model.to(torch.bfloat16)
    ddp = DistributedDataParallel(model, comm, gradient_as_bucket_view=True)
    params = list(model.parameters())
    if mixed:
        for m in master:
            m.requires_grad_(True)
    opt = torch.optim.AdamW(master or params, **OPT)

    def backward(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        ddp.zero_grad(set_to_none=False)
        loss = ddp(x, y)
        loss.backward()
        return loss.item()

    def update() -> None:
        if mixed:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()  # for the step only, as ZeroOptimizer does
        opt.step()
        if mixed:
            with torch.no_grad():
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
                    m.grad = None

    def storage() -> dict[str, int]:
        return count_storage(
            {
                "params": params,
                "param_shards": master,
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": _opt_state(opt),
                "reduce_buffers": [b.buffer for b in ddp.buckets.buckets],
            }
        )

    return Setup("dp", backward, update, storage, keep=[ddp])


def build(
    mode: str,
    config: GPTConfig,
    comm: pc.Communicator,
    *,
    mixed: bool = False,
    prefetch: int = 2,
    model: nn.Module | None = None,
    check_order: bool = True,
    **shard_kw: Any,
) -> Setup:
    """The setup `mode` (one of MODES) of a fresh GPT(config) over `comm`;
    `check_order` and `shard_kw` (fully_shard's reshard_after_forward) go to
    ZeroOptimizer / fully_shard. Raises ValueError for an unknown mode."""
    model = model or fresh_gpt(config)
    bf16 = torch.bfloat16 if mixed else None
    if mode == "dp":
        return _dp(model, comm, mixed)
    if mode.startswith("zero") and mode[-1] in "123":
        zero = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            comm,
            int(mode[-1]),
            prefetch=prefetch,
            param_dtype=bf16,
            check_order=check_order,
            **OPT,
        )

        def zbackward(x: torch.Tensor, y: torch.Tensor) -> float:
            zero.zero_grad()
            loss = model(x, y)
            loss.backward()
            return loss.item()

        return Setup(
            mode, zbackward, zero.step, zero.storage, zero.engine.meter, keep=[model, zero]
        )
    if mode == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=bf16)
        for block in model.blocks:
            fully_shard(block, comm, mp_policy=mp, **shard_kw)
        fully_shard(model, comm, mp_policy=mp, prefetch=prefetch, check_order=check_order,
                    **shard_kw)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        setup = Setup(mode, lambda x, y: 0.0, opt.step, lambda: {}, keep=[model, opt])

        def fbackward(x: torch.Tensor, y: torch.Tensor) -> float:
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            setup.meter = model.sharding_unit.engine.meter  # the engine exists now
            return loss.item()

        setup.backward = fbackward
        setup.storage = lambda: model.sharding_unit.engine.storage(opt)
        return setup
    raise ValueError(f"build: mode={mode!r} is not one of {MODES}")
