"""Shared fixtures: a pool of live ranks per world size (support/spawn.py).

tests/ mirrors the source tree (core/, cuda/, multihost/, strategies/<part>/,
...); support/ holds the helpers (no tests). Every folder goes on sys.path,
support/ first: the helpers import by name, and a test may reuse another
folder's jobs (multihost/ runs core/'s collectives across hosts), whichever
files pytest was asked to run. The ranks inherit this sys.path."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "support")] + sorted(
    root
    for root, _, files in os.walk(_HERE)
    if "__pycache__" not in root
    and root != _HERE
    and "support" not in root
    and any(f.startswith("test_") for f in files)
)

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
