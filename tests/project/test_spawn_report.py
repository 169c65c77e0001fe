"""What spawn.run (tests/support/spawn.py) reports of a rank that hangs: where
it was, so that a hang in CI explains itself."""

from __future__ import annotations

import time

import pytest
import spawn


def _stuck(rank: int, world_size: int) -> None:
    if rank == 1:
        while True:  # a wait that never ends
            time.sleep(0.05)


def test_a_hung_rank_is_reported_with_its_python_stack():
    with pytest.raises(spawn.RankError) as e:
        spawn.run(_stuck, 2, timeout=3)
    msg = str(e.value)
    assert "rank 1 hung past the timeout" in msg, msg
    assert "--- rank 1 (pid" in msg and "Python stacks ---" in msg, msg
    assert "in _stuck" in msg, msg  # the frame it was stuck in
    assert "--- rank 0 (pid" not in msg, msg  # rank 0 returned: no stack of it
