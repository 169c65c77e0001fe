"""ElasticDataParallel: 1 of 4 ranks is killed (SIGKILL) at a point of a step
(the forward, the backward, a bucket's all-reduce, the agreement, the optimizer
step), or a second one while the survivors rebuild; the survivors agree alike
whether that step was committed, shrink, and after a few more steps hold the
same parameters, bit for bit, as a reference that trained on 4 ranks up to the
first step they did not all commit and on the survivors' layout (split, no
failure) from there. The samples come from an
ElasticSampler whose batch is 3 samples per rank: the epoch's remaining order is
re-split over the survivors, and its ledger, gathered from the survivors, holds
every sample of the epoch exactly once, as each rank fed them."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from spawn import run

import pycollectives as pc
from pycollectives.strategies.data import ElasticSampler
from pycollectives.strategies.data_parallel import DistributedDataParallel, ElasticDataParallel

NUM, LOCAL, STEPS, K = 40, 3, 8, 2  # 12 samples a step on 4 ranks, 9 on 3: epoch 0 ends short
VICTIM = 3
DDP = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}  # a bucket per parameter or two
# Where the victim dies: the first step the survivors do not all commit (None
# where the agreement may go either way: the victim dies inside it), and how
# many survive.
KILLS = {
    "forward": (K, 3),  # before its forward of step K
    "backward": (K, 3),  # in the backward, before the last bucket's all-reduce
    "bucket_allreduce": (K, 3),  # the last bucket's all-reduce launched, not finished
    "agreement": (None, 3),  # entered the agreement of step 0 (PYCOLL_TEST_KILL_AT)
    "optimizer_step": (K + 1, 3),  # after the agreement committed step K, before it steps
    "second_death": (K, 2),  # forward of step K, then rank 2 while the survivors rebuild
}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(NUM, 8, generator=g), torch.randn(NUM, 4, generator=g)


def _loss(ddp: torch.nn.Module, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """The samples' summed squared errors, scaled so that DDP's average is the
    step's mean over its samples (shares are uneven at the end of an epoch)."""
    x, y = _data()
    return ((ddp(x[ids]) - y[ids]) ** 2).mean(dim=1).sum() * scale


def _params(m: torch.nn.Module) -> list[list[float]]:
    """The parameters as lists (float32 to float is exact: bitwise comparable;
    tensors would go back to the test through a process that has exited)."""
    return [p.detach().reshape(-1).tolist() for p in m.parameters()]


class _Recording(ElasticDataParallel):
    """Records its rebuild() calls: the hook where a wrapper of sharded state
    restores what the failed ranks held. `dies_in_rebuild`: SIGKILLs itself in it."""

    rebuilt: list[tuple] = []
    dies_in_rebuild = False

    def rebuild(self, old: pc.Communicator, new: pc.Communicator, failed: tuple[int, ...]) -> None:
        if self.dies_in_rebuild:
            _die()
        self.rebuilt = [*self.rebuilt, (old.world_size, new.world_size, new.parent_ranks, failed)]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _elastic(rank: int, world_size: int, kill: str) -> dict:
    victim = rank == VICTIM or (kill == "second_death" and rank == VICTIM - 1)
    if victim and kill == "agreement":
        os.environ["PYCOLL_TEST_KILL_AT"] = "agree.entered"  # its first: step 0's
    comm = pc.init(timeout=30)
    m, opt = _model()
    sampler = ElasticSampler(NUM, local_batch_size=LOCAL)
    model = _Recording(m, comm, sampler=sampler, **DDP)
    model.dies_in_rebuild = rank == VICTIM - 1 and kill == "second_death"

    def die_at_k(*_: object) -> None:
        if model.steps == K:
            _die()

    if victim and kill == "backward":  # a tensor hook: before the gradient reaches DDP's bucket
        m[0].weight.register_hook(die_at_k)
    if victim and kill == "bucket_allreduce":  # after DDP's hook, which launched the last bucket
        m[0].weight.register_post_accumulate_grad_hook(die_at_k)
    if victim and kill == "optimizer_step":
        opt.register_step_pre_hook(die_at_k)
    fed: list[list[int]] = []  # the ids this rank fed, per committed step

    def loss_fn(ddp: torch.nn.Module, r: int, n: int) -> torch.Tensor:
        if rank == VICTIM and kill in ("forward", "second_death") and model.steps == K:
            _die()
        ids = sampler.ids(r, n)
        fed.append(ids.tolist())
        return _loss(ddp, ids, sampler.scale(n))

    while model.steps < STEPS:
        if not model.step(loss_fn, opt):
            fed.pop()  # dropped: not consumed
    out = {
        "params": _params(m),
        "world_size": model.world_size,
        "recoveries": [(r["step"], r["failed"], r["world_size"]) for r in model.recoveries],
        "ledger": [(e.epoch, e.step, [s.tolist() for s in e.shares]) for e in sampler.ledger],
        "fed": fed,
        "rebuilt": model.rebuilt,
        # on the survivors' communicator: none, DDP's init_sync="verify" found them alike
        "broadcasts": model.comm.stats().get("broadcast", {}).get("calls", 0),
    }
    model.comm.close()
    return out


