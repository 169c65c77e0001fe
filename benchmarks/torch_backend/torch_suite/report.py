"""The comparison of runs: the tests a backend fails or hangs while gloo passes them, the
report printed after the runs, and the --json files (save, load)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import OUTCOMES, REFERENCE
from .runner import Run, TestResult


def regressions(runs: list[Run], world_size: int) -> list[tuple[Run, TestResult, TestResult]]:
    """(run, its result, gloo's result) for every test a non-gloo run at world_size fails or
    hangs while gloo's plain run at the same world size passes it."""
    ref = _reference(runs, world_size)
    out: list[tuple[Run, TestResult, TestResult]] = []
    if ref is None:
        return out
    for run in runs:
        if run.world_size != world_size or run.backend == REFERENCE:
            continue
        for name, res in sorted(run.results.items()):
            g = ref.results.get(name)
            if g is not None and g.outcome == "pass" and res.outcome in ("fail", "hang"):
                out.append((run, res, g))
    return out


def _reference(runs: list[Run], world_size: int) -> Run | None:
    """gloo's plain run at that world size (the last one where there are several)."""
    refs = [r for r in runs if r.backend == REFERENCE and r.world_size == world_size]
    return ([r for r in refs if r.mode == "plain"] or [None])[-1]


def _code_label(run: Run) -> str:
    """The digest of pycollectives' files the run imported; both when they changed under it."""
    digests = [c.get("files_sha1", "?") for c in run.code]
    if not digests:
        return ""
    if len(set(digests)) > 1:
        return f"pycollectives {digests[0]} -> {digests[-1]} (CHANGED during the run)"
    return f"pycollectives {digests[0]}"


def report(runs: list[Run]) -> str:
    """The comparison: counts per world size, backend and mode; the tests failing or hanging
    where gloo passes, with their key error lines; the gate-bypassed tests' outcomes."""
    lines: list[str] = []
    head = f"{'backend':10} {'mode':7} " + " ".join(f"{o:>5}" for o in OUTCOMES)
    for ws in sorted({r.world_size for r in runs}):
        ref = _reference(runs, ws)
        lines += [f"== world size {ws} ==", head + "  total   wall  code"]
        for run in (r for r in runs if r.world_size == ws):
            c = run.counts()
            cells = " ".join(f"{c[o]:5}" for o in OUTCOMES)
            lines.append(
                f"{run.backend:10} {run.mode:7} {cells}  {len(run.results):5} "
                f"{run.wall_s:5.0f}s  {_code_label(run)}"
            )
        bad = regressions(runs, ws)
        lines.append(f"-- failing or hanging where {REFERENCE} passes ({len(bad)}):")
        for run, res, g in bad:
            mode = " [gate bypassed]" if run.mode == "bypass" else ""
            lines.append(
                f"  {run.backend}{mode} {res.outcome.upper()} {res.name} "
                f"({res.seconds:.0f} s; {REFERENCE} {g.seconds:.0f} s)"
            )
            lines += [f"      {line}" for line in res.summary[:4]]
        for run in (r for r in runs if r.world_size == ws and r.mode == "bypass"):
            lines.append(
                f"-- gate-bypassed tests on {run.backend} ({len(run.results)}): "
                f"its outcome / {REFERENCE}'s"
            )
            both_skip = 0
            for name, res in sorted(run.results.items()):
                g = ref.results[name].outcome if ref and name in ref.results else "-"
                if res.outcome == g == "skip":
                    both_skip += 1
                else:
                    lines.append(f"  {res.outcome:5} / {g:5} {name}")
            lines.append(f"  ({both_skip} more skipped on both)")
        lines.append("")
    return "\n".join(lines)


def save(path: Path, meta: dict[str, Any], runs: list[Run]) -> None:
    data = {
        "metadata": meta,
        "runs": [
            {
                "backend": r.backend,
                "world_size": r.world_size,
                "mode": r.mode,
                "wall_s": round(r.wall_s, 1),
                "counts": r.counts(),
                "code": r.code,
                "results": {n: {**asdict(t), "summary": t.summary} for n, t in r.results.items()},
            }
            for r in runs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def load(*paths: Path) -> list[Run]:
    """The runs the --json files hold, in order."""
    runs = []
    for path in paths:
        runs += _load(path)
    return runs


def _load(path: Path) -> list[Run]:
    data = json.loads(Path(path).read_text())
    runs = []
    for r in data["runs"]:
        res = {
            n: TestResult(**{k: v for k, v in t.items() if k != "summary"})
            for n, t in r["results"].items()
        }
        runs.append(
            Run(r["backend"], r["world_size"], r["mode"], res, r["wall_s"], r.get("code", []))
        )
    return runs
