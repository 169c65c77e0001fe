"""Where the time of a ZeRO-3 / fully_shard step goes, against torch FSDP2 over
the "pycoll" backend, on the ~50M GPT of zero_step.py with 2 ranks, per step.

    python benchmarks/data_parallel/zero_breakdown.py                    # fp32, zero3 fsdp fsdp2-pycoll compute
    python benchmarks/data_parallel/zero_breakdown.py --bf16 --steps 4
    python benchmarks/data_parallel/zero_breakdown.py --json out.json    # the per-cell medians as JSON
    python benchmarks/data_parallel/zero_breakdown.py --cells zero3,zero3:nocheck,fsdp:keep

Cells: compute, zero1..zero3, fsdp, dp, fsdp2-pycoll, fsdp2-gloo; ours take
variants after a colon, joined by "+": nocheck (check_order=False), auto /
keep (fully_shard's reshard_after_forward None / False).

Per step and rank (medians over the timed steps and the rounds, rank 0):
the step's wall time; this thread's CPU time (time.thread_time: the model's
compute, the Python hooks, the copies the calling thread makes) and the
process's other threads' CPU time (the communicator's progress thread: the
collectives' copies and reductions, which on 2 cores compete with the other
rank's compute); minor page faults (fresh memory: every allocation of a
gathered unit that glibc maps anew); and, for pycollectives' engine, the time
in its hooks split into the meter's parts (blocked on all-gathers, on
reduce-scatters, copying gradients into flat buffers), the order check
(OrderGuard: issuing and verifying its fingerprint all-reduces, inside the
hooks' time) and the rest of the hooks (Python bookkeeping, casts).
Nothing is written to the docs: the figures go in docs/benchmarks.md by hand
with the command and the load (see its "Sharded step breakdown" section).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
import _ranks  # noqa: E402

HOOKS = ("pre_forward", "post_forward", "_output_hook", "grad_ready", "_finalize_backward")


class _Timers:
    """Wall time spent inside wrapped methods, outermost calls only."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.depth = 0

    def wrap(self, obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


def _instrument(engine: Any, timers: _Timers) -> None:
    for h in HOOKS:
        timers.wrap(engine, h, "hooks")
    guard = _Timers()  # nested inside the hooks: a timer of its own
    guard.wrap(engine.guard, "announce", "guard")
    guard.wrap(engine.guard, "settle", "guard")
    timers.guard = guard  # type: ignore[attr-defined]


def rank_main(rank: int, world: int, port: int, cfg: Any, args: Any, rnd: int, init: str) -> dict:
    """Round `rnd` on this rank: every cell built, stepped, measured, dropped."""
    import torch
    import torch.distributed as dist

    import pycollectives as pc

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _zero_cells import _compute, _fsdp2
    from _zero_setups import build, fresh_gpt, preload_initial

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(300))
    comm = pc.init(rank=rank, world_size=world, store=dist.PrefixStore("ours", store))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world
    )
    pycoll_pg = dist.new_group(backend="pycoll")
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    batch = (x, torch.roll(x, -1, 1))
    preload_initial(cfg, init)
    dev = torch.device("cpu")
    mixed = args.bf16
    out: dict[str, list[dict]] = {}
    cells = args.cells if rnd % 2 == 0 else list(reversed(args.cells))
    for cell in cells:
        setup = None
        if cell == "compute":
            backward, update, keep = *_compute(cfg, batch, dev, mixed)[:2], None
        elif cell.startswith("fsdp2-"):
            pg = {"fsdp2-pycoll": pycoll_pg, "fsdp2-gloo": dist.group.WORLD}[cell]
            backward, update, _, keep = _fsdp2(cfg, pg, batch, dev, mixed=mixed)
        else:
            mode, _, variant = cell.partition(":")
            kw: dict[str, Any] = {}
            for v in filter(None, variant.split("+")):
                if v == "nocheck":
                    kw["check_order"] = False
                elif v in ("auto", "keep"):  # fully_shard: root kept / every unit kept
                    kw["reshard_after_forward"] = None if v == "auto" else False
                else:
                    raise ValueError(f"--cells: unknown variant {v!r} of {cell!r}")
            setup = build(mode, cfg, comm, mixed=mixed, model=fresh_gpt(cfg), **kw)
            backward, update, keep = (lambda s=setup: s.backward(*batch)), setup.update, setup
        recs = []
        timers = None
        for i in range(args.warmup + args.steps):
            comm.barrier()
            dist.barrier()
            if setup is not None and setup.meter is not None and i == args.warmup:
                timers = _Timers()
                eng = keep.keep[0].sharding_unit.engine if mode == "fsdp" else keep.keep[1].engine
                _instrument(eng, timers)
            if timers is not None:
                timers.s.clear()
                timers.guard.s.clear()
                setup.meter.reset()
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            backward()
            t1 = time.perf_counter()
            update()
            t2, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            flt1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if i < args.warmup:
                continue
            rec = {
                "step": t2 - t0,
                "fb": t1 - t0,
                "opt": t2 - t1,
                "main_cpu": c1 - c0,
                "other_cpu": (p1 - p0) - (c1 - c0),
                "minflt": flt1 - flt0,
            }
            if timers is not None:
                m = setup.meter
                rec.update(
                    gather_wait=m.gather_wait_s,
                    reduce_wait=m.reduce_wait_s,
                    grad_copy=m.grad_copy_s,
                    hooks=timers.s.get("hooks", 0.0),
                    guard=timers.guard.s.get("guard", 0.0),
                )
            recs.append(rec)
        out[cell] = recs
        del backward, update, keep, setup
        gc.collect()
    dist.destroy_process_group()
    comm.close()
    return out


