"""The pipeline runtime measured against its simulation and the bubble
formulas, with stages of fixed duration and with real compute.

    python benchmarks/pipeline/pipeline_bubble.py [--ps 2,4,8] [--t-ms 20] [--steps 3] [--no-write]

1. Stand-in stages (`SleepStage`): F, B, I and W sleep t_F = t_B = t_W = t
   (a full B 2t; interleaved stages t/v each, so that a rank's work per
   micro-batch is the same) and pass 256-byte activations through the real
   runtime. Sleeping ranks leave the 2 cores free, so 8 ranks run the
   schedule as 8 machines would. GPipe, 1F1B, interleaved (v = 2) and ZB-H1
   at p = 2, 4, 8 and m = p, 2p, 4p: the measured bubble (from the runtime's
   records) against simulate() with the same costs (t_p2p = 0, as the
   formulas), against the replay (below), and against the closed form.
2. Real compute at p = 2: GPT stages (one thread per rank), the same four
   schedules; simulated with the mean measured F, B (or I) and W durations.
3. Activation memory at p = 2, m = 8, GPT stages, each schedule in fresh
   processes: what the stages hold for backward (counted by the runtime:
   saved tensors, outputs, W's inputs) and the growth of the heap in use
   during the step (glibc mallinfo2, sampled every millisecond).
4. docs/data/pipeline_*.png: one 1F1B and one ZB-H1 step measured beside
   simulated (stand-ins at p = 4, m = 8; GPT stages at p = 2); Chrome traces
   of the same steps in --trace-dir.

The replay simulates the schedule again with each compute's measured
duration and t_p2p = the measured hop latency: measured minus replayed is
the runtime's own time between actions. The hop latency is the median, over
the computes that waited for a message,
of the time from the end of the compute that produced it on another rank to
their start. Each measured figure is from the step with the median makespan
of --steps steps, after one warm-up step. Rewrites the section of
docs/benchmarks.md between the pipeline_bubble markers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section, free_port  # noqa: E402

BEGIN, END = "<!-- pipeline_bubble:begin -->", "<!-- pipeline_bubble:end -->"
DATA = Path(__file__).resolve().parents[2] / "docs" / "data"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
LABEL = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved v=2", "zb-h1": "ZB-H1"}
SPEC = (1, 64)  # stand-in activations: 256 bytes


class SleepStage:
    """A stage whose F, B, I and W sleep fixed times (seconds) and pass
    zeros of shape SPEC on: the runtime's stage protocol (AutogradStage's
    methods) without compute. Counts its micro-batches as AutogradStage."""

    def __init__(self, index: int, num_stages: int, t_f: float, t_b: float, t_w: float) -> None:
        self.index, self.num_stages = index, num_stages
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.graph: set[int] = set()
        self.held: set[int] = set()

    def input_spec(self, inputs):  # noqa: ANN001, ANN201
        from pycollectives.strategies.pipeline import TensorSpec

        return inputs if self.index == 0 else TensorSpec(SPEC, torch.float32)

    def output_spec(self, inputs):  # noqa: ANN001, ANN201
        from pycollectives.strategies.pipeline import TensorSpec

        return None if self.index == self.num_stages - 1 else TensorSpec(SPEC, torch.float32)

    def tied_parameters(self) -> dict:
        return {}

    def activations(self) -> tuple[int, int, int]:
        return len(self.graph), len(self.held), 0

    def forward(self, j: int, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        time.sleep(self.t_f)
        self.graph.add(j)
        self.held.add(j)
        return torch.zeros(()) if self.index == self.num_stages - 1 else torch.zeros(SPEC)

    def backward(self, j: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.t_b + self.t_w)
        self.graph.discard(j)
        self.held.discard(j)
        return None if self.index == 0 else torch.zeros(SPEC)

    def backward_input(self, j: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.t_b)
        self.graph.discard(j)
        return None if self.index == 0 else torch.zeros(SPEC)

    def backward_weight(self, j: int) -> None:
        time.sleep(self.t_w)
        self.held.discard(j)


def gpt_config():  # noqa: ANN201
    """4 blocks, d_model 256, seq 128, vocab 512: activations of 512 KiB per
    micro-batch of 4 sequences; a 2-block stage forward ~25 ms on one core."""
    from pycollectives.strategies.models import GPTConfig

    return GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=256, seed=1)


def real_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 512, (4, 128), generator=g), torch.randint(0, 512, (4, 128), generator=g))
        for _ in range(m)
    ]


class _HeapPeak:
    """Samples the heap in use (glibc mallinfo2: arena + mmapped blocks in
    use) every millisecond on a thread; `peak - base` is the growth."""

    def __init__(self) -> None:
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks")] + [
                (n, ctypes.c_size_t)
                for n in ("hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
            ]

        self._info = ctypes.CDLL("libc.so.6").mallinfo2
        self._info.restype = Info
        self.base = self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        info = self._info()
        return info.uordblks + info.hblkhd

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now()) - self.base


def worker(rank: int, p: int, port: int, mode: str, cases: list, args: dict, q: object) -> None:
    """Runs `cases` ((name, v, m) each) on this rank; rank 0 reports, a rank
    that fails reports its traceback."""
    try:
        _worker(rank, p, port, mode, cases, args, q)
    except BaseException:
        import traceback

        q.put(("error", rank, traceback.format_exc()))
        raise


def _worker(rank: int, p: int, port: int, mode: str, cases: list, args: dict, q: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(p))
    torch.set_num_threads(1)
    import pycollectives as pc
    from pycollectives.strategies.pipeline import PipelineRuntime, build, gpt_stages
    from pycollectives.strategies.pipeline.communications import gather_records

    comm = pc.init(timeout=300)
    out = []
    for name, v, m in cases:
        s = build(name, p, m, v)
        if mode == "sleep":
            u = args["t"] / v
            stages = [SleepStage(i, s.num_stages, u, u, u) for i in s.stages_of(rank)]
            mbs = [(torch.zeros(SPEC), torch.zeros(SPEC)) for _ in range(m)]
        else:
            stages = gpt_stages(gpt_config(), s.stages_of(rank), s.num_stages)
            mbs = real_batches(m)
        rt = PipelineRuntime(s, stages, comm, timeout=300)
        steps = []
        warmup = 0 if mode == "memory" else 1
        for i in range(args["steps"] + warmup):
            comm.barrier()
            heap = _HeapPeak() if mode == "memory" else None
            result = rt.step(mbs)
            grown = heap.stop() if heap is not None else 0
            records = gather_records(comm, result.records)
            mine = torch.tensor([result.peak_held, result.peak_bytes, grown], dtype=torch.int64)
            every = torch.empty(3 * p, dtype=torch.int64)
            comm.all_gather(every, mine)
            if i >= warmup:
                steps.append((records, every.view(p, 3).tolist()))
            if mode != "sleep":
                for st in stages:
                    st.zero_grad(set_to_none=True)
        if rank == 0:
            out.append((name, v, m, steps))
    comm.close()
    if rank == 0:
        q.put(("ok", 0, out))


def launch(p: int, mode: str, cases: list, args: dict) -> list:
    """Runs worker() on p fresh processes; rank 0's results. Raises
    SystemExit with a rank's traceback if one fails."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, p, port, mode, cases, args, q)) for r in range(p)]
    for pr in procs:
        pr.start()
    try:
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            try:
                status, rank, value = q.get(timeout=1.0)
            except queue.Empty:
                if any(pr.exitcode not in (None, 0) for pr in procs):
                    raise SystemExit(f"{mode} p={p}: a rank died without reporting") from None
                continue
            if status == "error":
                raise SystemExit(f"{mode} p={p}: rank {rank} failed:\n{value}")
            return value
        raise SystemExit(f"{mode} p={p}: no result within an hour")
    finally:
        for pr in procs:
            pr.join(60)
            if pr.is_alive():
                pr.kill()


