"""PYCOLL_BIND=core: init() pins each local rank to its own CPU when they fit one
per CPU, leaves them unpinned otherwise, and rejects other values by name."""

from __future__ import annotations

import os

import pytest
import torch
from spawn import RankError, run

import pycollectives as pc


def _affinity(rank: int, world_size: int) -> list[int]:
    before = sorted(os.sched_getaffinity(0))
    comm = pc.init()
    x = torch.ones(4)
    comm.all_reduce(x)
    assert torch.all(x == world_size)
    comm.close()
    return [before, sorted(os.sched_getaffinity(0))]


def test_bind_core_pins_each_rank_to_its_own_cpu():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    out = run(_affinity, 2, env={"PYCOLL_BIND": "core"}, timeout=60)
    assert [after for _, after in out] == [[cpus[0]], [cpus[1]]]


def test_bind_core_leaves_more_ranks_than_cpus_unpinned():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 3:
        pytest.skip("needs at most 3 CPUs")
    out = run(_affinity, len(cpus) + 1, env={"PYCOLL_BIND": "core"}, timeout=60)
    assert all(after == before for before, after in out)


def test_bind_unset_changes_nothing():
    out = run(_affinity, 2, timeout=60)
    assert all(after == before for before, after in out)


def test_bind_bad_value_names_the_variable():
    with pytest.raises(RankError, match=r"rank 0: init: PYCOLL_BIND must be none or core"):
        run(_affinity, 1, env={"PYCOLL_BIND": "numa"}, timeout=60)
