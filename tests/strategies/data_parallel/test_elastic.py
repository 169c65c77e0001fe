"""ElasticDataParallel: 1 of 4 ranks is killed (SIGKILL) in the backward of step
K; the survivors drop that step alike, shrink, and after N more steps hold the
same parameters, bit for bit, as a reference that trained on 4 ranks up to K
and on the 3 survivors' layout (split, no failure) from K on."""

from __future__ import annotations

import os
import signal

import torch
from spawn import run

import pycollectives as pc
from pycollectives.strategies.data_parallel import DistributedDataParallel, ElasticDataParallel

K, N, BATCH = 3, 4, 12  # the global batch splits evenly over 4 and 3 ranks


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _loss(ddp: torch.nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    """The mean loss of this rank's share of step `step`'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    share = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    return torch.nn.functional.mse_loss(ddp(x[share]), y[share])


def _params(m: torch.nn.Module) -> list[list[float]]:
    """The parameters as lists (float32 to float is exact: bitwise comparable;
    tensors would go back to the test through a process that has exited)."""
    return [p.detach().reshape(-1).tolist() for p in m.parameters()]


def _elastic(rank: int, world_size: int) -> tuple:
    comm = pc.init(timeout=30)
    m, opt = _model()
    model = ElasticDataParallel(m, comm)
    if rank == world_size - 1:  # dies in the backward of step K

        def die(grad: torch.Tensor) -> torch.Tensor:
            if step == K:
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        m[0].weight.register_hook(die)
    step = 0
    while step < K + N:
        if model.step(lambda ddp, r, n, s=step: _loss(ddp, s, r, n), opt):
            step += 1
    out = (_params(m), model.world_size, model.recoveries)
    model.comm.close()
    return out


def _reference(rank: int, world_size: int) -> list | None:
    comm = pc.init(timeout=30)
    m, opt = _model()
    ddp = DistributedDataParallel(m, comm)
    for step in range(K):
        opt.zero_grad(set_to_none=True)
        _loss(ddp, step, rank, world_size).backward()
        opt.step()
    ddp.detach()
    sub = comm.split(0 if rank < world_size - 1 else None)
    if sub is None:
        return None
    ddp = DistributedDataParallel(m, sub)
    for step in range(K, K + N):
        opt.zero_grad(set_to_none=True)
        _loss(ddp, step, sub.rank, sub.world_size).backward()
        opt.step()
    return _params(m)


def test_ddp_goes_on_after_a_rank_dies_and_matches_the_survivors_layout_bitwise():
    got = run(_elastic, 4, timeout=150, expect_exit={3: -signal.SIGKILL})
    want = run(_reference, 4, timeout=150)
    for r in range(3):
        params, size, recoveries = got[r]
        assert size == 3 and len(recoveries) == 1 and recoveries[0]["failed"] == (3,), recoveries
        assert params == want[r], r
    # The parameters moved (the comparison is not of two untrained models).
    assert got[0][0] != _params(_model()[0])