def summarize(per_rank: list[dict], cells: list[str]) -> dict[str, dict[str, float]]:
    """Per cell: the median step of the slowest rank, and rank 0's medians of the rest."""
    res = {}
    for c in cells:
        recs0 = per_rank[0][c]
        slow = [max(r[c][i]["step"] for r in per_rank) for i in range(len(recs0))]
        row = {"step": statistics.median(slow)}
        for k in recs0[0]:
            if k != "step":
                row[k] = statistics.median(r[k] for r in recs0)
        if "hooks" in row:
            row["hooks_other"] = statistics.median(
                r["hooks"] - r["gather_wait"] - r["reduce_wait"] - r["grad_copy"] - r["guard"]
                for r in recs0
            )
        res[c] = row
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="compute,zero3,fsdp,fsdp2-pycoll")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help=">= 1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    args.cells = args.cells.split(",")
    from _zero_setups import save_initial

    from pycollectives.strategies.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=16384, seq_len=128, n_layer=args.layers, n_head=8,
                    d_model=args.d_model)  # fmt: skip
    load0 = os.getloadavg()
    per_rank: list[dict] = [{c: [] for c in args.cells} for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "initial.pt")
        save_initial(cfg, init)
        for rnd in range(args.rounds):
            got = _ranks.run(rank_main, 2, cfg, args, rnd, init, timeout=1200)
            for mine, theirs in zip(per_rank, got, strict=True):
                for c in args.cells:
                    mine[c] += theirs[c]
    res = summarize(per_rank, args.cells)
    keys = ["step", "fb", "opt", "main_cpu", "other_cpu", "minflt", "gather_wait",
            "reduce_wait", "grad_copy", "guard", "hooks_other"]  # fmt: skip
    print(f"load {load0} -> {os.getloadavg()}; bf16={args.bf16}; ms (minflt: count)")
    print(f"{'cell':<14}" + "".join(f"{k:>12}" for k in keys))
    for c, row in res.items():
        vals = [
            "-" if k not in row else (f"{row[k]:.0f}" if k == "minflt" else f"{row[k] * 1e3:.1f}")
            for k in keys
        ]
        print(f"{c:<14}" + "".join(f"{v:>12}" for v in vals))
    if args.json:
        parts = []
        for c, row in res.items():
            part = f"{c} {row['step'] * 1e3:.0f} ms (calling thread CPU {row['main_cpu'] * 1e3:.0f}"
            if "gather_wait" in row:
                part += (
                    f", comm thread CPU {row['other_cpu'] * 1e3:.0f}, exposed all-gather "
                    f"{row['gather_wait'] * 1e3:.0f}, reduce-scatter {row['reduce_wait'] * 1e3:.0f}"
                    f", gradient copy-in {row['grad_copy'] * 1e3:.0f}, order check "
                    f"{row['guard'] * 1e3:.0f}"
                )
            parts.append(part + ")")
        data = {
            "summary": f"Sharded step breakdown, ~50M GPT, 2 ranks, "
            f"{'bf16' if args.bf16 else 'fp32'}, load {load0[0]:.1f}: " + "; ".join(parts),
            "command": "python benchmarks/data_parallel/zero_breakdown.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load": [load0, os.getloadavg()],
            "cells_ms": {c: {k: v * 1e3 if k != "minflt" else v for k, v in row.items()}
                         for c, row in res.items()},
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
