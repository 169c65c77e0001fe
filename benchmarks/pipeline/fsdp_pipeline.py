"""FSDP with pipeline parallelism (Trainer3D --fsdp --pp 2): units kept gathered
through a step's micro-batches (set_reshard_after_backward(False), the default
there) against regathered for every micro-batch's forward and backward (True).

    python benchmarks/pipeline/fsdp_pipeline.py [--steps 8] [--schedules gpipe,1f1b,interleaved]
                                       [--no-write]

One set of 4 ranks, dp = 2 x pp = 2, per schedule one Trainer3D (the GPT of
train_gpt_layouts.py, 4 micro-batches per dp rank, fp32): one warm-up step, then
--steps pairs of steps, each pair one step of each setting in alternating order
(the setting is switched on the trainer's roots between steps). Per setting:
the median step time (rank 0's wall clock; the step is collective) and the
ratio of the medians, the dp communicator's all-gather calls per step and the
most units of one stage gathered at once (ShardingEngine.max_gathered;
interleaved: the larger of a rank's two stages), on the first and the last
stage. Rewrites the section between the fsdp_pipeline markers of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section  # noqa: E402
from spawn import run  # noqa: E402
from train_gpt_layouts import BATCH, MICRO, MODEL  # noqa: E402

BEGIN, END = "<!-- fsdp_pipeline:begin -->", "<!-- fsdp_pipeline:end -->"
SETTINGS = {"kept": False, "regathered": True}  # label: reshard_after_backward


def job(rank: int, world: int, schedules: list[str], steps: int) -> list[dict]:
    import pycollectives as pc
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D, TrainOptions
    from pycollectives.strategies.parallel_dims import ParallelDims

    comm = pc.init(timeout=300)
    out = []
    for schedule in schedules:
        with ParallelDims(comm, dp=2, pp=2) as dims:
            opts = TrainOptions(microbatches=MICRO, global_batch=BATCH, schedule=schedule,
                                fsdp=True, timeout=300)  # fmt: skip
            trainer = Trainer3D(dims, GPTConfig(**MODEL), opts)
            engines = [r.sharding_unit.engine for r in trainer.fsdp_roots]
            trainer.step()  # warm-up
            seen: dict[str, dict] = {k: {"s": [], "gathers": [], "most": 0} for k in SETTINGS}
            for k in range(steps):
                order = list(SETTINGS) if k % 2 == 0 else list(reversed(SETTINGS))
                for label in order:
                    for root in trainer.fsdp_roots:
                        root.set_reshard_after_backward(SETTINGS[label])
                    for e in engines:
                        e.max_gathered = 0
                    before = dims.dp_comm.stats()["all_gather"]["calls"]
                    seconds = trainer.step().seconds
                    seen[label]["s"].append(seconds)
                    seen[label]["gathers"].append(dims.dp_comm.stats()["all_gather"]["calls"]
                                                  - before)  # fmt: skip
                    most = max(e.max_gathered for e in engines)
                    seen[label]["most"] = max(seen[label]["most"], most)
            out.append(dict(schedule=schedule, pp_rank=dims.pp_rank, seen=seen))
    comm.close()
    return out if rank in (0, world - 1) else []  # dp rank 0 of the first and the last stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    load = [os.getloadavg()[0]]
    start = time.time()
    res = run(job, 4, schedules, args.steps, timeout=1800)
    load.append(os.getloadavg()[0])
    first, last = res[0], res[-1]
    table = [
        "| schedule | setting | median step (ms) | step / kept | all-gathers per step, "
        "first / last stage | most units of one stage gathered at once, first / last |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in zip(first, last, strict=True):
        kept = statistics.median(a["seen"]["kept"]["s"])
        for label in SETTINGS:
            med = statistics.median(a["seen"][label]["s"])
            g = [statistics.median(x["seen"][label]["gathers"]) for x in (a, b)]
            most = [x["seen"][label]["most"] for x in (a, b)]
            table.append(f"| {a['schedule']} | {label} | {med * 1e3:.1f} | {med / kept:.2f} "
                         f"| {g[0]:.0f} / {g[1]:.0f} | {most[0]} / {most[1]} |")  # fmt: skip
    cfg = ", ".join(f"{k} {v}" for k, v in MODEL.items() if k != "seed")
    notes = [
        f"GPT: {cfg}; dp = 2 x pp = 2 (4 ranks), global batch {BATCH} x {MODEL['seq_len']} "
        f"tokens, {MICRO} micro-batches per dp rank, --fsdp, AdamW, fp32, one thread per rank; "
        f"{args.steps} pairs of steps after one warm-up, the two settings alternating.",
        "kept: set_reshard_after_backward(False) on each stage's root (Trainer3D's setting); "
        "regathered: True (each unit gathered for every micro-batch's forward and backward).",
        f"4 ranks share 2 cores. Load average (1 min) at the start and the end: {load[0]:.1f}, "
        f"{load[1]:.1f}; {time.time() - start:.0f} s.",
    ]
    emit_section(BEGIN, END, "FSDP with pipeline parallelism: units kept gathered through a step",
                 "`python benchmarks/pipeline/fsdp_pipeline.py`", notes, table, not args.no_write)  # fmt: skip


if __name__ == "__main__":
    main()
