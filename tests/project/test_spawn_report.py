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


def test_a_rank_hung_before_arming_its_dump_is_still_reported(tmp_path):
    """stacks_of on a live rank with no stack file (hung in its start-up, before
    _arm_stack_dump): the report says so instead of raising FileNotFoundError
    over the timeout it reports."""
    import subprocess
    from types import SimpleNamespace

    sleeper = subprocess.Popen(["sleep", "30"])  # the "rank": SIGUSR1 ends it
    try:
        procs = [SimpleNamespace(exitcode=None, pid=sleeper.pid)]
        out = spawn.stacks_of(procs, [0], str(tmp_path))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert f"--- rank 0 (pid {sleeper.pid}): Python stacks ---" in out, out
    assert "hung before arming its dump" in out, out
