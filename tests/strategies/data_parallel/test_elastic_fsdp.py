"""ElasticFSDP: 1 of 4 ranks is killed (SIGKILL) in the middle of a step of a
tiny GPT sharded with fully_shard per block and at the root, with buddy copies
of every rank's shard state (parameter shards and AdamW's state of them). The
survivors rebuild the lost shards from the buddy's copy, shard the model again
over 3 ranks, roll back to the copy's step and go on; after the remaining
steps their parameters equal, bit for bit, a reference that trained fully_shard
on 4 ranks up to that step, saved a checkpoint, and trained on the 3
survivors' layout (split, fully_shard again, the checkpoint loaded: the
project's any-layout re-sharding, independent of the recovery's) from there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from spawn import run
from test_elastic_sharded import TOTAL, _die, _gpt, _lists, _loss, _ranks  # its helpers
from zero_common import OPT, build

import pycollectives as pc
from pycollectives.strategies import checkpoint
from pycollectives.strategies.data_parallel import (
    ElasticFSDP,
    FSDPModule,
    fully_shard,
    fully_unshard,
)
from pycollectives.strategies.models.gpt import GPT


def _elastic(rank: int, world_size: int, every: int, victim: int, where: str) -> Any:
    comm = pc.init(timeout=30)
    model = _gpt()
    ef = ElasticFSDP(model, torch.optim.AdamW, comm, copy_every=every, **OPT)
    at = 3  # the victim dies in the step after 3 steps counted

    def due() -> bool:
        return rank == victim and ef.steps == at and ef.world_size == world_size

    if where == "backward":  # mid-backward: block 1's reduce-scatter is under way

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if due():
                _die()
            return grad

        model.blocks[0].mlp.fc.weight.register_hook(hook)
    elif where == "optimizer":  # the survivors step their pieces; they roll back
        assert ef.optimizer is not None
        ef.optimizer.register_step_post_hook(lambda *_: _die() if due() else None)
    while ef.steps < TOTAL:
        s = ef.steps
        ef.step(lambda m, r, n, s=s: _loss(m, s, r, n))
    assert isinstance(model, FSDPModule)
    out = (_lists(model.full_parameters()), ef.world_size, ef.recoveries, ef.copy.step)
    ef.comm.close()
    return out


def _train(model: torch.nn.Module, opt: Any, steps: range, comm: pc.Communicator) -> None:
    for s in steps:
        opt.zero_grad()
        _loss(model, s, comm.rank, comm.world_size).backward()
        opt.step()


def _reference(
    rank: int, world_size: int, switch: int, victim: int | tuple[int, ...], path: str
) -> Any:
    """fully_shard on every rank up to step `switch`, a checkpoint, then on the
    ranks but `victim` (a rank, or several: a host's, tests/multihost/)."""
    comm = pc.init(timeout=30)
    model, opt = build(comm, "fsdp", _gpt())
    _train(model, opt, range(switch), comm)
    checkpoint.save(path, comm, model, opt)
    sub = comm.split(None if rank in _ranks(victim) else 0, key=rank)
    if sub is None:
        return None
    model, opt = build(sub, "fsdp", _gpt(seed=1))  # the checkpoint must overwrite it all
    checkpoint.load(path, sub, model, opt)
    _train(model, opt, range(switch, TOTAL), sub)
    return _lists(model.full_parameters())


_references: dict[int, list] = {}


def survivors_reference(switch: int, path: str) -> list:
    """_reference's results of the 3 survivors, by their rank among them: the
    same whichever rank died (4 ranks train to `switch` and save; the
    survivors, in rank order, load and train on), so run once per switch for
    the cases that share it."""
    if switch not in _references:
        _references[switch] = run(_reference, 4, switch, 3, path, timeout=150)[:3]
    return _references[switch]


CASES = [  # copy_every, victim, where it dies, the step the survivors go on from
    pytest.param(1, 3, "backward", 3, id="k1-backward"),
    pytest.param(2, 0, "backward", 2, id="k2-backward-one-step-redone"),
    pytest.param(1, 1, "optimizer", 3, id="k1-optimizer-step"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("every", "victim", "where", "switch"), CASES)
def test_survivors_rebuild_the_lost_shards_and_match_the_survivors_layout_bitwise(
    tmp_path, every: int, victim: int, where: str, switch: int
):
    got = run(_elastic, 4, every, victim, where, timeout=150, expect_exit={victim: -9})
    want = survivors_reference(switch, str(tmp_path / "ck"))
    survivors = [r for r in range(4) if r != victim]
    for i, r in enumerate(survivors):
        params, size, recoveries, copied = got[r]
        assert size == 3 and len(recoveries) == 1, recoveries
        assert recoveries[0]["failed"] == (victim,), recoveries
        assert recoveries[0]["rolled_back_to"] == switch, recoveries
        assert copied == TOTAL - TOTAL % every, copied  # copies went on after the recovery
        assert params.keys() == want[i].keys()
        for name in params:
            assert params[name] == want[i][name], (r, name)
    # The parameters moved (the comparison is not of untrained models).
    assert got[survivors[0]][0] != _lists(dict(_gpt().named_parameters()))


def _unshard(rank: int, world_size: int) -> Any:
    comm = pc.init(timeout=30)
    model, opt = build(comm, "fsdp", _gpt())
    _train(model, opt, range(1), comm)
    full = model.full_parameters()
    out: dict[str, Any] = {}
    try:
        fully_unshard(model, {n: v for n, v in full.items() if n != "blocks.1.ln1.weight"})
    except ValueError as e:
        out["missing"] = str(e)
    out["still sharded"] = isinstance(model, FSDPModule)
    fully_unshard(model, full)
    params = dict(model.named_parameters())
    out["values"] = all(
        params[n].shape == v.shape and torch.equal(params[n].detach(), v) for n, v in full.items()
    )
    out["clean"] = (
        not any(isinstance(m, FSDPModule) or hasattr(m, "_sharding_unit") for m in model.modules())
        and type(model) is GPT
    )
    # Sharded again (as after a recovery), it trains as a fresh model holding these values.
    for block in model.blocks:
        fully_shard(block, comm)
    fully_shard(model, comm)
    _train(model, torch.optim.AdamW(model.parameters(), **OPT), range(1, 2), comm)
    fresh = _gpt(seed=1)
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(full[n])
    fresh, opt = build(comm, "fsdp", fresh)
    _train(fresh, opt, range(1, 2), comm)
    out["again"] = _lists(model.full_parameters())
    out["fresh"] = _lists(fresh.full_parameters())
    comm.close()
    return out


@pytest.mark.timeout(200)
def test_fully_unshard_gives_the_model_back_to_shard_again():
    got = run(_unshard, 2, timeout=150)
    for r in range(2):
        assert "'blocks.1.ln1.weight' has no value" in got[r]["missing"], got[r]
        assert got[r]["still sharded"], "a refused fully_unshard changed the model"
        assert got[r]["values"] and got[r]["clean"], got[r]
        assert got[r]["again"] == got[r]["fresh"]


def test_copy_every_must_be_a_positive_int():
    class Comm:
        rank = 0

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="copy_every"):
            ElasticFSDP(torch.nn.Linear(2, 2), torch.optim.SGD, Comm(), copy_every=bad, lr=0.1)
