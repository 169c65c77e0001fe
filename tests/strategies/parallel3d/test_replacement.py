"""A replacement process takes a lost rank's place in a tp=2 x pp=2 grid
(strategies/parallel3d/replacement.py; docs/recovery.md): 1 of 4 ranks is
SIGKILLed in the middle of a step of Trainer3D's GPT (tensor-parallel blocks
in two pipeline stages), a fresh process that was never in the job joins,
receives the lost rank's stage shard and AdamW state from its buddy's copy,
every rank rolls back to the copy's step, and after the remaining steps every
rank's parameters equal, bit for bit, those of an uninterrupted run of the
same layout (same seeds, same batches). And: a newcomer that dies while it
joins fails every survivor with ReplacementFailed, within seconds; two ranks
of a dp=2 x tp=2 grid lost at once, one's state from its dp replica, match the
uninterrupted run too; a newcomer's state comes from its buddy, else a dp
replica, else a lost dp replica's buddy, else it is lost. Every run is bounded."""

from __future__ import annotations

import datetime
import functools
import os
import signal
import time
from typing import Any

import pytest
import torch
from spawn import run

import pycollectives as pc
from pycollectives.strategies.data_parallel.buddies import buddy_ranks
from pycollectives.strategies.models import GPTConfig
from pycollectives.strategies.models.gpt import Block
from pycollectives.strategies.parallel3d import (
    ElasticTrainer3D,
    ReplacementFailed,
    Trainer3D,
    TrainOptions,
)
from pycollectives.strategies.parallel3d.replacement import sources
from pycollectives.strategies.parallel_dims import ParallelDims

STEPS = 5
CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, d_model=16, seed=5)
OPTIONS = TrainOptions(microbatches=2, global_batch=8, dtype=torch.float64, timeout=60)
GRID = {"dp": 1, "tp": 2, "pp": 2}
NEWCOMER = 4  # the fifth process: not in the job until it joins


def _store(rank: int, port: int) -> Any:
    import torch.distributed as dist

    t = datetime.timedelta(seconds=60)
    return dist.TCPStore("127.0.0.1", port, 5, rank == 0, t, wait_for_workers=False)


def _params(trainer: Trainer3D) -> dict[str, list[float]]:
    """float64 to float is exact: bitwise comparable after the process exits."""
    return {n: p.detach().reshape(-1).tolist() for n, p in trainer.named_params}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _start(rank: int, port: int, every: int) -> ElasticTrainer3D:
    store = _store(rank, port)
    if rank == NEWCOMER:
        return ElasticTrainer3D.join(store, CONFIG, OPTIONS, copy_every=every, timeout=120, **GRID)
    comm = pc.init(rank, 4, store=store, timeout=30)
    return ElasticTrainer3D(ParallelDims(comm, **GRID), CONFIG, OPTIONS, store, copy_every=every)


def _elastic(rank: int, world_size: int, port: int, victim: int, where: str, at: int, every: int):
    et = _start(rank, port, every)
    if rank == victim:
        due = lambda: et.steps == at  # noqa: E731
        if where == "backward":  # the first stage's tied embedding: mid-backward
            p = et.trainer.named_params[0][1]
            p.register_hook(lambda g: _die() if due() else g)
        else:  # the forward of its stage's last block (after the others' tp all-reduces)
            block = [b for b in et.trainer.stages[0].blocks if isinstance(b, Block)][-1]
            block.register_forward_pre_hook(lambda m, a: _die() if due() else None)
    committed = []
    while et.steps < STEPS:
        s = et.steps
        if et.step():
            committed.append(s)
    out = (et.dims.world.rank, _params(et.trainer), et.recoveries, committed, et.last.loss)
    et.close()
    return out


