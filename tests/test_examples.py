"""The README's example runs under torchrun (it checks its own results)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_allreduce_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "allreduce.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "world 2: all_reduce 1.0" in p.stdout, p.stdout
    assert "failed to bind" not in p.stderr, p.stderr


def test_ddp_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "ddp_train.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("parameters identical on all ranks: True") == 2, p.stdout


def test_windows_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           str(ROOT / "examples" / "windows.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    want = "world 3: window tensors: all_reduce: direct, reduce_scatter: direct, all_gather: direct"
    assert want in lines, p.stdout
    plain = next((ln for ln in lines if ln.startswith("world 3: plain tensors:")), "")
    assert plain and "direct" not in plain, p.stdout
