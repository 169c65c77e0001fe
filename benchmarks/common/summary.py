"""The summary table at the top of docs/benchmarks.md, written from records,
never by hand: one JSON file per row in docs/data/summary/ (`record()` writes
it, the benchmark that measured the figures calls it), the table rebuilt from
them between the `summary` markers.

    python benchmarks/common/summary.py          # rewrites the table
    python benchmarks/common/summary.py --check  # exit 1 if the table differs from the records

A record: {"order": int, "compared": str, "figures": str, "run": str,
"section": "#anchor", "command": str, "source": str}. "source" says where the
figures came from: "run" (the benchmark wrote the record when it ran), or a
sentence for a record transcribed from its section's table (a run older than
the records); such rows are marked in the table."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
RECORDS = ROOT / "docs" / "data" / "summary"
BEGIN, END = "<!-- summary:begin -->", "<!-- summary:end -->"
MAX_ROWS = 12
FIELDS = {"order": int, "compared": str, "figures": str, "run": str, "section": str}
FIELDS |= {"command": str, "source": str}


def record(name: str, *, order: int, compared: str, figures: str, run: str, section: str,
           command: str, folder: Path = RECORDS) -> Path:  # fmt: skip
    """Writes the summary record `name` (one row of the table) from a benchmark
    that has just measured `figures`; returns its path. Raises ValueError on a
    field the table cannot hold (a line break, a section that is not an anchor)."""
    rec = {"order": order, "compared": compared, "figures": figures, "run": run}
    rec |= {"section": section, "command": command, "source": "run"}
    _check(rec, name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def _check(rec: object, name: str) -> dict:
    if not isinstance(rec, dict) or set(rec) != set(FIELDS):
        raise ValueError(f"summary record {name}: wants exactly the fields {sorted(FIELDS)}")
    for key, kind in FIELDS.items():
        value = rec[key]
        if not isinstance(value, kind) or (kind is str and ("\n" in value or "|" in value)):
            raise ValueError(f"summary record {name}: {key} must be a one-line {kind.__name__}")
    if not rec["section"].startswith("#"):
        raise ValueError(f"summary record {name}: section must be an anchor (#...)")
    return rec


def load(folder: Path = RECORDS) -> list[dict]:
    """Every record in `folder`, in table order. Raises ValueError naming the
    file that is malformed, or when there are more than MAX_ROWS."""
    recs = []
    for f in sorted(folder.glob("*.json")):
        try:
            recs.append(_check(json.loads(f.read_text()), f.name) | {"name": f.stem})
        except json.JSONDecodeError as e:
            raise ValueError(f"summary record {f.name}: not JSON ({e})") from None
    if len(recs) > MAX_ROWS:
        raise ValueError(f"{folder}: {len(recs)} summary records, at most {MAX_ROWS} rows")
    return sorted(recs, key=lambda r: (r["order"], r["name"]))


def anchors(doc: str) -> dict[str, str]:
    """GitHub's anchor of every `##`/`###` heading of `doc` -> the heading's text
    (the first of headings that share an anchor)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^#{2,3} (.+)$", doc, re.MULTILINE):
        text = m.group(1).strip()
        key = "#" + re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.setdefault(key, text)
    return out


def table(recs: list[dict], titles: dict[str, str]) -> str:
    """The summary section (markers included) for `recs`, each linking its
    section by the heading in `titles`. Raises ValueError on a record whose
    section is not a heading of the document."""
    lines = [
        BEGIN,
        "| compared | headline figures | run | section |",
        "|---|---|---|---|",
    ]
    transcribed = False
    for r in recs:
        mark = ""
        if r["source"] != "run":
            mark, transcribed = " (t)", True
        if r["section"] not in titles:
            raise ValueError(f"summary record {r['name']}: no heading with anchor {r['section']}")
        title = titles[r["section"]]
        lines.append(
            f"| {r['compared']} | {r['figures']}{mark} | {r['run']} | [{title}]({r['section']}) |"
        )
    lines += [
        "",
        f"Written by `python benchmarks/common/summary.py` from docs/data/summary/ ({len(recs)} "
        "records); a benchmark that measures a row's figures rewrites its record.",
    ]
    if transcribed:
        lines.append(
            "(t): transcribed on 2026-11-28 from its section (or its JSON), not written by the "
            "run itself (the runs predate the records)."
        )
    return "\n".join([*lines, END])


def render(doc: str, recs: list[dict]) -> str:
    """`doc` with the text between the summary markers replaced. Raises
    ValueError when the markers are missing."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{DOC}: no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    return head + table(recs, anchors(doc)) + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = ap.parse_args(argv)
    doc = DOC.read_text()
    new = render(doc, load())
    if args.check:
        if new != doc:
            print(f"{DOC}: the summary differs from docs/data/summary/: run {__file__}")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
