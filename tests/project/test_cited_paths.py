"""Every path of the repository that its text cites (README, docs, docstrings,
comments, scripts: `benchmarks/data_parallel/zero_step.py`, `csrc/transport/tcp/tcp_auth.h`)
names a file that exists, so a move cannot leave a stale pointer behind. The
records of past runs (docs/data/) keep the paths they were run with."""

from __future__ import annotations

import re
import subprocess

import paths
import pytest

ROOT = paths.ROOT
TOP = ("benchmarks", "tests", "examples", "strategies", "pycollectives", "csrc", "docs")
CITED = re.compile(
    r"(?<![\w/.])((?:" + "|".join(TOP) + r")/[\w/.-]*?\.(?:py|cc|cuh|cu|c|h|sh|md))(?!\w)"
)


def cited(text: str) -> list[str]:
    """The repository paths `text` cites."""
    return CITED.findall(text)


def test_the_pattern_finds_paths_and_only_paths():
    text = "see benchmarks/cuda/cuda_profile.py, `csrc/core/error.h` and tests/support/spawn.py's"
    assert cited(text) == [
        "benchmarks/cuda/cuda_profile.py",
        "csrc/core/error.h",
        "tests/support/spawn.py",
    ]
    assert cited("csrc/algo/ring.cc and docs/api.md#init, not my_docs/x.md") == [
        "csrc/algo/ring.cc",
        "docs/api.md",
    ]


def test_every_cited_path_exists():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no git here")
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    missing = {}
    for name in out.stdout.split():
        f = ROOT / name
        if name.startswith("docs/data/") or f.suffix in {".so", ".png", ".json", ".pt"}:
            continue
        try:
            text = f.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for p in cited(text):
            if not (ROOT / p).exists():
                missing.setdefault(p, []).append(name)
    assert not missing, "\n".join(f"{p}: cited by {', '.join(fs)}" for p, fs in missing.items())