def _reference(rank: int, world_size: int) -> Any:
    comm = pc.init(timeout=30)
    with ParallelDims(comm, **GRID) as dims:
        trainer = Trainer3D(dims, CONFIG, OPTIONS)
        start = _params(trainer)
        losses = [trainer.step().loss for _ in range(STEPS)]
        out = (_params(trainer), losses[-1], start)
    comm.close()
    return out


@functools.cache
def reference() -> list[Any]:
    """The uninterrupted run's results per rank, computed once for every case
    (the same layout, seeds and batches whoever dies)."""
    return run(_reference, 4, timeout=150)


CASES = [  # the victim, where it dies, in which step, copy_every, the step rolled back to
    pytest.param(1, "backward", 2, 1, 2, id="rank1-backward-k1"),
    pytest.param(3, "forward", 3, 2, 2, id="rank3-forward-k2"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("victim", "where", "at", "every", "back_to"), CASES)
def test_replacement_takes_the_lost_place_and_the_run_matches_the_uninterrupted_one(
    victim: int, where: str, at: int, every: int, back_to: int
):
    import spawn

    port = spawn.free_port()
    got = run(_elastic, 5, port, victim, where, at, every, timeout=200, expect_exit={victim: -9})
    want = reference()
    by_rank = {got[p][0]: got[p] for p in range(5) if p != victim}
    assert sorted(by_rank) == [0, 1, 2, 3], by_rank.keys()
    assert by_rank[victim] is got[NEWCOMER], "the newcomer took the lost rank's place"
    for w, (_, params, recoveries, committed, loss) in by_rank.items():
        assert params.keys() == want[w][0].keys(), w
        for name in params:
            assert params[name] == want[w][0][name], (w, name)
        assert loss == want[w][1], (w, loss, want[w][1])
        assert params != want[w][2], "the parameters moved"
        if w == victim:  # the newcomer: joined at the step rolled back to
            assert recoveries == [] and committed == list(range(back_to, STEPS)), committed
            continue
        assert committed == list(range(at)) + list(range(back_to, STEPS)), committed
        [rec] = recoveries
        assert rec["failed"] == (victim,) and rec["step"] == at, rec
        assert rec["rolled_back_to"] == back_to, rec
        assert rec["sources"] == {victim: ((victim + 1) % 4, "remote")}, rec


def _newcomer_dies(rank: int, world_size: int, port: int) -> Any:
    store = _store(rank, port)
    if rank == NEWCOMER:
        ParallelDims.join(store, timeout=120, **GRID)
        _die()  # in the grid, before the state moves
    comm = pc.init(rank, 4, store=store, timeout=30)
    et = ElasticTrainer3D(ParallelDims(comm, **GRID), CONFIG, OPTIONS, store)
    if rank == 2:
        p = et.trainer.named_params[0][1]
        p.register_hook(lambda g: _die() if et.steps == 1 else g)
    start = time.monotonic()
    with pytest.raises(ReplacementFailed) as info:
        while True:
            et.step()
            start = time.monotonic()  # the end of the last step that counted
    return str(info.value), info.value.failed, time.monotonic() - start


@pytest.mark.timeout(300)
def test_a_newcomer_that_dies_while_it_joins_fails_every_survivor():
    import spawn

    got = run(_newcomer_dies, 5, spawn.free_port(), timeout=200, expect_exit={2: -9, 4: -9})
    for r in (0, 1, 3):
        msg, failed, took = got[r]
        assert failed == (2,), got[r]
        assert f"rank {r}: the recovery from the loss of rank 2 (dp=0, tp=0, pp=1)" in msg, msg
        assert "in step 1 failed" in msg, msg
        assert took < 30.0, got[r]  # the communicator's timeout is 30 s: no rank waited it out


def _grid(replaced: tuple[int, ...]) -> ParallelDims:
    """A dp=2 x tp=2 x pp=2 ParallelDims of 8 ranks seen from rank 0, without
    communicators (sources() reads only its sizes and coordinates)."""
    dims = object.__new__(ParallelDims)
    dims.sizes = {"pp": 2, "dp": 2, "tp": 2}
    dims.world = type("World", (), {"world_size": 8, "rank": 0})()
    dims.replaced = replaced
    return dims


def test_a_newcomers_state_comes_from_its_buddy_else_a_dp_replica():
    assert sources(_grid((3,))) == {3: (4, "remote")}
    # rank 3's buddy (4) is replaced too: rank 3's dp replica, rank 1, sends its own copy
    assert sources(_grid((3, 4))) == {3: (1, "local"), 4: (5, "remote")}
    # rank 1's buddy (2) and its only dp replica (3) are gone, but 3's buddy (4) holds 3's
    # state, the same as 1's; rank 2's replica (0) sends its own
    assert sources(_grid((1, 2, 3))) == {1: (4, "remote"), 2: (0, "local"), 3: (4, "remote")}
    # ... and with 4 gone too, rank 1's state is lost
    with pytest.raises(RuntimeError, match=r"rank 1 \(dp=0, tp=1, pp=0\) is lost: its buddy rank 2 "
                       r"\(dp=1, tp=0, pp=0\) and every data-parallel replica failed with it, "
                       r"with their buddies"):  # fmt: skip
        sources(_grid((1, 2, 3, 4)))
    # Across hosts (2 x 4 ranks) the buddies are on the other host (buddies.py): host 0
    # lost whole, every rank's state comes from its buddy on host 1
    across = buddy_ranks([0, 0, 0, 0, 1, 1, 1, 1], "auto", "test")
    assert across == [4, 5, 6, 7, 0, 1, 2, 3]
    assert sources(_grid((0, 1, 2, 3)), across) == {r: (r + 4, "remote") for r in range(4)}


DP_GRID = {"dp": 2, "tp": 2, "pp": 1}


def _two_lost(rank: int, world_size: int, port: int) -> Any:
    """dp=2 x tp=2: ranks 1 and 2 die between steps 1 and 2; processes 4
    and 5 take their places. Rank 1's buddy is rank 2: its state comes from
    its dp replica, rank 3."""
    import torch.distributed as dist

    t = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 6, rank == 0, t, wait_for_workers=False)
    if rank >= 4:
        et = ElasticTrainer3D.join(store, CONFIG, OPTIONS, timeout=120, **DP_GRID)
    else:
        comm = pc.init(rank, 4, store=store, timeout=30)
        et = ElasticTrainer3D(ParallelDims(comm, **DP_GRID), CONFIG, OPTIONS, store)
    while et.steps < STEPS:
        if rank in (1, 2) and et.steps == 2:
            _die()
        et.step()
    out = (et.dims.world.rank, _params(et.trainer), et.recoveries)
    et.close()
    return out


def _dp_reference(rank: int, world_size: int) -> Any:
    comm = pc.init(timeout=30)
    with ParallelDims(comm, **DP_GRID) as dims:
        trainer = Trainer3D(dims, CONFIG, OPTIONS)
        for _ in range(STEPS):
            trainer.step()
        out = _params(trainer)
    comm.close()
    return out


@pytest.mark.timeout(400)
def test_two_newcomers_one_state_from_a_dp_replica_match_the_uninterrupted_run():
    import spawn

    got = run(_two_lost, 6, spawn.free_port(), timeout=200, expect_exit={1: -9, 2: -9})
    want = run(_dp_reference, 4, timeout=150)
    by_rank = {g[0]: g for p, g in enumerate(got) if p not in (1, 2)}
    assert sorted(by_rank) == [0, 1, 2, 3], by_rank.keys()
    for w, (_, params, recoveries) in by_rank.items():
        assert params == want[w], w
        if w in (0, 3):
            [rec] = recoveries
            assert rec["failed"] == (1, 2) and rec["rolled_back_to"] == 2, rec
            assert rec["sources"] == {1: (3, "local"), 2: (3, "remote")}, rec
