"""ElasticSampler (strategies/data.py): the epoch's sample order consumed by a
data-parallel size that changes between steps, with dropped steps retried;
its ledger holds every sample of an epoch exactly once. One process: the
multi-rank runs are in test_elastic.py."""

from __future__ import annotations

import random

import pytest
import torch

from pycollectives.strategies.data import ElasticSampler, GlobalBatches


def _walk(sampler: ElasticSampler, steps: int, seed: int) -> None:
    """Runs `steps` committed steps on sizes that shrink at random, some tries
    dropped (their ids asked for, never committed)."""
    rng = random.Random(seed)
    size = 8
    while sampler.steps < steps:
        shares = [sampler.ids(r, size) for r in range(size)]
        assert torch.equal(torch.cat(shares), sampler.global_ids(size))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        if rng.random() < 0.3 and size > 1:  # a rank died in this step: dropped, retried smaller
            size -= rng.randint(1, min(3, size - 1))
            continue
        entry = sampler.commit(size)
        assert [s.tolist() for s in entry.shares] == [s.tolist() for s in shares]


@pytest.mark.parametrize("batch", [{"local_batch_size": 3}, {"global_batch_size": 20}])
def test_every_sample_of_each_epoch_once_whatever_the_sizes(batch):
    sampler = ElasticSampler(50, seed=4, **batch)
    _walk(sampler, 40, seed=1)
    assert sampler.epoch >= 2
    for epoch in range(sampler.epoch):
        assert sorted(sampler.consumed(epoch).tolist()) == list(range(50)), epoch
        # In the order GlobalBatches visits them.
        assert torch.equal(
            sampler.consumed(epoch), GlobalBatches(50, 10, seed=4).permutation(epoch)
        )
        by_rank = [sampler.consumed(epoch, r) for r in range(8)]
        assert sorted(torch.cat(by_rank).tolist()) == list(range(50))
    if "global_batch_size" in batch:  # the global batch is kept, re-split; the epoch ends short
        sizes = [sum(map(len, e.shares)) for e in sampler.ledger if e.epoch == 0]
        assert sizes == [20, 20, 10], sizes


def test_local_batch_size_shrinks_the_step_and_the_epoch_ends_short():
    s = ElasticSampler(10, local_batch_size=2)
    assert len(s.global_ids(4)) == 8 and s.scale(4) == 0.5
    s.commit(4)
    # Two samples left for 3 ranks: shares of 0, 1 and 1; the loss scale makes
    # DDP's average the mean over the 2.
    assert [len(s.ids(r, 3)) for r in range(3)] == [0, 1, 1] and s.scale(3) == 1.5
    s.commit(3)
    assert (s.epoch, s.position, s.steps) == (1, 0, 2)
    assert sorted(s.consumed(0).tolist()) == list(range(10))


def test_state_dict_resumes_and_refuses_what_is_not_a_cursor():
    s = ElasticSampler(10, global_batch_size=4)
    s.commit(2)
    t = ElasticSampler(10, global_batch_size=4)
    t.load_state_dict(s.state_dict())
    assert torch.equal(t.ids(1, 2), s.ids(1, 2))
    for bad in ({"epoch": 0, "position": 10, "steps": 1}, {"epoch": -1, "position": 0, "steps": 0},
                {"epoch": 0, "position": 0}, [0, 0, 0], {"epoch": True, "position": 0, "steps": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="not a cursor"):
            t.load_state_dict(bad)


def test_rewind_drops_the_later_steps_and_takes_their_samples_again():
    """rewind(an earlier state_dict()): the steps committed since leave the ledger and
    the next steps take the same samples again (here re-split over fewer ranks)."""
    s = ElasticSampler(12, global_batch_size=4)
    s.commit(4)
    mark = s.state_dict()
    redo = s.global_ids(4).clone()
    s.commit(4)
    s.commit(4)
    s.rewind(mark)
    assert [e.step for e in s.ledger] == [0] and s.state_dict() == mark
    assert torch.equal(s.global_ids(3), redo)
    s.commit(3)
    s.commit(3)
    assert sorted(s.consumed(0).tolist()) == list(range(12))  # each sample once
    with pytest.raises(ValueError, match="not a cursor"):
        s.rewind({"epoch": 0})


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="exactly one of the batch sizes"):
        ElasticSampler(10)
    with pytest.raises(ValueError, match="exactly one of the batch sizes"):
        ElasticSampler(10, global_batch_size=4, local_batch_size=2)
    with pytest.raises(ValueError, match="num_samples=0"):
        ElasticSampler(0, global_batch_size=4)
    s = ElasticSampler(10, global_batch_size=4)
    with pytest.raises(ValueError, match=r"ids: rank=2, world_size=2"):
        s.ids(2, 2)
    with pytest.raises(ValueError, match=r"global_ids: rank=0, world_size=0"):
        s.global_ids(0)
