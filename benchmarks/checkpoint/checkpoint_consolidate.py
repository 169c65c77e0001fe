"""Sharded checkpoints of a ~30M-parameter GPT: save under ZeRO-3 on 4 ranks,
load under FSDP on 2, and consolidation's peak memory against the
checkpoint's size.

    python benchmarks/checkpoint/checkpoint_consolidate.py [--dir DIR] [--no-write]

1. ZeRO-3 on 4 ranks, AdamW, one step; save() (timed, slowest rank).
2. FSDP on 2 ranks (fully_shard per block + root, torch AdamW): load()
   (timed; tensor bytes each rank read).
3. `python -m pycollectives.strategies.checkpoint consolidate DIR OUT` (its main(), in a
   fresh interpreter that then prints its peak RSS, VmHWM), against an
   interpreter that only reads the index, the checkpoint's size and its
   largest tensor; the same with --model-only.
4. For contrast, consolidation in memory (every rank file read whole with
   safetensors.numpy, the full tensors assembled, then saved): what a tool
   that holds the whole model needs.

Rewrites the section of docs/benchmarks.md between the checkpoint markers.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import emit_section, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- checkpoint:begin -->", "<!-- checkpoint:end -->"
CFG = {"vocab_size": 8192, "seq_len": 128, "n_layer": 8, "n_head": 8, "d_model": 512}


def _worker(rank: int, world: int, port: int, mode: str, path: str, q: object) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    import torch

    torch.set_num_threads(1)
    import pycollectives as pc
    from pycollectives.strategies.checkpoint import load, read_stats, save
    from pycollectives.strategies.data_parallel.fsdp import fully_shard
    from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
    from pycollectives.strategies.models.gpt import GPT, GPTConfig

    comm = pc.init(timeout=300)
    model = GPT(GPTConfig(**CFG))
    x = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_len"]))
    if mode == "save":
        opt = ZeroOptimizer(model, torch.optim.AdamW, comm, stage=3, lr=1e-3)
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
        comm.barrier()
        t = time.perf_counter()
        save(path, comm, model, opt)
        q.put((rank, time.perf_counter() - t, 0))
    else:
        for block in model.blocks:
            fully_shard(block, comm)
        fully_shard(model, comm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comm.barrier()
        read_stats(reset=True)
        t = time.perf_counter()
        load(path, comm, model, opt)
        q.put((rank, time.perf_counter() - t, read_stats()["bytes_read"]))
    comm.close()


def launch(world: int, mode: str, path: str) -> list[tuple[int, float, int]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, mode, path, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{mode}: rank exited with {p.exitcode}")
    return out


def peak_mib(code: str) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of a fresh interpreter running `code`."""
    prog = (
        f"{code}\n"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    )
    return int(done.stdout.split()[-1]) / 1024, time.perf_counter() - t


IN_MEMORY = """
import json, numpy as np
from pathlib import Path
from safetensors.numpy import load_file, save_file
src = Path({src!r})
index = json.loads((src / "index.json").read_text())
files = {{f: load_file(str(src / f)) for f in index["files"]}}
full = {{n: np.zeros(m["shape"], dtype=np.float32) for n, m in index["tensors"].items()}}
for p in index["pieces"]:
    box = tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["sizes"]))
    view = full[p["tensor"]][box]
    lo, hi = p["flat"] or (0, view.size)
    flat = view.reshape(-1).copy()
    flat[lo:hi] = files[p["file"]][p["key"]].reshape(-1)
    full[p["tensor"]][box] = flat.reshape(view.shape)
save_file(full, {out!r})
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    src = scratch / "zero3-n4"
    try:
        saved = launch(4, "save", str(src))
        loaded = launch(2, "load", str(src))
        index = json.loads((src / "index.json").read_text())
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        params = sum(
            math.prod(m["shape"]) for n, m in index["tensors"].items() if not n.startswith("optim/")
        )
        largest = max(4 * math.prod(m["shape"]) for m in index["tensors"].values())
        base, _ = peak_mib(
            f"from pycollectives.strategies.checkpoint.format import read_index; read_index({str(src)!r})"
        )
        rows = []
        for label, flag in (("all tensors", ""), ("--model-only", ", '--model-only'")):
            out = scratch / "out.safetensors"
            peak, secs = peak_mib(  # the command line's main(), in the measured interpreter
                "from pycollectives.strategies.checkpoint.__main__ import main; "
                f"assert main(['consolidate', {str(src)!r}, {str(out)!r}{flag}]) == 0"
            )
            rows.append((f"streaming ({label})", peak, secs, out.stat().st_size))
            out.unlink()
        base_np, _ = peak_mib("import json, numpy, safetensors.numpy")
        out = scratch / "out-mem.safetensors"
        peak, secs = peak_mib(IN_MEMORY.format(src=str(src), out=str(out)))
        rows.append(("in memory (safetensors.numpy, for contrast)", peak, secs, out.stat().st_size))
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    mib = 2**20
    table = [
        "| consolidation | output | peak RSS | above its interpreter | time |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, peak, secs, nbytes in rows:
        floor = base_np if label.startswith("in memory") else base
        table.append(
            f"| {label} | {nbytes / mib:.0f} MiB | {peak:.0f} MiB | {peak - floor:.0f} MiB "
            f"| {secs:.1f} s |"
        )
    notes = [
        f"Model: GPT {CFG}, {params / 1e6:.1f}M parameters; AdamW state (exp_avg, exp_avg_sq, "
        f"step per parameter); checkpoint {size / mib:.0f} MiB in 4 files, largest tensor "
        f"{largest / mib:.0f} MiB (the token embedding and its optimizer state)",
        f"save() under ZeRO-3 on 4 ranks: {max(t for _, t, _ in saved):.2f} s (slowest rank)",
        f"load() under FSDP on 2 ranks: {max(t for _, t, _ in loaded):.2f} s; tensor bytes read "
        f"per rank: {', '.join(f'{b / mib:.0f} MiB' for _, _, b in loaded)} (of {size / mib:.0f})",
        f"Interpreter floors (VmHWM): {base:.0f} MiB (pycollectives, torch included, reading the "
        f"index), {base_np:.0f} MiB (numpy + safetensors)",
    ]
    emit_section(
        BEGIN,
        END,
        "Checkpoints: streaming consolidation",
        "`python benchmarks/checkpoint/checkpoint_consolidate.py`",
        notes,
        table,
        not args.no_write,
    )


if __name__ == "__main__":
    main()
