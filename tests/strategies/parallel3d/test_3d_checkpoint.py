"""Checkpoints of 3D training (strategies/parallel3d/checkpoint.py): saved in
one dp x tp x pp layout and ZeRO stage, resumed in another, the run ends
where the uninterrupted one does (float64: parameters within 1e-10, as
tests/strategies/parallel3d/test_3d.py bounds the layouts against one process); bad input raises
on every rank. Needs strategies.checkpoint (skipped without it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pycollectives as pc

pytest.importorskip("pycollectives.strategies.checkpoint")

from test_3d import CONFIG, OPTIONS  # noqa: E402

from pycollectives.strategies.parallel3d import Trainer3D  # noqa: E402
from pycollectives.strategies.parallel3d.checkpoint import load_trainer, save_trainer  # noqa: E402
from pycollectives.strategies.parallel_dims import ParallelDims  # noqa: E402

STEPS, SAVE_AT = 6, 3


def job_run(comm: pc.Communicator, layout: tuple, change: dict, path: str, mode: str) -> dict:
    """mode "save": runs STEPS steps, saving after SAVE_AT; "resume": loads, runs to STEPS."""
    dp, tp, pp = layout
    with ParallelDims(comm, dp=dp, tp=tp, pp=pp) as dims:
        trainer = Trainer3D(dims, CONFIG, dataclasses.replace(OPTIONS, **change))
        if mode == "resume":
            assert load_trainer(trainer, path) == SAVE_AT
        losses = []
        while trainer.step_index < STEPS:
            losses.append(trainer.step().loss)
            if mode == "save" and trainer.step_index == SAVE_AT:
                save_trainer(trainer, path)
        end = {n: t.numpy() for n, t in trainer.full_parameters().items()}
    return dict(losses=losses, end=end)


CASES = [  # (saved in, its options) -> (resumed in, its options)
    ((2, 1, 2), {"schedule": "1f1b"}, (1, 2, 2), {"schedule": "gpipe"}),
    ((2, 2, 1), {"zero": 3}, (2, 1, 2), {"schedule": "interleaved", "zero": 1}),
]


@pytest.mark.parametrize("saved,s_opts,resumed,r_opts", CASES, ids=["plain", "zero3-to-zero1"])
def test_resume_in_another_layout(pool, tmp_path, saved, s_opts, resumed, r_opts):
    path = str(tmp_path / "ckpt")
    first = pool(4).run(job_run, saved, s_opts, path, "save", timeout=120)
    second = pool(4).run(job_run, resumed, r_opts, path, "resume", timeout=120)
    want = {}
    for r in first:
        want.update(r["end"])
    got = {}
    for r in second:
        got.update(r["end"])
        assert r["losses"] == pytest.approx(first[0]["losses"][SAVE_AT:], abs=1e-12)
    assert set(got) == set(want)
    for name, v in want.items():
        diff = float(abs(torch.from_numpy(got[name]) - torch.from_numpy(v)).max())
        assert diff <= 1e-10, (name, diff)


def job_bad(comm: pc.Communicator, path: str) -> dict[str, str]:
    out = {}
    for case, change, where in (
        ("missing", {}, path + "-missing"),
        ("fsdp", {"fsdp": True}, path),
        ("config", {}, path),
    ):
        sub = comm.split(0)
        try:
            with ParallelDims(sub, dp=4) as dims:
                cfg = dataclasses.replace(CONFIG, seed=6) if case == "config" else CONFIG
                trainer = Trainer3D(dims, cfg, dataclasses.replace(OPTIONS, **change))
                if case == "config":
                    save_trainer(Trainer3D(dims, CONFIG, OPTIONS), path)
                load_trainer(trainer, where)
            out[case] = "no error"
        except ValueError as e:
            out[case] = f"{type(e).__name__}: {e}"
        finally:
            sub.close()
    return out


def test_bad_input_raises_on_every_rank(pool, tmp_path):
    for out in pool(4).run(job_bad, str(tmp_path / "ckpt"), timeout=120):
        assert "does not exist" in out["missing"], out["missing"]
        assert "--fsdp: not supported" in out["fsdp"], out["fsdp"]
        assert "seed=5" in out["config"] and "seed=6" in out["config"], out["config"]
