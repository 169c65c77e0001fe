"""docs/benchmarks.md's summary table is what benchmarks/common/summary.py
writes from the records in docs/data/summary/, so it cannot drift from them by
hand; records are checked before they become rows."""

from __future__ import annotations

import json
import sys

import paths
import pytest

sys.path.insert(0, str(paths.BENCH / "common"))
import summary  # noqa: E402

DOC = "# B\n\n<!-- summary:begin -->\nold\n<!-- summary:end -->\n\n## Across hosts (TCP)\n"
ROW = dict(
    order=1, compared="x vs y", figures="2.0x", run="here, today", section="#across-hosts-tcp"
)


def test_the_docs_table_is_the_records():
    assert summary.main(["--check"]) == 0, "run python benchmarks/common/summary.py"


def test_a_record_becomes_a_row_linking_its_heading(tmp_path):
    summary.record("a", **ROW, command="python b.py", folder=tmp_path)
    out = summary.render(DOC, summary.load(tmp_path))
    assert "| x vs y | 2.0x | here, today | [Across hosts (TCP)](#across-hosts-tcp) |" in out
    assert "old" not in out and "(t)" not in out and out.endswith("## Across hosts (TCP)\n")


@pytest.mark.parametrize(
    "bad, says",
    [
        (dict(ROW, figures="a\nb"), "figures must be a one-line str"),
        (dict(ROW, compared="a | b"), "compared must be a one-line str"),
        (dict(ROW, order="1"), "order must be a one-line int"),
        (dict(ROW, section="across"), "section must be an anchor"),
    ],
)
def test_malformed_records_are_refused_by_name(tmp_path, bad, says):
    with pytest.raises(ValueError, match=says):
        summary.record("r", **bad, command="c", folder=tmp_path)
    (tmp_path / "r.json").write_text(json.dumps(dict(bad, command="c", source="run")))
    with pytest.raises(ValueError, match=f"summary record r.json: {says}"):
        summary.load(tmp_path)


def test_too_many_rows_a_missing_heading_and_missing_markers_are_refused(tmp_path):
    summary.record("a", **dict(ROW, section="#nowhere"), command="c", folder=tmp_path)
    with pytest.raises(ValueError, match="no heading with anchor #nowhere"):
        summary.render(DOC, summary.load(tmp_path))
    with pytest.raises(ValueError, match="markers"):
        summary.render("# B\n", [])
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(ValueError, match="a.json: not JSON"):
        summary.load(tmp_path)
    for i in range(summary.MAX_ROWS + 1):
        summary.record(f"r{i}", **ROW, command="c", folder=tmp_path)
    (tmp_path / "a.json").unlink()
    with pytest.raises(ValueError, match="at most 12 rows"):
        summary.load(tmp_path)
