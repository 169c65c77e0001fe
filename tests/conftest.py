"""Shared fixtures: a pool of live ranks per world size (see spawn.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from spawn import RankPool  # noqa: E402

_pools: dict[tuple, RankPool] = {}


@pytest.fixture(scope="session")
def pool():
    """pool(world_size, env=None) -> a healthy RankPool of that size whose ranks
    run with `env` added to their environment (reused across tests)."""

    def get(world_size: int, env: dict[str, str] | None = None) -> RankPool:
        key = (world_size, tuple(sorted((env or {}).items())))
        p = _pools.get(key)
        if p is None or not p.healthy:
            if p is not None:
                p.close()
            p = _pools[key] = RankPool(world_size, env)
        return p

    yield get
    for p in _pools.values():
        p.close()
    _pools.clear()
