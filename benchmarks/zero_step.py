"""Step time of ZeRO-1/2/3 and FSDP on a ~50M-parameter GPT with 2 ranks, in one
run, against strategies.DDP, torch FSDP2 over gloo and over "pycoll", and
DeepSpeed ZeRO-2/3 over gloo (where it imports).

    python benchmarks/zero_step.py                   # ~50M GPT, 2 ranks, 2 rounds
    python benchmarks/zero_step.py --layers 2 --d-model 128 --no-write

Every rank builds each setup in turn (benchmarks/_zero_cells.py), runs
--warmup untimed and --steps timed training steps (zero_grad, forward,
backward, AdamW step), and drops it; --rounds repeat that with the order
reversed every other round, so the drift of a shared machine hits all setups
alike. Step = median over the timed steps of the slowest rank. Where the time
goes: "compute" is one process's step on the same per-rank batch with no
communication; for pycollectives' setups the engine's meter gives the time
blocked on all-gathers and reduce-scatters (the exposed communication) and
the gradient copies, comm.stats() the collectives' own time and bytes; for
torch FSDP2 and DeepSpeed, step - compute is all that is measured.
Writes docs/benchmarks.md between <!-- zero_step:begin --> and <!-- zero_step:end -->.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _ranks  # noqa: E402
from _doc import emit_section  # noqa: E402
from _zero_cells import deepspeed_status, medians, rank_main  # noqa: E402
from _zero_setups import save_initial  # noqa: E402

BEGIN, END = "<!-- zero_step:begin -->", "<!-- zero_step:end -->"
LABELS = {
    "compute": "one process, no communication (compute)",
    "dp": "strategies.DDP",
    "zero1": "ZeRO-1 (ZeroOptimizer stage 1)",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3 (prefetch 2)",
    "fsdp": "fully_shard (reshard, prefetch 2)",
    "fsdp2-gloo": "torch FSDP2 over gloo",
    "fsdp2-pycoll": 'torch FSDP2 over "pycoll"',
    "ds2": "DeepSpeed ZeRO-2 over gloo",
    "ds3": "DeepSpeed ZeRO-3 over gloo",
}


def gpt_config(args: argparse.Namespace):  # noqa: ANN201 - GPTConfig
    from pycollectives.strategies.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
    )


def common_args(doc: str, default_cells: str) -> argparse.ArgumentParser:
    """The options zero_step.py and zero_prefetch.py share."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cells", default=default_cells)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per cell and round")
    ap.add_argument("--no-write", action="store_true")
    return ap


def measure(args: argparse.Namespace, cells: list[str]) -> tuple[dict, list[str]]:
    """Runs the cells on fresh ranks; returns their medians and the notes on
    the run (model, load average before and after, duration)."""
    from pycollectives.strategies.models.gpt import GPT

    cfg = gpt_config(args)
    params = sum(p.numel() for p in GPT(cfg, device="meta").parameters())
    load0, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "initial.pt")
        save_initial(cfg, init)
        per_rank = [{c: [] for c in cells} for _ in range(args.ranks)]
        for rnd in range(args.rounds):  # fresh ranks per round
            got = _ranks.run(rank_main, args.ranks, cells, cfg, args, rnd, init, timeout=1800)
            for mine, theirs in zip(per_rank, got, strict=True):
                for c in cells:
                    mine[c] += theirs[c]
    load1 = os.getloadavg()
    notes = [
        f"Model: GPT vocab {args.vocab}, seq {args.seq}, {args.layers} blocks, d_model "
        f"{args.d_model}, {args.heads} heads, tied head: {params / 1e6:.1f}M fp32 parameters; "
        f"{args.ranks} ranks with one torch thread each, batch {args.batch} x {args.seq} tokens "
        f"per rank, AdamW (torch's, every setup). {args.rounds} rounds, each on fresh ranks, "
        f"of (each setup built, {args.warmup} warm-up and {args.steps} timed steps, dropped), "
        "the order reversed every other round; step = median over the timed steps of the "
        "slowest rank.",
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)} (a shared 2-core machine); "
        f"{time.perf_counter() - t0:.0f} s in all.",
    ]
    return medians(per_rank, args.rounds), notes


def paired(m: dict, a: str, b: str) -> float:
    """Median over rounds of (a's step / b's step in the same round): the two
    ran minutes apart at most, so the machine's drift between rounds cancels."""
    return statistics.median(x / y for x, y in zip(m[a]["rounds"], m[b]["rounds"], strict=True))


