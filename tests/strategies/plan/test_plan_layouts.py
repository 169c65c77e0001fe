"""The planner's cost model, its layouts' step time and rejections, and the CLI."""

from __future__ import annotations

import json

import pytest

from pycollectives.strategies.plan import parse_request
from pycollectives.strategies.plan.cli import main, plan
from pycollectives.strategies.plan.costs import (
    LinkCost,
    fit,
    hierarchical_time,
    load_bench_json,
    ring_time,
    ring_vs_hierarchical,
)
from pycollectives.strategies.plan.inputs import PlanInputError
from pycollectives.strategies.plan.layout import Layout, Priced, Rejected, price
from pycollectives.strategies.plan.trainer import stage_params

LINK = LinkCost(alpha=2e-6, beta=1 / 10e9, source="test")
FREE = {"intra": LinkCost(0.0, 0.0, "free"), "inter": LinkCost(0.0, 0.0, "free")}
REQ = {
    "layers": 8, "hidden": 256, "heads": 8, "vocab": 1024, "seq": 128, "global_batch": 64,
    "hosts": 2, "devices_per_host": 4, "memory_per_device": "16GB",
    "intra_host": "100GB/s,2us", "inter_host": "10GB/s,10us", "flops": "100TFLOP/s",
}  # fmt: skip


def test_ring_formulas():
    s, n = 64 * 2**20, 4
    assert ring_time("all_reduce", n, s, LINK) == pytest.approx(2 * 3 * 2e-6 + 2 * 3 / 4 * s / 10e9)
    for coll in ("reduce_scatter", "all_gather"):
        assert ring_time(coll, n, s, LINK) == pytest.approx(3 * 2e-6 + 3 / 4 * s / 10e9)
    assert ring_time("all_reduce", 1, s, LINK) == 0.0
    with pytest.raises(PlanInputError, match="broadcast"):
        ring_time("broadcast", n, s, LINK)


