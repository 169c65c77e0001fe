"""What checking a checkpoint costs (strategies/checkpoint/validate.py):
load() and consolidate() of checkpoint_consolidate.py's ~30M-parameter GPT
(ZeRO-3 on 4 ranks, AdamW: 4 files, 337 MiB), timed with the current code
and with the code of a git ref from before the validator, paired and
alternating, in one process (comm=None), files in the page cache.

    python benchmarks/checkpoint/checkpoint_validate.py [--ref 18bb03a] [--repeats 7] [--no-write]

Rows: the checks alone (index.json and every file's header: Checkpoint()
and file()), load() into a plain GPT with torch AdamW, consolidate() to a
file (written beside the checkpoint, removed untimed after each run).
Medians and the ratio of medians.
Rewrites the section of docs/benchmarks.md between the validator markers.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section  # noqa: E402
from checkpoint_consolidate import CFG, launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- checkpoint_validate:begin -->", "<!-- checkpoint_validate:end -->"


def _old_package(ref: str, where: Path) -> Any:
    """strategies/checkpoint as of `ref`, imported as pycollectives.strategies.checkpoint_ref
    (its relative imports reach today's sharding package)."""
    import pycollectives.strategies as strategies

    pkg = where / "checkpoint_ref"
    pkg.mkdir(parents=True)
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:strategies/checkpoint"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for n in names:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:strategies/checkpoint/{n}"],
            capture_output=True,
            check=True,
        ).stdout
        (pkg / n).write_bytes(blob)
    strategies.__path__.append(str(where))
    return importlib.import_module("pycollectives.strategies.checkpoint_ref")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="18bb03a", help="git ref of the code before the validator")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from pycollectives.strategies import checkpoint as new
    from pycollectives.strategies.checkpoint.validate import Checkpoint
    from pycollectives.strategies.models.gpt import GPT, GPTConfig

    scratch = Path(tempfile.mkdtemp(prefix="ckpt-validate-"))
    try:
        src = scratch / "zero3-n4"
        launch(4, "save", str(src))
        old = _old_package(args.ref, scratch / "old")
        model = GPT(GPTConfig(**CFG))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def checks() -> None:
            with Checkpoint(src) as ck:
                for f in ck.index["files"]:
                    ck.file(f)

        old_format = importlib.import_module("pycollectives.strategies.checkpoint_ref.format")

        def old_checks() -> None:
            for f in old.read_index(src)["files"]:
                old_format.read_header(src / f)

        runs = {
            "index and headers read": (old_checks, checks),
            "load() into a plain GPT + AdamW": (
                lambda: old.load(src, None, model, opt),
                lambda: new.load(src, None, model, opt),
            ),
            "consolidate()": (
                lambda: old.consolidate(src, scratch / "out.safetensors"),
                lambda: new.consolidate(src, scratch / "out.safetensors"),
            ),
        }
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
        for r in range(args.repeats):
            for k, (a, b) in runs.items():
                order = [(0, a), (1, b)] if r % 2 == 0 else [(1, b), (0, a)]
                for i, fn in order:
                    t = time.perf_counter()
                    fn()
                    times[k][i].append(time.perf_counter() - t)
                    # untimed: the next rename then replaces nothing (unlinking 337 MiB is not
                    # consolidation's work)
                    (scratch / "out.safetensors").unlink(missing_ok=True)
        files = len(new.read_index(src)["files"])
        pieces = len(new.read_index(src)["pieces"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table = [
        f"| operation | before ({args.ref}) | with the validator | ratio |",
        "|---|---:|---:|---:|",
    ]
    for k, (a, b) in times.items():
        ma, mb = statistics.median(a), statistics.median(b)
        table.append(f"| {k} | {ma * 1e3:.1f} ms | {mb * 1e3:.1f} ms | {mb / ma:.2f}x |")
    load = Path("/proc/loadavg").read_text().split()[:3]
    notes = [
        f"Checkpoint: GPT {CFG} + AdamW saved by ZeRO-3 on 4 ranks ({files} files, "
        f"{pieces} pieces, 337 MiB); read by one process (comm=None), page cache warm",
        f"Medians of {args.repeats} runs each, before and after alternating; load average "
        f"{' '.join(load)} at the end",
        "Before: the index and the headers read without checks; `index and headers read` "
        "is the validator's whole work (Checkpoint() and file() of every file) against "
        "read_index and read_header of every file before",
    ]
    emit_section(
        BEGIN,
        END,
        "Checkpoints: the cost of validating untrusted files",
        "`python benchmarks/checkpoint/checkpoint_validate.py`",
        notes,
        table,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
