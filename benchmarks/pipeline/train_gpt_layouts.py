"""Tokens/s of 3D training (strategies/parallel3d/, what examples/train_gpt.py
runs) for every dp x tp x pp layout of 4 and of 8 processes, and the
tensor-parallel layers' time against the plain nn.Linear at tp = 2.

    python benchmarks/pipeline/train_gpt_layouts.py [--steps 6] [--worlds 4,8] [--no-write]

1. Layouts: one set of `world` ranks (one compute thread each) runs every
   ordered factorization dp x tp x pp = world in turn, each on its own
   ParallelDims and Trainer3D (1F1B, ZeRO off): the GPT below, one warm-up
   step, then --steps steps; tokens/s = the global batch's tokens / the
   median step time (rank 0's wall clock; the step is collective).
2. TP layers at tp = 2: ColumnParallelLinear (d -> 4d) and RowParallelLinear
   (4d -> d), forward + backward on [batch, seq, features] activations,
   against nn.Linear of the full size on rank 0 alone (rank 1 waiting),
   alternating: medians over --reps rounds after two warm-up rounds.

On a 2-core machine, 4 and 8 ranks share the 2 cores: the figures compare
the layouts' overheads (messages, bubbles, duplicated work), not a
parallel speedup. Rewrites the section between the train_gpt_layouts
markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section  # noqa: E402
from spawn import run  # noqa: E402

BEGIN, END = "<!-- train_gpt_layouts:begin -->", "<!-- train_gpt_layouts:end -->"
MODEL = dict(vocab_size=256, seq_len=64, n_layer=8, n_head=8, d_model=128, seed=0)
BATCH, MICRO = 32, 4  # global batch (samples), micro-batches per dp rank


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp == world, dp-major."""
    out = []
    for dp, tp in itertools.product(range(1, world + 1), repeat=2):
        if world % (dp * tp) == 0:
            out.append((dp, tp, world // (dp * tp)))
    return sorted(out, reverse=True)


def job_layouts(rank: int, world: int, steps: int) -> list[dict]:
    import pycollectives as pc
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D, TrainOptions
    from pycollectives.strategies.parallel_dims import ParallelDims

    comm = pc.init(timeout=300)
    config = GPTConfig(**MODEL)
    out = []
    for dp, tp, pp in layouts(world):
        with ParallelDims(comm, dp=dp, tp=tp, pp=pp) as dims:
            opts = TrainOptions(microbatches=MICRO, global_batch=BATCH, timeout=300)
            trainer = Trainer3D(dims, config, opts)
            trainer.step()  # warm-up
            stats = [trainer.step() for _ in range(steps)]
            secs = statistics.median(s.seconds for s in stats)
            out.append(dict(dp=dp, tp=tp, pp=pp, seconds=secs, tokens=stats[0].tokens,
                            loss=stats[-1].loss))  # fmt: skip
    comm.close()
    return out if rank == 0 else []


def job_tp_layers(rank: int, world: int, reps: int, d: int, tokens: int) -> dict:
    import pycollectives as pc
    from pycollectives.strategies.parallel_dims import ParallelDims
    from pycollectives.strategies.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = pc.init(timeout=300)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens // 128, 128, d, generator=g)
    h = torch.randn(tokens // 128, 128, 4 * d, generator=g)
    col_full, row_full = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def fwd_bwd(layer: torch.nn.Module, inp: torch.Tensor) -> float:
        comm.barrier()
        t = time.perf_counter()
        a = inp.clone().requires_grad_()
        layer(a).sum().backward()
        layer.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    out = {}
    with ParallelDims(comm, tp=2) as dims:
        for name, full, inp in (("column", col_full, x), ("row", row_full, h)):
            kind = ColumnParallelLinear if name == "column" else RowParallelLinear
            tp_layer = kind.from_linear(full, dims.tp_comm)
            tp_in = inp if name == "column" else inp.chunk(2, -1)[dims.tp_rank].contiguous()
            plain, par = [], []
            for rep in range(reps + 2):  # alternating, the first two rounds warm-up
                if rank == 0:
                    t = fwd_bwd(full, inp)  # rank 1 waits in the next barrier
                    plain += [t] if rep >= 2 else []
                else:
                    comm.barrier()
                t = fwd_bwd(tp_layer, tp_in)
                par += [t] if rep >= 2 else []
            out[name] = (statistics.median(plain) * 1e3 if plain else None,
                         statistics.median(par) * 1e3)  # fmt: skip
    comm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--d", type=int, default=512, help="TP layers: d_model")
    ap.add_argument("--tokens", type=int, default=1024, help="TP layers: tokens per call")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    rows = []
    for world in map(int, args.worlds.split(",")):
        start = time.time()
        rows += run(job_layouts, world, args.steps, timeout=900)[0]
        print(f"{world} ranks: {time.time() - start:.0f} s", flush=True)
    tp = run(job_tp_layers, 2, args.reps, args.d, args.tokens, timeout=600)[0]
    load.append(os.getloadavg()[0])
    table = [
        "| ranks | dp | tp | pp | median step (ms) | tokens/s | loss after the steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        world = r["dp"] * r["tp"] * r["pp"]
        table.append(f"| {world} | {r['dp']} | {r['tp']} | {r['pp']} | {r['seconds'] * 1e3:.1f} "
                     f"| {r['tokens'] / r['seconds']:,.0f} | {r['loss']:.3f} |")  # fmt: skip
    d, n = args.d, args.tokens
    tp_table = [
        "",
        f"Tensor-parallel layers at tp = 2 against nn.Linear, forward + backward, {n} tokens "
        f"of d = {d} (median of {args.reps}):",
        "",
        "| layer | nn.Linear, 1 rank (ms) | tp = 2, per rank (ms) | nn.Linear / tp |",
        "|---|---|---|---|",
    ]
    for name, label in (("column", f"ColumnParallelLinear {d} -> {4 * d}"),
                        ("row", f"RowParallelLinear {4 * d} -> {d}")):  # fmt: skip
        plain, par = tp[name]
        tp_table.append(f"| {label} | {plain:.2f} | {par:.2f} | {plain / par:.2f}x |")
    cfg = ", ".join(f"{k} {v}" for k, v in MODEL.items() if k != "seed")
    notes = [
        f"GPT: {cfg}; global batch {BATCH} x {MODEL['seq_len']} tokens, {MICRO} micro-batches "
        f"per dp rank, 1F1B, AdamW, fp32, one thread per rank; median of {args.steps} steps "
        "after one warm-up.",
        "4 and 8 ranks share 2 cores: the layouts differ by their overheads, not by speedup.",
        f"Load average (1 min) at the start and the end: {load[0]:.1f}, {load[1]:.1f} (the "
        "machine is shared: other jobs ran beside this one).",
    ]
    emit_section(BEGIN, END, "3D training: tokens/s per dp x tp x pp layout, TP layers",
                 "`python benchmarks/pipeline/train_gpt_layouts.py`", notes, table + tp_table,
                 not args.no_write)  # fmt: skip


if __name__ == "__main__":
    main()
