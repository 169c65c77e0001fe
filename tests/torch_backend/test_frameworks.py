"""The "pycoll" backend under the frameworks people train with: PyTorch
Lightning (Trainer and Fabric with DDPStrategy(process_group_backend="pycoll"))
and Hugging Face accelerate (the group initialized before Accelerator(cpu=True)).

Each test runs the framework's example of examples/frameworks/: it trains a
tiny model on 2 CPU ranks under torchrun with gloo, then with pycoll, and
fails unless every rank of both runs ends with the same parameters, bit for
bit (2 ranks: every sum is a + b on both backends). Skipped when the framework
is not installed: `pip install -e ".[frameworks]"` installs them.

The driver is the examples' own (_compare.drive, which `python <example>`
calls), run as `python _compare.py <example>`: a driver that imports the
example imports its framework too, which it never uses (Lightning: ~8 s of
CPU a test); the ranks run the example itself.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import paths
import pytest

ROOT = paths.ROOT
EXAMPLES = ROOT / "examples" / "frameworks"


def _needs(module: str, pip: str) -> pytest.MarkDecorator:
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(
        missing, reason=f"{module} is not installed: pip install {pip} (or '.[frameworks]')"
    )


def _run_example(name: str) -> None:
    cmd = [sys.executable, str(EXAMPLES / "_compare.py"), str(EXAMPLES / name)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{name} exited {p.returncode}\n{p.stdout[-4000:]}{p.stderr[-6000:]}"
    assert "pycoll and gloo trained the same parameters on 2 ranks" in p.stdout, p.stdout


@_needs("lightning", "lightning")
@pytest.mark.timeout(300)
def test_lightning_trainer_ddp_matches_gloo() -> None:
    _run_example("lightning_trainer.py")


@_needs("lightning", "lightning")
@pytest.mark.timeout(300)
def test_lightning_fabric_ddp_matches_gloo() -> None:
    _run_example("lightning_fabric.py")


@_needs("accelerate", "accelerate")
@pytest.mark.timeout(300)
def test_accelerate_ddp_matches_gloo() -> None:
    _run_example("accelerate_ddp.py")