def render(m: dict, ds_error: str) -> list[str]:
    """The table and the verdicts."""
    comp = m["compute"]
    dp = m["dp"]["step"] if "dp" in m else None
    rows = [
        "| setup | step ms | step / DDP | forward + backward ms | update ms "
        "| exposed all-gather ms | exposed reduce-scatter ms | gradient copy-in ms "
        "| all-gather after step ms | other, forward + backward ms | other, update ms "
        "| collectives' own time ms | MB sent per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell, label in LABELS.items():
        if cell not in m:
            if cell.startswith("ds") and ds_error:
                rows.append(f"| {label} | not run: {ds_error} |" + " |" * 11)
            continue
        r = m[cell]
        ratio = f"{paired(m, cell, 'dp'):.2f}" if dp else "-"
        head = f"| {label} | {r['step'] * 1e3:.0f} | {ratio} | {r['fb'] * 1e3:.0f} | {r['opt'] * 1e3:.0f}"
        if cell == "compute":
            rows.append(head + " |" + " |" * 8)
            continue
        fb, opt = (r[k] - comp[k] for k in ("fb", "opt"))
        if "gather_wait_s" in r:
            ag, rs, cp, st = (
                r[k] for k in ("gather_wait_s", "reduce_wait_s", "grad_copy_s", "step_gather_s")
            )
            parts = [ag, rs, cp, st, fb - ag - rs - cp, opt - st]
            cells = " | ".join(f"{x * 1e3:.0f}" for x in parts)
        else:
            cells = f"- | - | - | - | {fb * 1e3:.0f} | {opt * 1e3:.0f}"
        own = f"{r['comm_s'] * 1e3:.0f} | {r['bytes'] / 1e6:.0f}" if r["bytes"] else "- | -"
        rows.append(f"{head} | {cells} | {own} |")
    verdicts = []
    if dp:
        for z in ("zero1", "zero2"):
            if z in m:
                q = paired(m, z, "dp")
                verdicts.append(
                    f"{LABELS[z].split(' (')[0]} / DDP = {q:.2f}: {'met' if q <= 1.10 else 'missed'}"
                )
    for ours in ("zero3", "fsdp"):
        for other in ("fsdp2-gloo", "fsdp2-pycoll", "ds3"):
            if ours in m and other in m:
                q = paired(m, ours, other)
                verdicts.append(
                    f"{LABELS[ours].split(' (')[0]} / {LABELS[other]} = {q:.2f}: "
                    f"{'met' if q < 1 else 'missed'}"
                )
    return [
        *rows,
        "",
        "Step: median of the slowest rank; step / DDP and the ratios below: the median over "
        "rounds of the ratio of the two setups' medians in the same round. The other columns: medians of rank 0 (so they need "
        "not add up to the step). forward + backward includes zero_grad and the communication "
        "that backward waits for; update is the optimizer step and what follows it (ZeRO-1/2: "
        "the all-gather of the updated parameters). other = that phase's time above the "
        "one-process phase, less the measured columns: hooks, flattening, waiting for the "
        "slower rank, and in update the optimizer's own work (ZeroOptimizer and fully_shard "
        "step 1/N of the state, over one flat shard per unit: less than the one process's "
        "per-parameter AdamW, hence negative). torch FSDP2 and DeepSpeed have no meter: their "
        "other columns are communication, copies and framework together. collectives' own "
        "time: comm.stats() time_s of the pycollectives communicator (overlapped or not).",
        "",
        "Targets (ZeRO-1/2 within 10% of strategies.DDP; ZeRO-3 and FSDP faster than torch "
        f"FSDP2 on either backend and than DeepSpeed ZeRO-3): {'; '.join(verdicts)}.",
    ]


def main() -> int:
    ap = common_args(__doc__, ",".join(LABELS))
    args = ap.parse_args()
    cells = args.cells.split(",")
    ds_error = deepspeed_status()
    if ds_error:
        cells = [c for c in cells if not c.startswith("ds")]
    m, notes = measure(args, cells)
    notes.append(
        "torch FSDP2: `fully_shard` per block and on the root (defaults: reshard after "
        'forward), the gloo group or a "pycoll" group (pycollectives\' torch.distributed '
        "backend) of the same ranks. DeepSpeed: `deepspeed.initialize` with ZeRO stage 2 or 3 "
        "at its defaults, torch AdamW (`torch_adam`), fp32, on the gloo default group; "
        + (
            f"DeepSpeed {__import__('deepspeed').__version__} installed with "
            "`DS_BUILD_OPS=0 pip install deepspeed` (in a venv with --system-site-packages; "
            "the command then runs with that venv's python)."
            if not ds_error
            else f"DeepSpeed did not import: {ds_error}."
        )
    )
    argv = " ".join(sys.argv[1:])
    emit_section(
        BEGIN,
        END,
        "ZeRO and FSDP: step time on a ~50M-parameter GPT, 2 ranks",
        f"`python benchmarks/zero_step.py{' ' + argv if argv else ''}`",
        notes,
        render(m, ds_error),
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
