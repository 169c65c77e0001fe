"""ElasticTrainer (train_gpt.py --survive's data-parallel trainer): rank 2
dies in the backward of step 1, and rank 1 while the survivors rebuild, so they
shrink twice in one recovery (4 -> 3 -> 2). The survivors map their ranks to
the original ones through the whole recovery (the survivors of each shrink,
not the last shrink's parent ranks alone: those would name ranks 0 and 2), the
recovery's line names both lost ranks, and the run goes on to the last step."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from spawn import run

import pycollectives as pc
from pycollectives.strategies.models import GPTConfig
from pycollectives.strategies.parallel3d import TrainOptions
from pycollectives.strategies.parallel3d.elastic_trainer import ElasticTrainer

CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, seed=3)
OPTIONS = TrainOptions(microbatches=2, global_batch=12, timeout=30)
STEPS = 3


def _train(rank: int, world_size: int) -> Any:
    comm = pc.init(timeout=30)
    trainer = ElasticTrainer(comm, CONFIG, OPTIONS, kills=((2, 1),))
    if rank == 1:  # dies in the rebuild of the first recovery, after the first shrink
        trainer.elastic.rebuild = lambda old, new, failed: os.kill(os.getpid(), signal.SIGKILL)
    lines, losses = [], []
    while trainer.step_index < STEPS:
        stats = trainer.step()
        lines += [r.line() for r in stats.recoveries]
        losses.append(stats.loss)
    out = (trainer.world_ranks, lines, losses, trainer.comm.world_size, trainer.comm.parent_ranks)
    trainer.close()
    return out


@pytest.mark.timeout(200)
def test_a_second_death_during_the_recovery_maps_the_survivors_to_their_original_ranks():
    got = run(_train, 4, timeout=150, expect_exit={1: -9, 2: -9})
    for r in (0, 3):
        world_ranks, lines, losses, size, parents = got[r]
        assert world_ranks == [0, 3] and size == 2, got[r]
        assert parents == (0, 2), parents  # the second shrink's: of ranks 0, 1, 3, not 0-3
        assert len(lines) == 1 and lines[0].startswith("ranks 1, 2 died at step 1: 2 ranks go on")
        assert lines[0].endswith("the step is retried)"), lines
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    assert got[0][2] == got[3][2]  # the same global loss on both
