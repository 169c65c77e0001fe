"""benchmarks/data_parallel/zero_step.py's options and its cells in ranks of their own (--isolate, as
--device cuda runs them), on the CPU: a cell that fails or passes --cell-timeout is reported
in the table as "not run: <why>" and the other cells still run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import paths
import pytest
import torch

pytest.importorskip("pycollectives", reason="pycollectives (and its extension) cannot be imported")

ROOT = str(paths.ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "data_parallel"))
import zero_step  # noqa: E402 - benchmarks/data_parallel/zero_step.py

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8"]
TINY += ["--rounds", "1", "--warmup", "1", "--steps", "1", "--no-write"]


def run(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """zero_step.py with these flags, from the repository's root; fails the test on a timeout."""
    script = os.path.join(ROOT, "benchmarks", "data_parallel", "zero_step.py")
    return subprocess.run(
        [sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows of setups: {label: its cells after the label}."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| setup"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


@pytest.mark.timeout(300)
def test_a_failing_cell_is_reported_and_the_others_run():
    """fsdp2-nccl fails on the CPU (no NCCL here, or no CUDA tensors for it): its row says
    "not run: rank r: <error>", and the cells before and after it give step times."""
    p = run(*TINY, "--isolate", "--cells", "compute,fsdp2-nccl,zero3")
    assert p.returncode == 0, p.stdout + p.stderr
    got = rows(p.stdout)
    nccl = got[zero_step.LABELS["fsdp2-nccl"]]
    assert re.fullmatch(r"not run: rank \d: \w+: .+", nccl[0]), nccl
    assert all(c == "" for c in nccl[1:]), nccl
    for cell in ("compute", "zero3"):
        step = got[zero_step.LABELS[cell]][0]
        assert re.fullmatch(r"\d+", step), (cell, got)
    assert "fsdp2-nccl: not run: rank" in p.stderr, p.stderr


@pytest.mark.timeout(120)
def test_a_cell_past_its_timeout_is_reported_not_waited_for():
    """--cell-timeout 0.5 (less than a rank takes to start): every cell is "not run" with the
    timeout, and the script still ends with its table."""
    p = run(*TINY, "--isolate", "--cell-timeout", "0.5", "--cells", "compute,dp", timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    got = rows(p.stdout)
    for cell in ("compute", "dp"):
        assert got[zero_step.LABELS[cell]][0] == "not run: rank_isolated: no result after 0.5 s"


def test_options(capsys):
    """--preset h100's defaults (an explicit flag wins), the device's cells by default, and
    the refusals (main()'s parse(), in process; the two tests above run the script): --device
    cuda without a GPU, fsdp2-nccl on the CPU in shared ranks."""
    a = zero_step.parse(["--preset", "h100", "--device", "cpu", "--isolate", "--batch", "4"])
    assert (a.device, a.batch, a.rounds, a.warmup, a.steps) == ("cpu", 4, 1, 2, 5)
    assert a.cell_timeout == 60
    assert a.cells == zero_step.PRESETS["h100"]["cells"].split(",")
    a = zero_step.parse([])
    assert a.device == "cpu" and a.cells == zero_step.CPU_CELLS.split(",")
    assert "fsdp2-nccl" not in a.cells
    assert zero_step.parse(["--cells", "zero3,fsdp"]).cells == ["zero3", "fsdp"]
    with pytest.raises(SystemExit) as e:
        zero_step.parse([*TINY, "--cells", "compute,fsdp2-nccl"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "needs --device cuda" in err, err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            zero_step.parse([*TINY, "--device", "cuda"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--device cuda: torch sees no CUDA device" in err, err


def test_verdicts_are_the_median_of_the_rounds_with_their_spread():
    """A target's ratio is the median over rounds of the paired ratios; its verdict line
    gives their range and how many rounds met the target (exact, synthetic rounds)."""
    m = {
        "zero1": {"rounds": [1.0, 1.2, 0.9]},
        "dp": {"rounds": [1.0, 1.0, 1.0]},
        "zero3": {"rounds": [0.8, 1.0, 0.85]},
        "fsdp2-pycoll": {"rounds": [1.0, 1.0, 1.0]},
    }
    assert zero_step.paired(m, "zero1", "dp") == pytest.approx(1.0)
    assert zero_step.spread(m, "zero1", "dp") == " (rounds 0.90-1.20, 2 of 3 within the target)"
    assert zero_step.spread(m, "zero3", "fsdp2-pycoll") == (
        " (rounds 0.80-1.00, 2 of 3 within the target)"
    )
    got = {(a, b): ok for a, b, _, ok in zero_step.targets(m)}
    assert got == {("zero1", "dp"): True, ("zero3", "fsdp2-pycoll"): True}, got
    assert zero_step.spread({"a": {"rounds": [1.0]}, "dp": {"rounds": [1.0]}}, "a", "dp") == ""
