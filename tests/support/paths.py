"""Where things are, for a test wherever it sits under tests/: the
repository's root, its benchmarks, and this folder of shared helpers."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
BENCH = ROOT / "benchmarks"