def test_hierarchical_across_hosts():
    intra, inter = LinkCost(1e-6, 1 / 100e9, "i"), LinkCost(10e-6, 1 / 10e9, "x")
    s = 2**28
    got = hierarchical_time("all_reduce", 16, 8, s, intra, inter)
    want = 2 * (7e-6 + 7 / 8 * s / 100e9) + (2e-6 * 10 + 2 * 1 / 2 * s / 8 / 10e9)
    assert got == pytest.approx(want)
    # At 4096 ranks (512 hosts of 8) a flat ring over the slow link pays 8190 latencies and
    # the whole buffer at the slow link's speed; hierarchical sends 1/8 of it across.
    assert hierarchical_time("all_reduce", 4096, 8, s, intra, inter) < ring_time(
        "all_reduce", 4096, s, inter
    )
    assert hierarchical_time("all_gather", 8, 8, s, intra, inter) == ring_time(
        "all_gather", 8, s, intra
    )
    rows = ring_vs_hierarchical("all_reduce", s, 8, intra, inter)
    assert [r["ranks"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert rows[0]["ring_s"] == rows[0]["hierarchical_s"]  # one host: the same ring
    assert all(r["faster"] == "hierarchical" for r in rows[1:])
    assert rows[-1]["ring_s"] == ring_time("all_reduce", 4096, s, inter)
    with pytest.raises(PlanInputError, match="not a multiple of per_host=8"):
        ring_vs_hierarchical("all_reduce", s, 8, intra, inter, (12,))


def _rows(alpha: float, beta: float) -> list[dict]:
    rows = []
    for n in (2, 3, 4):
        for coll, k in (("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1)):
            for size in (2**12, 2**16, 2**20, 2**24):
                t = k * (n - 1) * alpha + k * (n - 1) / n * size * beta
                rows.append(
                    {
                        "backend": "pycoll",
                        "collective": coll,
                        "nranks": n,
                        "size": size,
                        "time_us": t * 1e6,
                    }
                )
    return rows


def test_fit_recovers_alpha_and_beta(tmp_path):
    rows = _rows(3e-6, 1 / 5e9)
    got = fit(rows)
    assert got.alpha == pytest.approx(3e-6, rel=1e-6)
    assert got.beta == pytest.approx(1 / 5e9, rel=1e-6)
    assert "27 rows" in got.source  # 4 KiB rows are under 64 KiB: left out
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"metadata": {}, "rows": rows}))
    assert len(load_bench_json(str(path))) == len(rows)
    path.write_text(json.dumps({"rows": [{"collective": "all_reduce", "nranks": "2"}]}))
    with pytest.raises(PlanInputError, match="row 0 is not a bench row"):
        load_bench_json(str(path))
    path.write_text("{")
    with pytest.raises(PlanInputError, match="cannot be read as JSON"):
        load_bench_json(str(path))
    with pytest.raises(PlanInputError, match="usable rows"):
        fit(rows[:1])


def test_compute_is_6pt_plus_attention():
    req = parse_request({**REQ, "hosts": 1, "devices_per_host": 1})
    lo = Layout(1, 1, 1, "none", "none", 1, "none")
    got = price(req, lo, FREE)
    assert isinstance(got, Priced)
    m, tokens = req.model, 64 * 128
    flops = 6 * m.params() * tokens + 12 * m.layers * m.hidden * m.seq * tokens
    assert got.time["compute"] == pytest.approx(flops / 100e12, rel=1e-12)
    assert got.step_s == pytest.approx(got.time["compute"], rel=1e-12)


@pytest.mark.parametrize("sched, m", [("gpipe", 4), ("1f1b", 8)])
def test_bubble_is_the_simulated_schedules(sched, m):
    """With free messages and stages that cost alike (a vocabulary and sequence too small
    for the embeddings and the head to weigh) the bubble share of the step is the classic
    (p-1)/(m+p-1) for GPipe and 1F1B; stages that differ only add to it."""
    req = parse_request({**REQ, "vocab": 8, "seq": 8})
    got = price(req, Layout(2, 1, 4, "none", sched, m, "none"), FREE)
    assert isinstance(got, Priced)
    share = got.time["pipeline_bubble"] / got.step_s
    assert 3 / (m + 3) <= share <= 3 / (m + 3) * 1.01


def test_the_heaviest_stage_sets_the_pace():
    """pipeline.balance's stages, not an even split: with a large tied vocabulary the last
    stage (the head's matmul) is the heaviest; the step is at least m times its forward and
    backward, and its idle share larger than the even split's (p-1)/(m+p-1)."""
    req = parse_request({**REQ, "vocab": 65536})
    m = 8
    got = price(req, Layout(2, 1, 4, "none", "1f1b", m, "none"), FREE)
    assert isinstance(got, Priced)
    spec, tokens = req.model, 64 // (2 * m) * req.model.seq
    # the stages as the pipeline cuts them; the last pays the head's 2 V h FLOPs a token
    stages = stage_params(spec, 4)
    last = stages[-1]["blocks"] * spec.block_params() + spec.vocab * spec.hidden + 2 * spec.hidden
    last_flops = 6 * last * tokens + 12 * stages[-1]["blocks"] * spec.hidden * spec.seq * tokens
    assert got.step_s >= m * last_flops / 100e12 * (1 - 1e-12)
    assert got.time["pipeline_bubble"] / got.step_s > 3 / (m + 3)


def test_rejections_say_why():
    req = parse_request(REQ)
    heads = price(
        req,
        Layout(1, 8, 1, "none", "none", 1, "none"),
        FREE,
    )
    assert isinstance(heads, Rejected) and "crosses hosts" in heads.reason
    odd = price(
        parse_request({**REQ, "heads": 2, "hidden": 256}),
        Layout(2, 4, 1, "none", "none", 1, "none"),
        FREE,
    )
    assert isinstance(odd, Rejected) and odd.reason == "heads=2 not divisible by tp=4"
    z3 = price(req, Layout(2, 1, 4, "zero3", "1f1b", 4, "none"), FREE)
    assert isinstance(z3, Rejected) and "pipeline refuses it" in z3.reason
    small = parse_request({**REQ, "memory_per_device": "100MB"})
    got = price(small, Layout(8, 1, 1, "none", "none", 1, "none"), FREE)
    assert isinstance(got, Rejected) and got.reason.startswith("does not fit")
    fits = price(req, Layout(8, 1, 1, "none", "none", 1, "none"), FREE)
    assert got.over_bytes == pytest.approx(fits.memory_total - 100e6)
    assert f"over by {got.over_bytes / 1e9:.2f} GB" in got.reason


def test_plan_ranks_and_cli(tmp_path, capsys):
    req = parse_request(REQ)
    links = {"intra": LinkCost(2e-6, 1 / 100e9, "i"), "inter": LinkCost(10e-6, 1 / 10e9, "x")}
    fits, rejected = plan(req, links)
    assert fits and all(a.step_s <= b.step_s for a, b in zip(fits, fits[1:], strict=False))
    assert any("crosses hosts" in r.reason for r in rejected)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in REQ.items()]
    out = tmp_path / "plan.json"
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["inputs"]["cluster"]["memory_per_device"] == "16GB = 16000000000 bytes"
    assert data["layouts"][0]["name"] == fits[0].layout.name()
    assert "16GB = 16000000000 bytes" in capsys.readouterr().out
    assert main([*argv, "--memory-per-device=16G"]) == 2
    assert "memory_per_device='16G'" in capsys.readouterr().err
    assert main([*argv, "--memory-per-device=1MB"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_cli_piped_to_a_reader_that_leaves(tmp_path):
    """`pycollectives-plan ... | head -1`: the reader closes the pipe before the report is
    written; the CLI exits quietly (no BrokenPipeError traceback), with its usual status."""
    import subprocess
    import sys

    argv = [f"--{k.replace('_', '-')}={v}" for k, v in REQ.items()]
    code = "import sys; from pycollectives.strategies.plan.cli import main; sys.exit(main())"
    p = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    p.stdout.close()  # before the child has written anything: its writes fail with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == "", err
