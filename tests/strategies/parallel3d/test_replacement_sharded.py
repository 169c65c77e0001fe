"""ElasticTrainer3D under Trainer3D's sharded data-parallel modes (--zero 1,
2, 3 and --fsdp; strategies/parallel3d/replacement.py, docs/recovery.md,
"Tensor and pipeline parallel grids"): each rank's buddy copy holds its
master shards (1/dp of its stage's tensor-parallel shard) and their AdamW
state, and a replacement receives its place's copy from the lost rank's
buddy.

One job of 4 ranks runs the cases one after another on the same processes
(one spawn for all): in each, one rank is SIGKILLed in the middle of a step
of a dp=2 x tp=2 or dp=2 x pp=2 grid, a process that waited for that case
joins in its place, every rank rolls back to the copy's step, and after the
last step every rank's full parameters (gathered over tp and dp) and loss
equal, bit for bit, those of an uninterrupted Trainer3D run of the same grid
and mode, which the same 4 processes (the newcomer among them) run next.
The last case loses a rank and its buddy at once under ZeRO-2: its shard is
on no other rank, and every rank, both newcomers included, raises
ReplacementFailed naming both, within seconds. Every run is bounded."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import pickle
import signal
import time
from typing import Any

import pytest
import torch
from spawn import run

import pycollectives as pc
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

STEPS = 4
CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, d_model=16, seed=5)
BASE = TrainOptions(microbatches=2, global_batch=8, dtype=torch.float64, timeout=60)
TP = {"dp": 2, "tp": 2, "pp": 1}
PP = {"dp": 2, "tp": 1, "pp": 2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    opts: dict[str, Any]
    grid: dict[str, int]
    victim: int  # the world rank killed
    where: str  # in its stage's first backward, or its stage's last block's forward
    at: int  # in this step
    every: int  # copy_every
    back_to: int  # the step every rank rolls back to


CASES = [
    Case("zero1-dp2-pp2", {"zero": 1}, PP, 1, "backward", 2, 1, 2),
    Case("zero2-dp2-tp2-k2", {"zero": 2}, TP, 2, "forward", 3, 2, 2),
    Case("zero3-dp2-tp2", {"zero": 3}, TP, 3, "forward", 2, 1, 2),
    Case("fsdp-dp2-tp2", {"fsdp": True}, TP, 1, "forward", 2, 1, 2),
    Case("fsdp-dp2-pp2", {"fsdp": True}, PP, 2, "forward", 1, 1, 1),
]
LOST = (1, 2)  # the last case: world rank 1 and its buddy, under ZeRO-2 on TP
PROCESSES = 4 + len(CASES) + len(LOST)  # process 4 + i waits for case i, the last two for LOST


def _expected_exits() -> dict[int, int]:
    """The processes SIGKILLed: each case's victim is whichever holds its rank then."""
    holder, out = list(range(4)), {}
    for i, case in enumerate(CASES):
        out[holder[case.victim]] = -9
        holder[case.victim] = 4 + i
    for r in LOST:
        out[holder[r]] = -9
    return out


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(et: ElasticTrainer3D, case: Case) -> None:
    due = lambda: et.steps == case.at  # noqa: E731
    if case.where == "backward":  # the first stage's tied embedding
        p = et.trainer.named_params[0][1]
        p.register_hook(lambda g: _die() if due() else g)
    else:  # the forward of its stage's last block (after the others' collectives began)
        block = [b for b in et.trainer.stages[0].blocks if isinstance(b, Block)][-1]
        block.register_forward_pre_hook(lambda m, a: _die() if due() else None)


