"""The planner's step-time ranking of train_gpt.py's 4-rank layouts against measured steps.

    python benchmarks/plan/plan_ranking.py [--steps 4] [--bench-json FILE] [--no-write]
    python benchmarks/plan/plan_ranking.py --measured docs/data/plan_ranking-DATE.json

Every layout train_gpt.py runs at 4 ranks (dp x tp x pp, ZeRO 0-3, FSDP, every schedule;
benchmarks/plan/_plan_layouts.py) trains the GPT of benchmarks/pipeline/train_gpt_layouts.py (d_model
128, 8 layers, 8 heads, vocab 256, 64 tokens, global batch 32 in 4 micro-batches per dp
rank): one warm-up step, then --steps steps, the step time the median of the slowest
rank's, and the CPU seconds the ranks' processes used per step, summed; --passes times
(default 2) over the layouts, every other pass in reverse order, each layout's least step
kept (other processes only add time, and a burst of load hits the layouts that run then).
The planner prices the same layouts for this machine (strategies/plan/local.py: a core's rate and a cost per
block call fitted to a block's forward and backward timed at the layouts' shapes, AdamW's
step, a copy bandwidth or the fit of --bench-json, and what a collective costs where the 4
ranks share the cores, measured on the ranks first: local.collective_costs; the model of
ranks that outnumber the cores: strategies/plan/host.py). Reported: Spearman's rho between
the predicted and measured orders, the measured step of the predicted best against the
measured best (target: within 10%), and the predicted CPU per step against the measured.
Writes docs/benchmarks.md's section, docs/data/plan_ranking-DATE.json and
docs/data/plan_ranking-DATE.png (tensor storage per layout by role, predicted; the
predicted step by part beside the measured step).
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
from _plan_layouts import layouts, options  # noqa: E402
from spawn import RankPool  # noqa: E402

from pycollectives.strategies.plan.layout import Layout, Priced, price  # noqa: E402
from pycollectives.strategies.plan.local import collective_costs, local_request  # noqa: E402
from pycollectives.strategies.plan.trainer import trainer_storage  # noqa: E402

BEGIN, END = "<!-- plan_ranking:begin -->", "<!-- plan_ranking:end -->"
MODEL = dict(layers=8, hidden=128, heads=8, vocab=256, seq=64)
BATCH, MICRO = 32, 4
PIPE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbh1": "zb-h1"}
DATA = ROOT / "docs" / "data"


def job_steps(comm, lays: list[dict], steps: int) -> list[tuple[float, float]]:  # noqa: ANN001
    """Per layout: this rank's median step seconds after one warm-up step, and the median
    CPU seconds its process (the communicator's progress threads included) used per step."""
    import torch

    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D
    from pycollectives.strategies.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    m = MODEL
    cfg = GPTConfig(vocab_size=m["vocab"], seq_len=m["seq"], n_layer=m["layers"],
                    n_head=m["heads"], d_model=m["hidden"])  # fmt: skip
    out = []
    for lo in lays:
        with ParallelDims(comm, dp=lo["dp"], tp=lo["tp"], pp=lo["pp"]) as dims:
            trainer = Trainer3D(dims, cfg, options(lo, BATCH, MICRO))
            trainer.step()
            walls, cpus = [], []
            for _ in range(steps):
                c0 = time.process_time()
                walls.append(trainer.step().seconds)
                cpus.append(time.process_time() - c0)
            out.append((statistics.median(walls), statistics.median(cpus)))
            del trainer
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def plot(path: Path, names: list[str], parts: list[dict], storage: list[dict], measured: list[float]) -> None:  # fmt: skip
    """Two panels: predicted tensor storage per layout by role; step time by part
    (predicted: Priced.time) with the measured step as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 9), sharex=True)
    x = range(len(names))
    bottom = [0.0] * len(names)
    for role in ("params", "grads", "optimizer", "reduce_buffers"):
        vals = [s[role] / 2**20 for s in storage]
        ax1.bar(x, vals, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_ylabel("tensor storage, busiest rank (MiB)")
    ax1.legend(fontsize=8)
    bottom = [0.0] * len(names)
    for part in ("compute", "tp_collectives", "pipeline_bubble", "dp_exposed", "optimizer",
                 "shared_cores", "collective_waits"):  # fmt: skip
        vals = [p.get(part, 0.0) * 1e3 for p in parts]
        ax2.bar(x, vals, bottom=bottom, label=f"predicted {part}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.plot(list(x), [t * 1e3 for t in measured], "k_", markersize=14, mew=2, label="measured")
    ax2.set_ylabel("step time (ms)")
    ax2.legend(fontsize=8)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names, rotation=75, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2, help="passes over the layouts, every "
                    "other one in reverse order; a layout's step is its least (default 2)")  # fmt: skip
    ap.add_argument("--bench-json")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a recorded run")
    ap.add_argument("--measured", metavar="JSON", help="price the layouts now against the "
                    "steps a recorded run measured (docs/data/plan_ranking-DATE.json) instead "
                    "of running them; prints, writes nothing")  # fmt: skip
    args = ap.parse_args()
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        rows = data["layouts"]
        plot(Path(args.replot).with_suffix(".png"), [r["name"] for r in rows],
             [r["predicted_parts_s"] for r in rows], [r["predicted_storage"] for r in rows],
             [r["measured_s"] for r in rows])  # fmt: skip
        return 0
    load0, t0 = os.getloadavg(), time.perf_counter()
    lays = layouts(4, MODEL["layers"], MODEL["heads"])
    pool = RankPool(4)
    try:
        costs = pool.run(collective_costs, timeout=300)[0]  # the same on every rank
        req, links, said = local_request(MODEL, BATCH, 4, MICRO, args.bench_json, costs)
        passes = []  # per pass: per layout (slowest rank's step, all ranks' CPU per step)
        for k in range(0 if args.measured else max(1, args.passes)):
            order = list(range(len(lays)))[:: -1 if k % 2 else 1]
            per_rank = pool.run(job_steps, [lays[i] for i in order], args.steps, timeout=900)
            got = {i: (max(r[j][0] for r in per_rank), sum(r[j][1] for r in per_rank))
                   for j, i in enumerate(order)}  # fmt: skip
            passes.append([got[i] for i in range(len(lays))])
    finally:
        pool.close()
    # Other processes only ever add time: each layout's least step of the passes (a layout
    # early in one pass is late in the next), and the CPU of that pass.
    best = [min(ps[i] for ps in passes) for i in range(len(lays))] if passes else []
    measured, cpu = [b[0] for b in best], [b[1] for b in best]
    priced, storage, names = [], [], []
    for lo in lays:
        sharding = "none" if lo["mode"] == "zero0" else lo["mode"]
        sched = PIPE[lo["schedule"]] if lo["pp"] > 1 else "none"
        p = price(req, Layout(lo["dp"], lo["tp"], lo["pp"], sharding, sched, MICRO, "none"), links)
        if not isinstance(p, Priced):
            raise SystemExit(f"the planner rejects a layout train_gpt.py runs: {lo}: {p.reason}")
        priced.append(p)
        st = trainer_storage(req.model, lo["dp"], lo["tp"], lo["pp"], lo["mode"],
                             sched if lo["pp"] > 1 else "1f1b")  # fmt: skip
        storage.append(max(st, key=lambda r: sum(r.values())))
        names.append(f"dp{lo['dp']} tp{lo['tp']} pp{lo['pp']} {lo['mode']}"
                     + (f" {lo['schedule']}" if lo["pp"] > 1 else ""))  # fmt: skip
    if args.measured:  # a recorded run's steps, by layout name
        rec = json.loads(Path(args.measured).read_text())
        by_name = {r["name"]: r for r in rec["layouts"]}
        if set(by_name) != set(names):
            raise SystemExit(f"--measured {args.measured}: not the layouts of this script")
        measured = [by_name[n]["measured_s"] for n in names]
        cpu = [by_name[n].get("measured_cpu_s", 0.0) for n in names]
        said.append(f"measured steps from {args.measured} ({rec['date']}, load average "
                    f"{rec['load_start'][0]:.2f} at its start, {rec['load_end'][0]:.2f} at its end)")  # fmt: skip
        args.no_write = True
    predicted = [p.step_s for p in priced]
    rho = spearman(predicted, measured)
    best_pred = min(range(len(lays)), key=lambda i: priced[i].order())  # plan()'s order
    best_meas = min(range(len(lays)), key=lambda i: measured[i])
    gap = measured[best_pred] / measured[best_meas] - 1
    summary = (
        f"4 ranks, {len(lays)} layouts: Spearman rho {rho:.2f}; predicted best {names[best_pred]} "
        f"measures {measured[best_pred] * 1e3:.1f} ms, {gap:+.0%} against the measured best "
        f"{names[best_meas]} ({measured[best_meas] * 1e3:.1f} ms; target within 10%)"
    )
    table = ["| layout | predicted ms | measured ms | predicted rank | measured rank "
             "| predicted CPU ms | measured CPU ms |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rp = {i: k + 1 for k, i in enumerate(sorted(range(len(lays)), key=lambda i: priced[i].order()))}
    rm = {i: k + 1 for k, i in enumerate(sorted(range(len(lays)), key=lambda i: measured[i]))}
    for i in sorted(range(len(lays)), key=lambda i: measured[i]):
        table.append(f"| {names[i]} | {predicted[i] * 1e3:.2f} | {measured[i] * 1e3:.1f} | "
                     f"{rp[i]} | {rm[i]} | {priced[i].host_cpu_s * 1e3:.0f} | "
                     f"{cpu[i] * 1e3:.0f} |")  # fmt: skip
    load1 = os.getloadavg()
    date = datetime.date.today().isoformat()
    notes = [f"Result: {summary}.", *[f"Planner input: {s}." for s in said],
             f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
             f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all."]  # fmt: skip
    # Busy the whole run, the 4 ranks alone bring the 1-minute load to about 4 at its end:
    # other processes show as load at the start, or above the ranks' at the end.
    spare = (os.cpu_count() or 1) / 2
    if load0[0] > spare or load1[0] > 4 + spare:
        notes.append(
            f"The load average exceeded half of the {os.cpu_count()} cores (at the start, or "
            "beyond the run's own 4 ranks at its end): other processes "
            "take the ranks' cores for tens of ms at a time, a layout's measured step moves "
            "by more than the layouts differ, and the ranking cannot be judged; a quiet "
            "rerun is needed. The planner prices the collectives' costs on shared cores "
            "as measured at the start (collective_costs), not the load's changes."
        )
    if not args.no_write:
        DATA.mkdir(exist_ok=True)
        plot(DATA / f"plan_ranking-{date}.png", names, [p.time for p in priced], storage, measured)
        (DATA / f"plan_ranking-{date}.json").write_text(json.dumps({
            "summary": summary, "command": "python benchmarks/plan/plan_ranking.py " + " ".join(sys.argv[1:]),
            "machine": f"{cpu_model()}, {os.cpu_count()} cores", "date": date,
            "load_start": load0, "load_end": load1, "planner_inputs": said,
            "layouts": [{"name": n, "predicted_s": p.step_s, "predicted_parts_s": p.time,
                         "measured_s": m, "predicted_cpu_s": p.host_cpu_s, "measured_cpu_s": u,
                         "predicted_storage": s}
                        for n, p, m, u, s in zip(names, priced, measured, cpu, storage, strict=True)],
        }, indent=1) + "\n")  # fmt: skip
        notes.append(f"Plot: docs/data/plan_ranking-{date}.png.")
    argv = " ".join(sys.argv[1:])
    emit_section(BEGIN, END, "Planner: step-time ranking of train_gpt.py's 4-rank layouts",
                 f"`python benchmarks/plan/plan_ranking.py{' ' + argv if argv else ''}`", notes, table,
                 not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