def formula(name: str, p: int, m: int, v: int) -> tuple[str, float]:
    """The closed form and its metric: a fraction of the step, or a ratio to
    the ideal (bubble-free) time."""
    if name in ("gpipe", "1f1b"):
        return "fraction", (p - 1) / (m + p - 1)
    if name == "interleaved":
        return "ratio", (p - 1) / (v * m)
    return "ratio", (p - 1) / (3 * m)


def hop_latency(records: list) -> float:
    """Median seconds from the end of a compute on one rank to the start of
    the compute on another rank that waited for its message."""
    from pycollectives.strategies.pipeline import Kind

    compute = sorted((r for r in records if r.action.is_compute), key=lambda r: r.start)
    end = {(r.action.kind, r.action.stage, r.action.microbatch): r for r in compute}
    prev_end: dict[int, float] = {}
    hops = []
    for r in compute:
        a = r.action
        src = None
        if a.kind is Kind.FORWARD:
            src = end.get((Kind.FORWARD, a.stage - 1, a.microbatch))
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            src = end.get((a.kind, a.stage + 1, a.microbatch))
        idle = r.start - prev_end.get(r.rank, r.start)
        if (
            src is not None
            and src.rank != r.rank
            and idle > 0
            and src.end > prev_end.get(r.rank, 0)
        ):
            hops.append(r.start - src.end)
        prev_end[r.rank] = r.end
    return statistics.median(hops) if hops else 0.0


