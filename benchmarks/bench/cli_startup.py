"""Start-up time of `import pycollectives` and `python -m pycollectives.bench --help`, this
revision against an older one (default af7917d, the last commit before the lazy imports).

Both revisions' `pycollectives/` folders are exported (git archive) into temporary directories
with this build's compiled `_C` copied beside them, and each command runs from its directory in a
fresh interpreter, old and new alternating, their order swapped every other round; `import torch`
is timed alongside as the reference. Prints the medians; writes docs/benchmarks.md unless
--no-write."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "import pycollectives": ["-c", "import pycollectives"],
    "python -m pycollectives.bench --help": ["-m", "pycollectives.bench", "--help"],
    "import torch": ["-c", "import torch"],  # the reference: what the old package paid
}


def export(rev: str, into: Path, extension: Path) -> None:
    """`rev`'s pycollectives/ under `into`, with the compiled extension `extension` beside it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "pycollectives"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.copy(extension, into / "pycollectives" / extension.name)


def seconds(args: list[str], cwd: Path) -> float:
    """Wall time of `python args` run in `cwd` (which comes first on its sys.path)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="af7917d", help="the revision to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import pycollectives

    extension = next(Path(pycollectives.__path__[0]).glob("_C*.so"))
    times: dict[tuple[str, str], list[float]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": Path(tmp, "old"), "new": Path(tmp, "new")}
        for side, rev in (("old", args.old), ("new", "HEAD")):
            trees[side].mkdir()
            export(rev, trees[side], extension)
        for rnd in range(args.rounds):
            sides = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
            for name, cmd in COMMANDS.items():
                for side in sides if "torch" not in name else ["new"]:
                    times.setdefault((name, side), []).append(seconds(cmd, trees[side]))
        load.append(os.getloadavg()[0])
    rows = ["| command | old (s) | new (s) | old / new |", "|---|---|---|---|"]
    for name in COMMANDS:
        new = statistics.median(times[(name, "new")])
        if (name, "old") in times:
            old = statistics.median(times[(name, "old")])
            rows.append(f"| `{name}` | {old:.3f} | {new:.3f} | {old / new:.1f} |")
        else:
            rows.append(f"| `{name}` (reference) | - | {new:.3f} | - |")
    emit_section(
        "<!-- cli_startup:begin -->",
        "<!-- cli_startup:end -->",
        "Start-up: `import pycollectives` and `pycollectives-bench --help`",
        f"`python benchmarks/bench/cli_startup.py --old {args.old} --rounds {args.rounds}`",
        [
            f"Old: {args.old} (the package imported torch, through its core and the "
            "backend's registration); new: HEAD (torch imported by the first name that needs it, "
            "the backend registered once torch is imported; the bench's flags checked first)",
            f"Medians of {args.rounds} fresh interpreters per cell, old and new alternating; "
            f"page cache warm (a cold disk adds seconds to torch); load {load[0]:.1f} -> "
            f"{load[1]:.1f}",
        ],
        ["\n".join(rows)],
        not args.no_write,
    )


if __name__ == "__main__":
    main()
