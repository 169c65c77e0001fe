"""Prints, one per line, every example command README.md shows (in code blocks
and inline code): `python examples/...`, `torchrun ... examples/...` and
`python -m ...`, and a code block's `pycollectives-bench ... --json FILE` (the
file a later line reads), in the README's order, as CI runs them from the clone's root
after the quick start. Training examples get few steps (a later --steps wins
in argparse). Left out: multi-host lines (--nnodes: two hosts),
`python -m pytest` (CI runs the tests itself) and, without a GPU, the CUDA
example (`--gpu` says there is one).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FEW_STEPS = {"examples/train_gpt.py": "--steps 2", "examples/zero_train.py": "--steps 3"}


def commands(readme: str, gpu: bool) -> list[str]:
    """The README's example commands (see the module docstring)."""
    found: list[str] = []
    own: set[str] = set()  # the project's commands, taken from code blocks only
    in_block = False
    for line in readme.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            found.append(line.split("  #", 1)[0].strip())
            if found[-1].startswith("pycollectives-bench ") and " --json " in found[-1]:
                own.add(" ".join(found[-1].split()))
        else:
            found += re.findall(r"`([^`]+)`", line)
    out = []
    for cmd in found:
        cmd = " ".join(cmd.split())
        ok = (
            (re.match(r"(python examples/|torchrun .*examples/|python -m )", cmd) or cmd in own)
            and "--nnodes" not in cmd
            and not cmd.startswith("python -m pytest")
            and (gpu or "cuda" not in cmd)
        )
        if not ok:
            continue
        for script, steps in FEW_STEPS.items():
            if script in cmd:
                cmd += " " + steps
        out.append(cmd)
    return out


if __name__ == "__main__":
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    print("\n".join(commands(text, gpu="--gpu" in sys.argv[1:])))
