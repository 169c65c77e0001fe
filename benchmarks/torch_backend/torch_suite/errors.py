"""The key lines of a test's error text: per distinct rank error, its exception and where it
was raised (the frames in the suite and in the backend), or where the ranks were stuck when
torch's timeout expired."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .config import BENCH


def _outside(path: str) -> bool:
    """A source file outside the Python installation and this runner: the backend's."""
    return path.startswith("/") and not path.startswith((sys.prefix, str(BENCH)))


_PROC_BLOCK = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def _exception_lines(tb: str, n: int = 3) -> tuple[list[str], str]:
    """(the first n lines of the last exception's message, where: the innermost frame in the
    suite, the outermost outside the Python installation (the backend's entry point, e.g.
    pycollectives'), the innermost overall) of one Python traceback text."""
    lines = tb.rstrip("\n").split("\n")
    last_frame, suite_frame, entry, exc_start = "", "", "", 0
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}"
            last_frame, exc_start = where, i + 1
            if m.group(1).endswith("distributed_test.py"):
                suite_frame, entry = where, ""
            elif not entry and _outside(m.group(1)):
                entry = where
    frames = [f"suite {suite_frame}" if suite_frame else "", f"backend {entry}" if entry else ""]
    if last_frame and last_frame not in (suite_frame, entry):
        frames.append(f"innermost {last_frame}")
    body = [ln for ln in lines[exc_start:] if ln.strip()]
    if "To execute this test, run the following from the base repo dir:" in body:
        # torch's TestCase appends a repro command (and how to suppress it) to the message
        body = body[: body.index("To execute this test, run the following from the base repo dir:")]
    # skip the source line(s) of the frame and the ^^^ markers under it
    while body and (body[0].startswith("    ") or set(body[0].strip()) <= set("^~ ")):
        body.pop(0)
    msg = [ln for ln in body if not ln.startswith(("frame #", "Exception raised from"))]
    return [ln.strip() for ln in msg[:n]], "; ".join(f for f in frames if f)


def summarize_error(text: str, n: int = 3) -> list[str]:
    """Key lines of a failure: for each distinct error among the ranks, `ranks ...: the
    exception (first n lines) [suite frame; innermost frame]`; the parent's own exception
    where no rank reported one."""
    if not text:
        return []
    parts = _PROC_BLOCK.split(text)
    per_rank: dict[str, list[str]] = {}
    if len(parts) > 1:
        for rank, block in zip(parts[1::2], parts[2::2], strict=True):
            msg, where = _exception_lines(block, n)
            msg = [re.sub(rf"\brank {rank}\b", "rank <r>", m) for m in msg]
            key = " | ".join(msg) + (f"  [{where}]" if where else "")
            per_rank.setdefault(key, []).append(rank)
        return [f"rank {','.join(r)}: {k}" for k, r in per_rank.items()]
    head, _, stacks = text.partition("\n\nStacks of the ranks")
    msg, where = _exception_lines(head, n)
    return [" | ".join(msg) + (f"  [{where}]" if where else ""), *_stuck_lines(stacks)]


_STACK_BLOCK = re.compile(r"Process (\d+) timed out with traceback:")
_DUMP_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def _stuck_lines(stacks: str) -> list[str]:
    """Where each rank was when torch's timeout expired (its faulthandler dump, most recent
    call first): per distinct place, the ranks, the innermost frame, the innermost one
    outside the Python installation (the backend's) and the innermost in the suite."""
    parts = _STACK_BLOCK.split(stacks)
    where_ranks: dict[str, list[str]] = {}
    for rank, dump in zip(parts[1::2], parts[2::2], strict=True):
        for thread in re.split(r"\n\s*\n", dump):
            frames = [m.groups() for m in map(_DUMP_FRAME.match, thread.splitlines()) if m]
            if not frames or any(f[2] == "_event_listener" for f in frames):
                continue  # the thread that took the dump
            inner = frames[0]
            backend = next((f for f in frames if _outside(f[0])), None)
            suite = next((f for f in frames if f[0].endswith("distributed_test.py")), None)
            key = "; ".join(
                f"{label} {Path(f[0]).name}:{f[1]} in {f[2]}"
                for label, f in (("innermost", inner), ("backend", backend), ("suite", suite))
                if f is not None and (label == "innermost" or f is not inner)
            )
            where_ranks.setdefault(key, []).append(rank)
    return [f"rank {','.join(r)} stuck at [{k}]" for k, r in where_ranks.items()]