def _start(store: Any, world: Any, i: int, opts: TrainOptions, grid: dict, every: int) -> Any:
    """Case i's ElasticTrainer3D: on the world's ranks, or (world None) a
    process that joins case i's recovery, waiting without polling until the
    case begins."""
    prefix = f"sharded-{i}"
    if world is None:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # as join warms up, beforehand
        store.wait([f"{prefix}/go"], datetime.timedelta(seconds=300))
        return ElasticTrainer3D.join(store, CONFIG, opts, copy_every=every, timeout=120,
                                     prefix=prefix, **grid)  # fmt: skip
    if world.rank == 0:
        store.set(f"{prefix}/go", "1")
    dims = ParallelDims(world, **grid)
    return ElasticTrainer3D(dims, CONFIG, opts, store, copy_every=every, prefix=prefix)


def _uninterrupted(world: Any, grid: dict, opts: TrainOptions) -> tuple[dict, float, dict]:
    with ParallelDims(world, **grid) as dims:
        trainer = Trainer3D(dims, CONFIG, opts)
        start = trainer.full_parameters()
        loss = [trainer.step().loss for _ in range(STEPS)][-1]
        return trainer.full_parameters(), loss, start


def _case(store: Any, world: Any, i: int, case: Case) -> tuple[Any, dict[str, Any]]:
    opts = dataclasses.replace(BASE, **case.opts)
    joined = world is None
    et = _start(store, world, i, opts, case.grid, case.every)
    if not joined and et.dims.world.rank == case.victim:
        _arm(et, case)
    committed = []
    while et.steps < STEPS:
        s = et.steps
        if et.step():
            committed.append(s)
    got, loss = et.trainer.full_parameters(), et.last.loss
    world = et.dims.world
    et.dims.close()
    want, want_loss, start = _uninterrupted(world, case.grid, opts)
    return world, {
        "rank": world.rank,
        "joined": joined,
        "names": (sorted(got), sorted(want)),
        "differ": [n for n in want if n in got and not torch.equal(got[n], want[n])],
        "moved": any(not torch.equal(want[n], start[n]) for n in want),
        "loss": (loss, want_loss),
        "recoveries": [{k: v for k, v in r.items() if not k.endswith("_s")} for r in et.recoveries],
        "committed": committed,
    }


def _lost(store: Any, world: Any) -> tuple[str, tuple[int, ...], float]:
    """A rank and its buddy killed between steps 1 and 2 under ZeRO-2. Returns
    the error, its ranks and (on a survivor) the seconds from the end of the
    last step that counted to the error; -1 on a newcomer."""
    opts, start = dataclasses.replace(BASE, zero=2), -1.0
    try:
        et = _start(store, world, len(CASES), opts, TP, 1)
        while et.steps < STEPS:
            if et.dims.world.rank in LOST and et.steps == 2:
                _die()
            if et.step():
                start = time.monotonic()  # the end of the last step that counted
    except ReplacementFailed as e:
        return str(e), e.failed, -1.0 if start < 0 else time.monotonic() - start
    return "no ReplacementFailed", (), -1.0


def _job(proc: int, world_size: int, port: int) -> dict[str, Any]:
    """Each case's results go to the store as they come (most processes are
    killed in a later case); process 0 (world rank 0 throughout, the store's
    server) returns them all. Every process returns its part in the last case."""
    import torch.distributed as dist

    t = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world_size, proc == 0, t, wait_for_workers=False)
    world = pc.init(proc, 4, store=store, timeout=30) if proc < 4 else None
    first = 0 if proc < 4 else proc - 4
    for i in range(first, len(CASES)):
        world, got = _case(store, world, i, CASES[i])
        store.set(f"result/{i}/{got['rank']}", pickle.dumps(got))
    out: dict[str, Any] = {"lost": _lost(store, world)}
    store.set(f"lost/{proc}", "1")
    if proc == 0:  # it serves the store: the newcomers may still read the survivors' refusal
        alive = set(range(PROCESSES)) - set(_expected_exits())
        store.wait([f"lost/{p}" for p in sorted(alive)], datetime.timedelta(seconds=60))
        keys = {c.name: [f"result/{i}/{w}" for w in range(4)] for i, c in enumerate(CASES)}
        out["cases"] = {
            name: [pickle.loads(store.get(k)) for k in ks if store.check([k])]
            for name, ks in keys.items()
        }
    return out