def _reference(rank: int, world_size: int, switches: list[tuple[int, int]]) -> dict:
    """For each (s, n): trains on the 4 ranks for steps < s, on the first n (a
    split: no failure) from s; the others return nothing for it."""
    comm = pc.init(timeout=30)
    out = {}
    for s, n in switches:
        m, opt = _model()
        sampler = ElasticSampler(NUM, local_batch_size=LOCAL)
        sub = comm.split(0 if rank < n else None)
        ddp = DistributedDataParallel(m, comm, **DDP) if s > 0 else None
        for step in range(STEPS):
            group = comm if step < s else sub
            if group is None:
                break
            if step == s:
                if ddp is not None:
                    ddp.detach()
                ddp = DistributedDataParallel(m, group, **DDP)
            opt.zero_grad(set_to_none=True)
            size = group.world_size
            _loss(ddp, sampler.ids(group.rank, size), sampler.scale(size)).backward()
            opt.step()
            sampler.commit(size)
        if sub is not None:
            out[s, n] = _params(m)
            sub.close()
    return out


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run(_reference, 4, [(0, 3), (1, 3), (K, 3), (K + 1, 3), (K, 2)], timeout=150)


@pytest.mark.parametrize("kill", list(KILLS))
def test_rank_killed_survivors_match_the_surviving_layout_bitwise(kill, reference):
    want, n = KILLS[kill]
    dead = tuple(range(n, 4))
    got = run(_elastic, 4, kill, timeout=150, expect_exit=dict.fromkeys(dead, -signal.SIGKILL))
    got = got[:n]
    # Every survivor dropped the same step, saw the victims fail and went on n strong.
    failed_step = got[0]["recoveries"][0][0]
    for r, g in enumerate(got):
        assert g["world_size"] == n and g["recoveries"] == [(failed_step, dead, n)], (r, g)
        assert g["broadcasts"] == 0, (r, g["broadcasts"])
        first = (4, 3, (0, 1, 2), (VICTIM,))
        if n == 3:
            assert g["rebuilt"] == [first], g["rebuilt"]
        else:  # rank 2 died in the first rebuild: the survivors shrank again
            assert g["rebuilt"][-1] == (3, 2, (0, 1), (2,)), g["rebuilt"]
            assert g["rebuilt"][:-1] in ([], [first]), g["rebuilt"]
    assert failed_step == want if want is not None else failed_step in (0, 1), failed_step
    for r, g in enumerate(got):
        assert g["params"] == reference[r][failed_step, n], (kill, r)
    # The parameters moved (the comparison is not of two untrained models).
    assert got[0]["params"] != _params(_model()[0])

    # The ledger: the same on every survivor; steps before the failed one ran
    # on 4 ranks (the victim's shares included: every survivor's average had
    # them), the rest on n; every sample of epoch 0 consumed exactly once, none
    # of epoch 1 twice; each survivor fed exactly its shares.
    ledger = got[0]["ledger"]
    assert all(g["ledger"] == ledger for g in got)
    assert [len(shares) for _, _, shares in ledger] == [
        4 if i < failed_step else n for i in range(STEPS)
    ]
    for epoch in (0, 1):
        ids = [i for e, _, shares in ledger if e == epoch for s in shares for i in s]
        assert len(ids) == len(set(ids)), (epoch, ids)
        if epoch == 0:
            assert sorted(ids) == list(range(NUM))
    assert ledger[-1][0] == 1  # the run went past the end of epoch 0
    for r, g in enumerate(got):
        assert g["fed"] == [shares[r] for _, _, shares in ledger], r


class _FailingRebuild(ElasticDataParallel):
    """rebuild() fails on rank 1 with no rank lost (as a full /dev/shm would),
    while the others wait for it in wrap()'s collectives."""

    def rebuild(self, old: pc.Communicator, new: pc.Communicator, failed: tuple[int, ...]) -> None:
        if new.rank == 1:
            raise pc.PyCollectivesError("test: cannot rebuild")


def _rebuild_fails(rank: int, world_size: int) -> str:
    comm = pc.init(timeout=30)
    m, opt = _model()
    model = _FailingRebuild(m, comm, **DDP)

    def loss_fn(ddp: torch.nn.Module, r: int, n: int) -> torch.Tensor:
        if r == 0:  # only here, the others wait in the all-reduce for this rank:
            # the step is dropped (revoked), nobody failed: a recovery on the same ranks
            raise pc.CollectiveTimeout("test: a timeout on rank 0 only")
        return _loss(ddp, torch.arange(3 * r, 3 * r + 3), 1.0)

    with pytest.raises(pc.PyCollectivesError, match="could not rebuild") as e:
        model.step(loss_fn, opt)
    model.comm.close()
    return str(e.value)


def test_a_rebuild_that_fails_with_no_rank_lost_raises_on_every_survivor():
    # Retrying would fail the same way: every rank raises, none loops. A rank
    # whose step or rebuild fails alone revokes: without, the others wait in a
    # collective for it past the agreement's timeout and are fenced out.
    msgs = run(_rebuild_fails, 3, timeout=90)
    assert all(f"rank {r}:" in m and "no rank failed" in m for r, m in enumerate(msgs)), msgs
    assert "cannot rebuild" in msgs[1], msgs
