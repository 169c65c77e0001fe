"""The planner's tensor storage per rank of the layouts examples/train_gpt.py runs at 4 ranks
(dp x tp x pp, ZeRO 0-3, FSDP; 1F1B and interleaved schedules) against what a built
Trainer3D holds after one step, counted by role (benchmarks/plan/_plan_layouts.py): within 5%.
benchmarks/plan/plan_memory.py runs every layout of 4 and 8 ranks, every schedule, and peak RSS."""

from __future__ import annotations

import sys

import paths
import pytest

from pycollectives.strategies.plan import ModelSpec
from pycollectives.strategies.plan.trainer import stage_params, trainer_storage
from pycollectives.strategies.plan.units import PlanInputError

BENCH = str(paths.BENCH / "plan")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from _plan_layouts import layouts, measure_layouts  # noqa: E402

SPEC = ModelSpec(layers=4, hidden=32, heads=4, vocab=64, seq=16)  # train_gpt.py's defaults
PIPE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbh1": "zb-h1"}


def test_stage_params_and_bad_input():
    # one stage holds everything: P of the whole model (the tied head counted once)
    (only,) = stage_params(SPEC, 1)
    assert only["blocks"] * only["block"] + only["embed"] + only["head"] == SPEC.params()
    stages = stage_params(SPEC, 2, t=2)
    assert [s["blocks"] for s in stages] == [2, 2] and stages[1]["tied"] == 64 * 32 // 2
    with pytest.raises(PlanInputError, match="cannot fill 8 stages"):
        stage_params(SPEC, 8)
    with pytest.raises(PlanInputError, match="needs pp=1"):
        trainer_storage(SPEC, 2, 1, 2, "zero3")
    with pytest.raises(PlanInputError, match="mode='zero4'"):
        trainer_storage(SPEC, 2, 1, 2, "zero4")


def test_storage_of_every_4_rank_layout_within_5_percent(pool):
    lays = [lo for lo in layouts(4, SPEC.layers, SPEC.heads) if lo["schedule"] in ("1f1b", "interleaved")]  # fmt: skip
    assert len(lays) == 20
    results = pool(4).run(measure_layouts, lays, timeout=240)
    for i, lo in enumerate(lays):
        measured = max(sum(r[i].values()) for r in results)
        pred = trainer_storage(SPEC, lo["dp"], lo["tp"], lo["pp"], lo["mode"], PIPE[lo["schedule"]])
        predicted = max(sum(p.values()) for p in pred)
        assert abs(predicted / measured - 1) <= 0.05, (lo, predicted, [r[i] for r in results], pred)