@functools.cache
def job() -> list[Any]:
    """Every process's results (None for those killed), run once for all the tests."""
    import spawn

    return run(_job, PROCESSES, spawn.free_port(), timeout=420, expect_exit=_expected_exits())


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_replacement_under_sharded_dp_state_matches_the_uninterrupted_run(case: Case):
    got = job()[0]["cases"][case.name]
    by_rank = {g["rank"]: g for g in got}
    assert sorted(by_rank) == [0, 1, 2, 3], [g["rank"] for g in got]
    assert [w for w, g in by_rank.items() if g["joined"]] == [case.victim], by_rank
    what = "FSDP" if case.opts.get("fsdp") else f"ZeRO-{case.opts['zero']}"
    for w, g in by_rank.items():
        names, want_names = g["names"]
        assert names == want_names and names, (w, names, want_names)
        assert g["differ"] == [], (w, g["differ"])
        assert g["loss"][0] == g["loss"][1], (w, g["loss"])
        assert g["moved"], "the parameters moved"
        if g["joined"]:  # the newcomer: it joined at the step rolled back to
            assert g["recoveries"] == [], g
            assert g["committed"] == list(range(case.back_to, STEPS)), g
            continue
        assert g["committed"] == list(range(case.at)) + list(range(case.back_to, STEPS)), g
        [rec] = g["recoveries"]
        assert rec["failed"] == (case.victim,) and rec["step"] == case.at, rec
        assert rec["rolled_back_to"] == case.back_to, rec
        assert rec["sources"] == {case.victim: ((case.victim + 1) % 4, "remote")}, rec
        assert rec["state"] == f"its {what} shard (parameters and AdamW state)", rec


@pytest.mark.timeout(480)
def test_a_rank_lost_with_its_buddy_under_sharded_state_fails_every_rank_naming_both():
    got = [r["lost"] for r in job() if r is not None]
    assert len(got) == 4, got  # world ranks 0 and 3, and the two newcomers
    assert sorted(took < 0 for _, _, took in got) == [False, False, True, True], got
    for msg, failed, took in got:
        assert failed == LOST, (failed, msg)
        assert (
            "the state of rank 1 (dp=0, tp=1, pp=0) is lost: its buddy rank 2 (dp=1, tp=0, "
            "pp=0) failed with it, and no other rank holds its shard" in msg
        ), msg
        assert took < 30.0, (took, msg)  # the communicator's timeout is 30 s: no rank waited it out


def _grid(replaced: tuple[int, ...]) -> ParallelDims:
    """A dp=2 x tp=2 x pp=2 ParallelDims of 8 ranks seen from rank 0, without
    communicators (sources() reads only its sizes and coordinates)."""
    dims = object.__new__(ParallelDims)
    dims.sizes = {"pp": 2, "dp": 2, "tp": 2}
    dims.world = type("World", (), {"world_size": 8, "rank": 0})()
    dims.replaced = replaced
    return dims


def test_a_sharded_newcomers_state_comes_from_its_buddy_only():
    """Sharded over dp, a dp replica holds another shard: no fallback to it."""
    assert sources(_grid((3,)), sharded=True) == {3: (4, "remote")}
    with pytest.raises(ReplacementFailed, match=r"rank 3 \(dp=1, tp=1, pp=0\) is lost: its "
                       r"buddy rank 4 \(dp=0, tp=0, pp=1\) failed with it, and no other") as info:  # fmt: skip
        sources(_grid((3, 4)), sharded=True)
    assert info.value.failed == (3, 4)
    # unsharded (zero=0), the dp replica's own copy serves
    assert sources(_grid((3, 4))) == {3: (1, "local"), 4: (5, "remote")}
