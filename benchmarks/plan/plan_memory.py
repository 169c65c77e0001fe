"""The planner's memory per rank against what examples/train_gpt.py's layouts hold.

    python benchmarks/plan/plan_memory.py [--worlds 4,8] [--no-write]

1. Tensor storage: every layout train_gpt.py runs at 4 and 8 ranks (dp x tp x pp, ZeRO
   0-3, FSDP, every schedule; benchmarks/plan/_plan_layouts.py) with its default model, one
   step, the storage a rank's Trainer3D holds by role against
   strategies/plan/trainer.py's prediction (the busiest rank of each). Target: within 5%.
2. Peak RSS at 4 ranks, one fresh set of processes per (dp, tp, pp, mode) with 1F1B, a
   25M-parameter GPT (d_model 512, 8 layers, vocab 512, 32 tokens, global batch 8 in 2
   micro-batches), 2 steps: each rank's peak resident set (getrusage) against the
   prediction: the rank's fixed part, measured (its peak RSS after the same layout of
   train_gpt.py's tiny default model is built and stepped twice, less that model's
   tensors: interpreter, torch, modules, threads, the communicator's pools) + the
   predicted storage + the build's transient (each stage is built whole, in fp32,
   before it is split over tp and dp) + the activations of the micro-batches in flight
   (Korthikanti et al. Table 2 in fp32, no dropout) + the pages of the peers' symmetric
   windows its in-place collectives touch (peer_window_bytes) + the tensors a step holds
   beside that storage (step_transient_bytes: gradients not yet reduced, parameters
   gathered). Target: within 15%.

--storage-from DATA.json takes part 1's rows from an earlier run's JSON instead of
measuring them again (say so when its section is kept: the notes name the file).

Writes its section of docs/benchmarks.md and docs/data/plan_memory-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import cpu_model, emit_section  # noqa: E402
from _plan_layouts import layouts, measure_layouts, options, trainer_storage  # noqa: E402
from spawn import RankPool, run  # noqa: E402

from pycollectives.strategies.plan import ModelSpec  # noqa: E402
from pycollectives.strategies.plan import trainer as ptrainer  # noqa: E402
from pycollectives.strategies.plan.memory import activation_bytes_per_layer  # noqa: E402

BEGIN, END = "<!-- plan_memory:begin -->", "<!-- plan_memory:end -->"
PIPE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbh1": "zb-h1"}
TINY = ModelSpec(layers=4, hidden=32, heads=4, vocab=64, seq=16)
BIG = ModelSpec(layers=8, hidden=512, heads=8, vocab=512, seq=32)
BIG_BATCH, BIG_MICRO = 8, 2
DATA = ROOT / "docs" / "data"


def job_rss(rank: int, world: int, lo: dict) -> dict:
    """One rank: RSS peak (bytes) before building, and after building and 2 steps."""
    import resource

    import torch

    import pycollectives as pc
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D
    from pycollectives.strategies.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    s = BIG
    cfg = GPTConfig(vocab_size=s.vocab, seq_len=s.seq, n_layer=s.layers, n_head=s.heads,
                    d_model=s.hidden)  # fmt: skip
    comm = pc.init(timeout=120)
    with ParallelDims(comm, dp=lo["dp"], tp=lo["tp"], pp=lo["pp"]) as dims:
        # The fixed part: the same layout of train_gpt.py's tiny default model, built and
        # stepped twice (modules imported, autograd and communicator threads, allocator
        # arenas), its tensors a few hundred KiB.
        tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=s.layers, n_head=s.heads,
                         d_model=s.heads * 4)  # fmt: skip
        small = Trainer3D(dims, tiny, options(lo, BIG_BATCH, BIG_MICRO))
        for _ in range(2):
            small.step()
        small_storage = sum(trainer_storage(small).values())
        del small
        comm.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - small_storage
        trainer = Trainer3D(dims, cfg, options(lo, BIG_BATCH, BIG_MICRO))
        built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for _ in range(2):
            trainer.step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        storage = sum(trainer_storage(trainer).values())
        pp_rank = dims.pp_rank
    comm.close()
    return {"before": before, "built": built, "peak": peak, "storage": storage, "pp_rank": pp_rank}


def predicted_rss(lo: dict, before: float) -> tuple[float, dict]:
    """The planner's peak RSS (the busiest pp rank): the measured start + max(build,
    training); also each pp rank's predicted storage and step transient, bytes."""
    s, dp, tp, pp = BIG, lo["dp"], lo["tp"], lo["pp"]
    storage = ptrainer.trainer_storage(s, dp, tp, pp, lo["mode"], PIPE[lo["schedule"]])
    peers = ptrainer.peer_window_bytes(s, dp, tp, pp, lo["mode"], PIPE[lo["schedule"]])
    transient = ptrainer.step_transient_bytes(s, dp, tp, pp, lo["mode"], PIPE[lo["schedule"]],
                                              microbatches=BIG_MICRO)  # fmt: skip
    stages = ptrainer.stage_params(s, pp, 1)
    out = []
    b = BIG_BATCH // (dp * BIG_MICRO)
    for r, st in enumerate(storage):
        full = stages[r]
        whole = 4 * (full["blocks"] * full["block"] + full["embed"] + full["head"] + full["tied"])
        held = sum(st.values())
        # activations: fp32 (x2 of Table 2's 16-bit bytes), the micro-batches 1F1B holds
        in_flight = min(pp - r, BIG_MICRO) if pp > 1 else 1
        act = 2 * activation_bytes_per_layer(s.seq, b, s.hidden, s.heads, tp) * full["blocks"]
        act = act * in_flight + 4 * 3 * s.seq * b * s.vocab / tp  # logits, softmax, grad
        step = sum(transient[r].values())
        out.append(before + max(whole + held, held + act + peers[r] + step))
    return max(out), {"storage": [sum(x.values()) for x in storage],
                      "transient": [sum(x.values()) for x in transient]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--storage-from", help="an earlier run's JSON: its storage rows, not rerun")
    args = ap.parse_args()
    load0, t0 = os.getloadavg(), time.perf_counter()
    tables, rows, worst = [], [], 0.0
    st_table = [
        "| world | dp | tp | pp | mode | schedule | predicted B | measured B | ratio |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    earlier = (
        json.loads(Path(args.storage_from).read_text())["storage"] if args.storage_from else None
    )
    for world in (int(w) for w in args.worlds.split(",")):
        lays = layouts(world, TINY.layers, TINY.heads)
        if earlier is not None:
            res = None
            kept = {tuple(r[k] for k in ("world", *lays[0])): r["measured_bytes"] for r in earlier}
        else:
            pool = RankPool(world)
            try:
                res = pool.run(measure_layouts, lays, timeout=600)
            finally:
                pool.close()
        for i, lo in enumerate(lays):
            if res is None:
                measured = kept[(world, *lo.values())]
            else:
                measured = max(sum(r[i].values()) for r in res)
            pred = ptrainer.trainer_storage(TINY, lo["dp"], lo["tp"], lo["pp"], lo["mode"],
                                            PIPE[lo["schedule"]])  # fmt: skip
            predicted = max(sum(p.values()) for p in pred)
            worst = max(worst, abs(predicted / measured - 1))
            rows.append(
                {"world": world, **lo, "predicted_bytes": predicted, "measured_bytes": measured}
            )
            st_table.append(f"| {world} | {lo['dp']} | {lo['tp']} | {lo['pp']} | {lo['mode']} | "
                            f"{lo['schedule']} | {predicted:.0f} | {measured} | {predicted / measured:.3f} |")  # fmt: skip
    n_st = len(rows)
    summary = f"storage: {n_st} layouts, worst |error| {worst:.1%} (target 5%)"
    tables += [f"Tensor storage, model {TINY} (busiest rank):", "", *st_table, ""]
    rss_rows = []
    if not args.no_rss:
        seen, rss_table = (
            set(),
            [
                "| dp | tp | pp | mode | start MiB | predicted peak MiB | measured peak MiB | ratio | "
                "measured - start MiB | predicted - start MiB | of which step transient MiB |",
                "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
            ],
        )
        for lo in layouts(4, BIG.layers, BIG.heads):
            key = (lo["dp"], lo["tp"], lo["pp"], lo["mode"])
            if key in seen:
                continue
            seen.add(key)
            res = run(job_rss, 4, lo, timeout=300)
            before = statistics.median(r["before"] for r in res)
            measured = max(r["peak"] for r in res)
            predicted, parts = predicted_rss(lo, before)
            step = max(parts["transient"])
            rss_rows.append({**lo, "start": before, "predicted_peak": predicted,
                             "measured_peak": measured, "step_transient": step})  # fmt: skip
            mib = 1 << 20
            rss_table.append(f"| {lo['dp']} | {lo['tp']} | {lo['pp']} | {lo['mode']} | {before / mib:.0f} | "
                             f"{predicted / mib:.0f} | {measured / mib:.0f} | {predicted / measured:.2f} | "
                             f"{(measured - before) / mib:.0f} | {(predicted - before) / mib:.0f} | {step / mib:.0f} |")  # fmt: skip
            print(rss_table[-1], flush=True)
        errs = [abs(r["predicted_peak"] / r["measured_peak"] - 1) for r in rss_rows]
        within = sum(e <= 0.15 for e in errs)
        summary += (f"; peak RSS at 4 ranks: {len(rss_rows)} layouts, worst |error| {max(errs):.1%}, "
                    f"{within} of {len(rss_rows)} within 15% (target 15%)")  # fmt: skip
        tables += [f"Peak RSS at 4 ranks (1F1B), model {BIG} ({BIG.params() / 1e6:.1f}M parameters):",
                   "", *rss_table]  # fmt: skip
    load1 = os.getloadavg()
    notes = [
        f"Result: {summary}.",
        *(
            [f"Storage rows (measured B) taken from {args.storage_from}, not rerun."]
            if args.storage_from
            else []
        ),
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all.",
    ]
    date = datetime.date.today().isoformat()
    if not args.no_write:
        DATA.mkdir(exist_ok=True)
        (DATA / f"plan_memory-{date}.json").write_text(json.dumps({
            "summary": summary, "command": "python benchmarks/plan/plan_memory.py " + " ".join(sys.argv[1:]),
            "machine": f"{cpu_model()}, {os.cpu_count()} cores", "date": date, "load_start": load0,
            "load_end": load1, "storage": rows, "rss": rss_rows}, indent=1) + "\n")  # fmt: skip
    argv = " ".join(sys.argv[1:])
    emit_section(BEGIN, END, "Planner: memory per rank against train_gpt.py's layouts",
                 f"`python benchmarks/plan/plan_memory.py{' ' + argv if argv else ''}` "
                 f"(data: docs/data/plan_memory-{date}.json)", notes, tables, not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
