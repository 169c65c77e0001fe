"""Where a Trainer3D rank's resident memory goes during a step, phase by phase.

    python benchmarks/plan/plan_rss_phases.py --dp 4 --mode zero3 [--tp 1 --pp 1]
        [--schedule 1f1b] [--env NAME=VALUE] [--json out.json]
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/plan/plan_rss_phases.py ...  # glibc's

(--env sets a variable in each rank once it runs: too late for glibc's MALLOC_*
variables, read when the process starts; put those in the command's environment.)

Runs one layout of benchmarks/plan/plan_memory.py's peak-RSS model (BIG: 25.5M
parameters, global batch 8 in 2 micro-batches) on 4 fresh ranks for 2 steps and,
on every rank, samples at each phase (the trainer built; each block's forward and
backward; each micro-batch's end; before and after the optimizer's step):

- /proc/self/status: VmRSS, RssAnon (private pages), RssShmem (symmetric windows,
  the rank's own and the peers' it touched), VmHWM (the peak so far);
- glibc's mallinfo2: bytes malloc has handed out and not freed (heap + mmap), and
  free heap bytes it keeps (freed memory not returned to the kernel);
- the tensor storage the trainer knows of now (Trainer3D.storage: parameters
  gathered or not, gradients including .grad and the engines' no_sync buffers,
  optimizer state, reduce windows).

Prints rank 0's phases (MiB) and the phase where each rank's VmHWM was reached.
A measurement tool for the planner's peak-RSS terms (strategies/plan/trainer.py
step_transient_bytes); it writes nothing into the docs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plan_layouts import options  # noqa: E402
from spawn import run  # noqa: E402

MIB = 1 << 20
STATUS = ("VmRSS", "RssAnon", "RssShmem", "VmHWM")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                  "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def malloc_stats() -> dict[str, int]:
    """glibc's mallinfo2 over every arena: in_use (heap bytes allocated + mmapped
    chunks), free_kept (free bytes inside the heaps), mmapped; {} without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"in_use": m.uordblks + m.hblkhd, "free_kept": m.fordblks, "mmapped": m.hblkhd}


def proc_status() -> dict[str, int]:
    """The STATUS fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in STATUS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def install_probes(
    trainer: Any, sample: Callable[[str], None], every_param: bool = False
) -> dict[str, int]:
    """Calls sample(label) at each phase of `trainer`'s (a Trainer3D) steps: after each
    block's forward ('mb<j> fwd block<i>'), after the first parameter of each block (every
    parameter with `every_param`) gets its gradient ('bwd block<i> (<j> fwd)', j the
    forwards run so far), after each stage's forward ('mb<j> fwd end'), and around the dp
    mode's finish ('before finish', 'after finish'). Returns the counters: set ['mb'] = 0
    at each step's start."""
    from pycollectives.strategies.models.gpt import Block

    where = {"mb": 0}
    for st in trainer.stages:
        blocks = [b for b in st.modules() if isinstance(b, Block)]
        for i, b in enumerate(blocks):
            b.register_forward_hook(lambda m, a, o, i=i: sample(f"mb{where['mb']} fwd block{i}"))
            trainable = [p for p in b.parameters() if p.requires_grad]
            for p in trainable if every_param else trainable[:1]:
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i: sample(f"bwd block{i} ({where['mb']} fwd)"))  # fmt: skip

        def stage_done(m: Any, a: Any, o: Any) -> None:
            sample(f"mb{where['mb']} fwd end")
            where["mb"] += 1

        st.register_forward_hook(stage_done)
    finish = trainer.dp.finish

    def probed_finish() -> None:
        sample("before finish")
        finish()
        sample("after finish")

    trainer.dp.finish = probed_finish
    return where


def job(rank: int, world: int, lo: dict, steps: int) -> list[dict]:
    """One rank: the phases of `steps` steps of layout `lo` (see the module docstring)."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D
    from pycollectives.strategies.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    from plan_memory import BIG, BIG_BATCH, BIG_MICRO

    s = BIG
    cfg = GPTConfig(vocab_size=s.vocab, seq_len=s.seq, n_layer=s.layers, n_head=s.heads,
                    d_model=s.hidden)  # fmt: skip
    samples: list[dict] = []
    step = [0]
    trainer = None

    def sample(label: str) -> None:
        known = sum(trainer.storage().values()) if trainer is not None else 0
        samples.append({"phase": f"s{step[0]} {label}", **proc_status(), **malloc_stats(),
                        "tensors": known})  # fmt: skip

    comm = pc.init(timeout=120)
    with ParallelDims(comm, dp=lo["dp"], tp=lo["tp"], pp=lo["pp"]) as dims:
        sample("start")
        trainer = Trainer3D(dims, cfg, options(lo, BIG_BATCH, BIG_MICRO))
        sample("built")
        where = install_probes(trainer, sample)
        for k in range(steps):
            step[0], where["mb"] = k, 0
            trainer.step()
            sample("end")
    comm.close()
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--mode", default="zero3")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE set in each rank (not MALLOC_*)"
    )
    ap.add_argument("--json", help="write every rank's samples here")
    args = ap.parse_args()
    lo = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "mode": args.mode,
          "schedule": args.schedule}  # fmt: skip
    env = dict(kv.split("=", 1) for kv in args.env)
    res = run(job, args.dp * args.tp * args.pp, lo, args.steps, timeout=600, env=env)
    if args.json:
        Path(args.json).write_text(json.dumps({"layout": lo, "env": env, "ranks": res}) + "\n")
    print(f"layout {lo}, env {env}; rank 0, MiB:")
    cols = ("VmRSS", "RssAnon", "RssShmem", "VmHWM", "in_use", "free_kept", "tensors")
    print(f"{'phase':28s} " + " ".join(f"{c:>9s}" for c in cols))
    for smp in res[0]:
        print(f"{smp['phase']:28s} " + " ".join(f"{smp.get(c, 0) / MIB:9.1f}" for c in cols))
    for r, rank in enumerate(res):
        top = max(range(len(rank)), key=lambda i: rank[i]["VmRSS"])
        print(f"rank {r}: VmHWM {rank[-1]['VmHWM'] / MIB:.1f} MiB; largest sampled VmRSS "
              f"{rank[top]['VmRSS'] / MIB:.1f} at '{rank[top]['phase']}'")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
