"""benchmarks/multihost/multihost_ab.py's settings (--old-env / --new-env NAME=VALUE):
parsed into each side's environment, and a malformed one refused by name
before any host is made."""

from __future__ import annotations

import os
import subprocess
import sys

import paths
import pytest

ROOT = paths.ROOT
sys.path.insert(0, str(ROOT / "benchmarks" / "multihost"))

import multihost_ab  # noqa: E402


def test_parse_env_takes_name_value_pairs():
    got = multihost_ab.parse_env(["PYCOLL_NSLOTS=8", "PYCOLL_SOCKET_BUFFER=", "A=b=c"], "--new-env")
    assert got == {"PYCOLL_NSLOTS": "8", "PYCOLL_SOCKET_BUFFER": "", "A": "b=c"}


@pytest.mark.parametrize("bad", ["PYCOLL_NSLOTS", "=8"])
def test_parse_env_refuses_an_item_without_a_name_or_value(bad):
    with pytest.raises(SystemExit, match=f"--old-env takes NAME=VALUE, not '{bad}'"):
        multihost_ab.parse_env([bad], "--old-env")


def test_bad_setting_fails_before_any_host_is_made():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/multihost/multihost_ab.py",
            "--new-env",
            "NOEQUALS",
            "--no-write",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "--new-env takes NAME=VALUE, not 'NOEQUALS'" in out.stderr, out.stderr