def median_step(steps: list, p: int) -> tuple:
    from pycollectives.strategies.pipeline import measure

    return sorted(steps, key=lambda st: measure(st[0], p).makespan)[len(steps) // 2]


def replay(schedule, records: list, t_p2p: float):  # noqa: ANN001, ANN201
    """The schedule simulated with each compute's measured duration and
    messages taking t_p2p: what the step would take if the runtime added
    nothing but the hops."""
    from pycollectives.strategies.pipeline import Record, check_static, execute, measure

    took = {
        (r.action.kind, r.action.stage, r.action.microbatch): r.end - r.start
        for r in records
        if r.action.is_compute
    }
    key = lambda a: (a.kind, a.stage, a.microbatch)  # noqa: E731
    out = execute(schedule, check_static(schedule), lambda a: took[key(a)], t_p2p, overlap=True)
    return measure([Record(*r) for r in out], schedule.p)


def bubble_rows(p: int, results: list, costs) -> tuple[list[str], list]:  # noqa: ANN001
    """Table rows (formula, simulated, replayed, measured) and the chosen
    steps."""
    from pycollectives.strategies.pipeline import build, measure, simulate

    rows, chosen = [], []
    for name, v, m, steps in results:
        s = build(name, p, m, v)
        records, _ = median_step(steps, p)
        got = measure(records, p)
        t_f, t_b, t_w, unit = costs(name, v, records)
        lat = hop_latency(records)
        sim = simulate(s, t_f, t_b, t_w)
        again = replay(s, records, lat)
        metric, closed = formula(name, p, m, v)
        attr = "bubble_fraction" if metric == "fraction" else "bubble_ratio"
        want, want_again, have = (getattr(x, attr) for x in (sim, again, got))
        rows.append(
            f"| {LABEL[name]} | {p} | {m} | {metric} | {closed:.4f} | {want:.4f} | {have:.4f} | "
            f"{(have - want) / want * 100:+.0f}% | {want_again:.4f} | "
            f"{(have - want_again) / want_again * 100:+.0f}% | {lat * 1e6:.0f} | "
            f"{sim.makespan * unit * 1e3:.0f} / {again.makespan * 1e3:.0f} / "
            f"{got.makespan * 1e3:.0f} |"
        )
        chosen.append((name, m, records, sim, unit))
    return rows, chosen


HEAD = (
    "| schedule | p | m | bubble as | formula | simulated | measured | measured vs simulated "
    "| replayed | measured vs replayed | hop (us) | step ms: simulated / replayed / measured |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", default="2,4,8")
    ap.add_argument("--t-ms", type=float, default=20.0, help="t_F = t_B = t_W of the stand-ins")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--real-m", default="4,8")
    ap.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "pipeline_bubble"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t = args.t_ms / 1e3
    os.makedirs(args.trace_dir, exist_ok=True)
    pictures: list[str] = []

    def picture(tag: str, title: str, records: list, sim, unit: float) -> None:  # noqa: ANN001
        from pycollectives.strategies.pipeline import draw_measured_and_simulated, save_chrome_trace

        draw_measured_and_simulated(
            records, sim.records, DATA / f"{tag}.png", title=title, sim_unit=unit
        )
        save_chrome_trace(records, os.path.join(args.trace_dir, f"{tag}.json"), name=title)
        pictures.append(f"![{title}](data/{tag}.png)")

    def sleep_costs(name: str, v: int, records: list) -> tuple:
        return 1.0, 1.0, 1.0, t / v  # in units of one stage's t

    lines = [HEAD]
    for p in [int(x) for x in args.ps.split(",")]:
        cases = [(n, v, m) for n, v in SCHEDULES for m in (p, 2 * p, 4 * p)]
        print(f"+ stand-in stages, p={p}", flush=True)
        got = launch(p, "sleep", cases, {"t": t, "steps": args.steps})
        rows, chosen = bubble_rows(p, got, sleep_costs)
        lines += rows
        for name, m, records, sim, unit in chosen:
            if p == 4 and m == 8 and name in ("1f1b", "zb-h1"):
                title = f"{LABEL[name]}, p=4, m=8, stand-in stages (t = {args.t_ms:g} ms)"
                picture(f"pipeline_{name.replace('-', '')}_p4_m8", title, records, sim, unit)

    def real_costs(name: str, v: int, records: list) -> tuple:
        """The mean measured F, I (or B) and W durations, in seconds."""
        by_kind: dict[str, list[float]] = {}
        for r in records:
            if r.action.is_compute:
                by_kind.setdefault(r.action.kind.value, []).append(r.end - r.start)
        mean = {k: statistics.mean(d) for k, d in by_kind.items()}
        if name == "zb-h1":
            return mean["F"], mean["I"], mean["W"], 1.0
        return mean["F"], mean["B"], 0.0, 1.0

    real_m = [int(x) for x in args.real_m.split(",")]
    print("+ GPT stages, p=2", flush=True)
    got = launch(
        2, "real", [(n, v, m) for n, v in SCHEDULES for m in real_m], {"steps": args.steps}
    )
    real_rows, chosen = bubble_rows(2, got, real_costs)
    for name, m, records, sim, unit in chosen:
        if m == max(real_m) and name in ("1f1b", "zb-h1"):
            title = f"{LABEL[name]}, p=2, m={m}, GPT stages"
            picture(f"pipeline_{name.replace('-', '')}_p2_m{m}_gpt", title, records, sim, unit)

    print("+ activation memory, p=2, m=8", flush=True)
    mem = [
        "| schedule | rank | micro-batches held (peak) | bytes held, counted | heap growth in the step |",
        "|---|---|---|---|---|",
    ]
    for name, v in SCHEDULES:
        ((_, _, _, steps),) = launch(2, "memory", [(name, v, 8)], {"steps": 1})
        for r, (held, counted, grown) in enumerate(steps[0][1]):
            mem.append(
                f"| {LABEL[name]} | {r} | {held} | {counted / 2**20:.1f} MiB | "
                f"{grown / 2**20:.1f} MiB |"
            )
    tables = [
        f"### Stand-in stages (t_F = t_B = t_W = {args.t_ms:g} ms)",
        "",
        *lines,
        "",
        "### Real compute: GPT stages, p = 2",
        "",
        HEAD,
        *real_rows,
        "",
        "### Activation memory: GPT stages, p = 2, m = 8",
        "",
        *mem,
        "",
        *pictures,
    ]
    notes = [
        "Bubble: from the runtime's records, first compute to last compute, idle = p x step "
        "- compute; formula: (p-1)/(m+p-1) of the step (GPipe, 1F1B), (p-1)/(v m) and "
        "(p-1)/(3m) of the ideal time (interleaved, ZB-H1); simulated: simulate() with the "
        "nominal costs and t_p2p = 0, as the formulas; replayed: the same schedule simulated "
        "with each compute's measured duration and t_p2p = the measured hop latency (what is "
        "left between replayed and measured is the runtime's own time between actions). Each "
        f"row from the median-makespan step of {args.steps} after a warm-up.",
        "GPT stages: GPTConfig(vocab 512, seq 128, 4 blocks, 4 heads, d_model 256), micro-batches "
        "of 4 sequences (512 KiB activations), one thread per rank; costs: mean measured F, B "
        "(I) and W.",
        f"Chrome traces of the pictured steps: --trace-dir ({args.trace_dir} in this run).",
    ]
    cmd = "`python benchmarks/pipeline/pipeline_bubble.py`"
    if args.ps != "2,4,8" or args.t_ms != 20.0:
        cmd = f"`python benchmarks/pipeline/pipeline_bubble.py --ps {args.ps} --t-ms {args.t_ms:g}`"
    title = "Pipeline runtime: measured bubble against the simulation"
    emit_section(BEGIN, END, title, cmd, notes, tables, not args.no_write)


if __name__ == "__main__":
    main()
