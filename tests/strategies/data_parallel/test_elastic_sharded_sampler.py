"""The ElasticSampler under buddy copies (elastic_sharded.py): with
copy_every=2 a rank lost in step 3 rolls the survivors back to the copy of
step 2, and the sampler with it (its cursor and ledger), so step 2 is taken
again from the same samples, re-split over the 3 survivors. The ledger, the
same on every survivor, holds every sample of epoch 0 exactly once and none of
epoch 1 twice, and each survivor fed exactly its shares of the committed
steps. ElasticFSDP (fully_shard per block and at the root) on a tiny GPT."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from spawn import run
from test_elastic_sharded import _die, _gpt  # its helpers
from zero_common import DATA, OPT

import pycollectives as pc
from pycollectives.strategies.data import ElasticSampler
from pycollectives.strategies.data_parallel import ElasticFSDP

NUM, BATCH, TOTAL, VICTIM, AT = 36, 12, 5, 3, 3  # epoch 0: steps 0-2


def _train(rank: int, world_size: int) -> Any:
    comm = pc.init(timeout=30)
    model = _gpt()
    sampler = ElasticSampler(NUM, global_batch_size=BATCH, seed=2)
    ef = ElasticFSDP(model, torch.optim.AdamW, comm, copy_every=2, sampler=sampler, **OPT)

    def hook(grad: torch.Tensor) -> torch.Tensor:  # mid-backward of step 3
        if rank == VICTIM and ef.steps == AT:
            _die()
        return grad

    model.blocks[0].mlp.fc.weight.register_hook(hook)
    fed: dict[int, list[int]] = {}  # step -> the ids this rank fed in its last try

    def loss_fn(m: torch.nn.Module, r: int, n: int) -> torch.Tensor:
        ids = sampler.ids(r, n)
        fed[ef.steps] = ids.tolist()
        return m(*DATA.batch(ids))

    while ef.steps < TOTAL:
        ef.step(loss_fn)
    ledger = [(e.epoch, e.step, [s.tolist() for s in e.shares]) for e in sampler.ledger]
    recoveries = [(r["step"], r["rolled_back_to"], r["failed"]) for r in ef.recoveries]
    out = {"ledger": ledger, "fed": fed, "rank": ef.rank, "recoveries": recoveries}
    ef.comm.close()
    return out


@pytest.mark.timeout(200)
def test_the_sampler_rolls_back_with_the_copy_and_every_sample_is_seen_once():
    got = run(_train, 4, timeout=150, expect_exit={VICTIM: -9})[:VICTIM]
    ledger = got[0]["ledger"]
    for g in got:
        assert g["recoveries"] == [(AT, 2, (VICTIM,))], g["recoveries"]
        assert g["ledger"] == ledger
    # Steps 0, 1 on 4 ranks; step 2 (committed, then rolled back) and on, on 3.
    assert [(e, s, len(shares)) for e, s, shares in ledger] == [
        (0, 0, 4), (0, 1, 4), (0, 2, 3), (1, 3, 3), (1, 4, 3)
    ]  # fmt: skip
    for epoch in (0, 1):
        ids = [i for e, _, shares in ledger if e == epoch for s in shares for i in s]
        assert len(ids) == len(set(ids)), (epoch, ids)
        if epoch == 0:
            assert sorted(ids) == list(range(NUM))
    for r, g in enumerate(got):  # each survivor fed its shares (ranks 0-2 keep their ranks)
        assert g["rank"] == r
        assert [g["fed"][s] for s in range(TOTAL)] == [shares[r] for _, _, shares in ledger], r
