"""The flooding attacker of test_multihost_security.py (tests/support/attacker.py)
on this machine's loopback, without namespaces: what the security tests wait for
comes whatever the listener does."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import paths


def test_ready_comes_when_a_flooded_port_has_closed(tmp_path):
    """A flooded port that closes (the parent's listener in
    test_a_flood_during_a_split_across_hosts_costs_it_nothing, found by the
    attacker's first scan when the ranks were up before it, closed once every
    connection was in): --ready waited for its garbage connections to send
    their bytes, which a closed port never takes, so --ready never came and
    the ranks that wait for it hung past the test's 150 s (fresh-clone CI).
    A target that refuses connections now counts as done."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]  # closed when the block ends: nothing listens there
    addr, ready, stop = tmp_path / "addr", tmp_path / "ready", tmp_path / "stop"
    addr.write_text(f"127.0.0.1:{port}")
    cmd = [sys.executable, str(paths.SUPPORT / "attacker.py"), "flood", "--target", f"file:{addr}",
           "--one", "127.0.0.1", "--many", "127.0.0.2,127.0.0.3", "--count", "20", "--ready",
           str(ready), "--stop", str(stop), "--wait-targets", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.touch()
        try:
            log = proc.communicate(timeout=30)[1]
        finally:
            proc.kill()
    assert ready.exists(), log
    assert f"flooding ('127.0.0.1', {port})" in log and proc.returncode == 0, log
