"""Shared fixtures: a pool of live ranks per world size (see spawn.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from spawn import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def pool():
    """pool(world_size) -> a healthy RankPool of that size (reused across tests)."""

    def get(world_size: int) -> RankPool:
        p = _pools.get(world_size)
        if p is None or not p.healthy:
            if p is not None:
                p.close()
            p = _pools[world_size] = RankPool(world_size)
        return p

    yield get
    for p in _pools.values():
        p.close()
    _pools.clear()
