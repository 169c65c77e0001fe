"""Memory per rank of DP, ZeRO-1/2/3 and FSDP, measured, beside the ZeRO paper's formulas.

    python benchmarks/data_parallel/zero_memory.py                 # N = 1, 2, 4; fp32 and bf16
    python benchmarks/data_parallel/zero_memory.py --ranks 2 --no-write

For each strategy (strategies.DDP with gradients as bucket views, ZeroOptimizer
stages 1-3, fully_shard per block and root), world size N and precision (fp32
AdamW; bf16 compute with fp32 master weights and AdamW state), fresh ranks
train a GPT for a few steps and report: the bytes of tensor storage they hold
after a step, by role (each storage counted once: full parameters, fp32 master
copies or parameter shards, gradients, optimizer state, reduce-scatter window
buffers), and their resident set (VmRSS) at rest and at its peak over the
steps (VmHWM, reset after the first step), both less the RSS before the model
was built (torch and the communicator). Allocations above 64 KiB are mmap'ed
(MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the RSS.

The paper's bytes per parameter (Rajbhandari et al. 2020, Sec. 3; AdamW,
P parameters, N ranks):

    fp32: DP 16P, ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N, ZeRO-3 / FSDP 16P/N
    bf16 with fp32 master: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N

(ZeRO-3 in bf16 holds 14P/N: no 16-bit parameter shard is kept between gathers.)

Target: storage at most 10% above the formula plus the stated fixed buffers (the
reduce-scatter window pool of ZeRO-2/3 and FSDP: reduce_buffers = 3 windows
as large as the largest unit, in the reduce dtype). Writes its section of
docs/benchmarks.md between <!-- zero_memory:begin --> and <!-- zero_memory:end -->.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
import _ranks  # noqa: E402
from _doc import emit_section  # noqa: E402

BEGIN, END = "<!-- zero_memory:begin -->", "<!-- zero_memory:end -->"
NAMES = {"dp": "DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP"}
REDUCE_BUFFERS = 3  # ZeroOptimizer's and fully_shard's default


def formula(mode: str, mixed: bool, p: int, n: int) -> float:
    """The paper's bytes per rank for P = p parameters on n ranks."""
    fp32 = {"dp": 16 * p, "zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n}
    bf16 = {"dp": 16 * p, "zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n}
    return (bf16 if mixed else fp32).get(mode, 16 * p / n)


def config(args: argparse.Namespace):  # noqa: ANN201 - GPTConfig, imported lazily
    from pycollectives.strategies.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
    )


def fixed_buffers(mode: str, mixed: bool, n: int, args: argparse.Namespace) -> int:
    """The reduce-scatter window pool ZeRO-2/3 and FSDP allocate: REDUCE_BUFFERS
    windows as large as the largest unit (a block, or the root: embeddings,
    final norm, tied head), padded to n shards, in the reduce dtype."""
    if mode not in ("zero2", "zero3", "fsdp"):
        return 0
    from pycollectives.strategies.models.gpt import GPT

    model = GPT(config(args))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(model.blocks) * block
    largest = -(-max(block, root) // n) * n
    return REDUCE_BUFFERS * largest * (2 if mixed else 4)


def warm_up(cfg) -> None:  # noqa: ANN001 - a GPTConfig
    """Trains a tiny GPT of cfg's shape one step in fp32 and in bf16, so that
    the library code those kernels touch is resident before the baseline."""
    import dataclasses

    import torch

    from pycollectives.strategies.models.gpt import GPT

    tiny = dataclasses.replace(cfg, vocab_size=64, d_model=cfg.n_head * 4, n_layer=1)
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT(tiny).to(dtype)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randint(64, (1, cfg.seq_len))
        model(x, x).backward()
        opt.step()


def job(rank: int, world: int, port: int, mode: str, mixed: bool, args: argparse.Namespace) -> dict:
    """One rank: build the setup, one step, reset the peak, more steps, measure."""
    import torch
    from _zero_setups import build

    import pycollectives as pc
    from pycollectives.strategies.models.gpt import GPT

    comm = pc.init(rank=rank, world_size=world, prefix=f"mem{port}")
    torch.manual_seed(rank)
    cfg = config(args)
    warm_up(cfg)
    before = _ranks.rss_kib()["VmRSS"]
    setup = build(mode, cfg, comm, mixed=mixed)
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len))
    y = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len))
    setup.step(x, y)
    _ranks.reset_peak_rss()
    for _ in range(args.steps):
        setup.step(x, y)
    rss = _ranks.rss_kib()
    out = {
        "storage": setup.storage(),
        "rest_kib": rss["VmRSS"] - before,
        "peak_kib": rss["VmHWM"] - before,
        "P": sum(p.numel() for p in GPT(cfg).parameters()),
    }
    comm.close()
    return out


