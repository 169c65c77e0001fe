"""What the planner's checks against examples/train_gpt.py share: the layouts train_gpt.py
runs at a world size (dp x tp x pp, the dp-axis mode, the pipeline schedule) and the
tensor storage a built Trainer3D holds on a rank, by role, each storage counted once."""

from __future__ import annotations

import itertools
from typing import Any

import torch

ROLES = ("params", "param_shards", "grads", "optimizer", "reduce_buffers")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1")


def layouts(world: int, layers: int, heads: int) -> list[dict[str, Any]]:
    """Every layout train_gpt.py accepts at `world` ranks for a model of `layers` blocks and
    `heads` heads: (dp, tp, pp) with dp*tp*pp = world, tp dividing the heads; the dp-axis
    mode (zero 0-3, fsdp; zero 2/3 and fsdp only with dp > 1, zero 2/3 with pp = 1) and,
    with pp > 1, each schedule (fsdp not with zbh1; interleaved with 2 stages per rank
    where the layers allow)."""
    out = []
    for dp, tp in itertools.product(range(1, world + 1), repeat=2):
        if world % (dp * tp) or heads % tp:
            continue
        pp = world // (dp * tp)
        if layers < pp:
            continue
        modes = ["zero0"] + (["zero1", "fsdp"] if dp > 1 else [])
        if dp > 1 and pp == 1:
            modes += ["zero2", "zero3"]
        for mode in modes:
            scheds = SCHEDULES if pp > 1 else ("1f1b",)
            for sched in scheds:
                if sched == "zbh1" and mode == "fsdp":
                    continue
                if sched == "interleaved" and layers < 2 * pp:
                    continue
                out.append({"dp": dp, "tp": tp, "pp": pp, "mode": mode, "schedule": sched})
    return out


def trainer_storage(trainer: Any) -> dict[str, int]:
    """Bytes of tensor storage `trainer` (a Trainer3D) holds on this rank by role (ROLES)."""
    return trainer.storage()


def options(lo: dict[str, Any], global_batch: int = 32, microbatches: int = 4) -> Any:
    """train_gpt.py's TrainOptions for layout `lo` (float32, its defaults otherwise)."""
    from pycollectives.strategies.parallel3d import TrainOptions

    zero = 0 if lo["mode"] == "fsdp" else int(lo["mode"][-1])
    return TrainOptions(schedule=lo["schedule"], microbatches=microbatches, zero=zero,
                        fsdp=lo["mode"] == "fsdp", global_batch=global_batch, timeout=60)  # fmt: skip


def measure_layouts(comm: Any, lays: list[dict[str, Any]], config: Any = None) -> list[dict]:
    """On each rank of `comm`: for every layout, a Trainer3D of `config` (default:
    train_gpt.py's model) built and stepped once, its storage by role (trainer_storage)."""
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D
    from pycollectives.strategies.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    config = config or GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32)
    out = []
    for lo in lays:
        with ParallelDims(comm, dp=lo["dp"], tp=lo["tp"], pp=lo["pp"]) as dims:
            trainer = Trainer3D(dims, config, options(lo))
            trainer.step()
            out.append(trainer_storage(trainer))
            del trainer
    return out