def run_cells(args: argparse.Namespace) -> list[dict]:
    rows = []
    for mixed in (False, True):
        for n in args.ranks:
            for mode in args.modes:
                t0 = time.perf_counter()
                res = _ranks.run(job, n, mode, mixed, args, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
                worst = max(res, key=lambda r: sum(r["storage"].values()))
                row = dict(mode=mode, mixed=mixed, n=n, **worst)
                row["peak_kib"] = max(r["peak_kib"] for r in res)
                row["rest_kib"] = max(r["rest_kib"] for r in res)
                rows.append(row)
                total = sum(worst["storage"].values())
                print(
                    f"{'bf16' if mixed else 'fp32'} N={n} {mode:6} storage {total / 2**20:8.1f} MiB "
                    f"{worst['storage']} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return rows


def render(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """The tables (one per precision) and the verdict."""
    mib = 2**20
    out, misses = [], []
    for mixed in (False, True):
        title = "bf16 compute, fp32 master and AdamW state" if mixed else "fp32 AdamW"
        out += [
            f"### {title}",
            "",
            "| strategy | N | params | master / shards | grads | optimizer | reduce windows "
            "| storage MiB | formula MiB | + fixed MiB | storage / (formula + fixed) | target "
            "| RSS at rest MiB | peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        ]
        for r in (r for r in rows if r["mixed"] == mixed):
            s = r["storage"]
            total = sum(s.values())
            f = formula(r["mode"], mixed, r["P"], r["n"])
            fixed = fixed_buffers(r["mode"], mixed, r["n"], args)
            ratio = total / (f + fixed)
            ok = ratio <= 1.10  # below the formula: less than the paper counts
            if not ok:
                misses.append(f"{NAMES[r['mode']]} N={r['n']} {'bf16' if mixed else 'fp32'}")
            cells = " | ".join(
                f"{s.get(k, 0) / mib:.1f}"
                for k in ("params", "param_shards", "grads", "optimizer", "reduce_buffers")
            )
            out.append(
                f"| {NAMES[r['mode']]} | {r['n']} | {cells} | {total / mib:.1f} | {f / mib:.1f} "
                f"| {fixed / mib:.1f} | {ratio:.3f} | {'met' if ok else 'missed'} "
                f"| {r['rest_kib'] / 1024:.0f} | {r['peak_kib'] / 1024:.0f} |"
            )
        out.append("")
    verdict = (
        "every cell at most 10% above the formula plus the fixed buffers"
        if not misses
        else f"missed in {', '.join(misses)}"
    )
    out.append(f"Target (storage at most 10% above formula + fixed buffers): {verdict}.")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default=",".join(NAMES))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.ranks = [int(n) for n in args.ranks.split(",")]
    args.modes = args.modes.split(",")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    rows = run_cells(args)
    load1 = os.getloadavg()
    p = rows[0]["P"]
    notes = [
        f"Model: GPT vocab {args.vocab}, seq {args.seq}, {args.layers} blocks, d_model "
        f"{args.d_model}, {args.heads} heads, tied head: P = {p:,} parameters "
        f"({p * 4 / 2**20:.1f} MiB in fp32); batch {args.batch} x {args.seq} tokens per rank, "
        f"AdamW; {args.steps} steps after the first.",
        "Storage: bytes of the tensors this rank holds after a step, by role, each storage "
        "once; the worst rank. DP = strategies.DDP with gradient_as_bucket_view=True (its "
        "default: its buckets are the gradients; False holds another 4P of buckets); in bf16 "
        "the DP model is bf16 (parameters and bucketed gradients) beside fp32 master copies "
        "that AdamW steps. ZeRO-1/2 keep full parameters (bf16: the compute copies), "
        "ZeRO-3/FSDP only shards (fp32 master shards) between steps.",
        f"Fixed buffers: the reduce-scatter window pool of ZeRO-2/3 and FSDP "
        f"({REDUCE_BUFFERS} windows of the largest unit, here the root with the {args.vocab} x "
        f"{args.d_model} embedding, in the reduce dtype). Not in the counts: AdamW's step "
        "counters (4 bytes per tensor), the padding to N equal shards (< N elements per "
        "unit), and the communicator's own shared memory (4 slots of 256 KiB per connection "
        "and the one-shot areas), which is in the RSS. Transient: ZeroOptimizer's fp32 "
        "copies of bf16 gradient shards during the step (the DP bf16 baseline casts its "
        "gradients the same way), ZeRO-3/FSDP's gathered units during forward/backward.",
        "ZeRO-3 and FSDP in bf16 keep no bf16 copy of the parameter shard: each gather casts "
        "the fp32 master shard into its own block of the gathered buffer, as torch FSDP2 casts "
        "into its all-gather input (the paper counts a persistent 16-bit parameter shard, "
        "2P/N). FSDP keeps the reduced gradient shards in fp32, as torch FSDP2 does (a plain "
        "torch optimizer steps the fp32 parameters, so their .grad is fp32): 4 + 4 + 8 = "
        "16P/N. ZeroOptimizer keeps them in bf16 (cast for the step only): 4 + 2 + 8 = 14P/N, "
        "2P/N under the formula. The target is one-sided: at most 10% above the formula plus "
        "the fixed buffers (a cell below holds less than the paper counts).",
        "RSS columns: MiB above the process's RSS before the model was built (torch, the "
        "communicator): at rest after the steps, and the peak over the steps (activations and "
        "gathered units included); the worst rank. Windows of the peers that a rank maps and "
        "touches count in its RSS too (shared pages).",
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all.",
    ]
    argv = " ".join(sys.argv[1:])
    emit_section(
        BEGIN,
        END,
        "ZeRO and FSDP: memory per rank against the ZeRO paper's formulas",
        f"`python benchmarks/data_parallel/zero_memory.py{' ' + argv if argv else ''}`",
        notes,
        render(rows, args),
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
