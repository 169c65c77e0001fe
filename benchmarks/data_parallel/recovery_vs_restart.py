"""Time to recover from a lost rank: in place (ElasticDataParallel) against a
restart from a checkpoint (torchrun --max-restarts=1, the project's checkpoints).

    python benchmarks/data_parallel/recovery_vs_restart.py [--sizes 10M 50M 200M]
        [--ranks 4 8] [--repeats 3] [--kill-step 6] [--every 4] [--json FILE]
        [--strategy ddp|zero2] [--refresh 1]

Both train the reference GPT (vocab 64, 16 tokens, global batch 8, AdamW) data
parallel on --ranks CPU ranks, one thread each; the last rank SIGKILLs itself in
the backward of step --kill-step (a hook on the last block's parameter, the
backward's first gradients), after writing the instant (CLOCK_MONOTONIC, one
clock for every process of the host).

- in place: ElasticDataParallel over ranks started by pycollectives.launcher.spawn
  (survive=True), each in a session of its own as torchrun's workers are
  (a CPU share of its own under sched_autogroup: _recovery_runs.own_session). From the kill to the slowest survivor's commit of the retried
  step: detect (to its agree(): the backward's failing all-reduce), agree,
  shrink, rebuild (DDP detached, the old communicator closed, DDP wrapped again
  with a fingerprint check of the parameters), the retried step.
  --strategy zero2: ElasticZero (ZeRO-2, each rank's shard state copied into
  its buddy's host memory every --refresh steps): the rebuild gathers the
  copy's full state (the dead rank's shards from its buddy), re-shards it over
  the survivors and refreshes the copies; the steps since the copy are redone
  (_recovery_runs.py says each part).
- restart: Trainer3D (dp = ranks; zero2: --zero 2) under `torchrun --standalone --max-restarts 1`
  (its default --monitor-interval 0.1 s), save_trainer every --every steps. The
  survivors' all-reduce fails and they wait, as NCCL ranks would, for torchrun to
  stop them. From the kill to the restarted job's end of the lost step: detect
  (the first SIGTERM torchrun sends the survivors), stop + respawn (to the new
  processes' first line), imports (torch, pycollectives), rendezvous (init),
  build (the model and AdamW), load (load_trainer), the steps recomputed since
  the save, the lost step.

Runs alternate in-place / restart (the order flips every repeat); prints the
medians over --repeats per size and ranks, and with --json every run's figures
(and each rank's memory: RssAnon and VmHWM, MiB).
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # a restarted process's first line, before torch's import

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from _recovery_runs import (  # noqa: E402 - a sibling module
    BATCH,
    LR,
    SEQ,
    SIZES,
    VOCAB,
    config,
    die_in_backward,
    inplace_zero_rank,
    inplace_zero_summary,
    mem,
    own_session,
    write,
)


def inplace_rank(size: str, k: int, out: str) -> None:
    """One rank of the in-place run (started by spawn)."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
    from pycollectives.strategies.data_parallel import ElasticDataParallel
    from pycollectives.strategies.models.gpt import GPT

    own_session()  # a CPU share of its own, as torchrun's workers have
    torch.set_num_threads(1)
    comm = pc.init(timeout=120)
    rank, n, marks = comm.rank, comm.world_size, {}
    model = GPT(config(size))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    edp = ElasticDataParallel(model, comm)
    agree, shrink = comm.agree, comm.shrink

    def timed_agree(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.monotonic()
        got = agree(*a, **kw)
        if got.failed or not got.value:
            marks.setdefault("agree", (t, time.monotonic()))
        return got

    def timed_shrink(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.monotonic()
        new = shrink(*a, **kw)
        marks["shrink"] = (t, time.monotonic())
        return new

    comm.agree, comm.shrink = timed_agree, timed_shrink
    data = SyntheticSequences(VOCAB, SEQ, 4096)
    batches = GlobalBatches(4096, BATCH)
    step, ends = 0, []

    def loss_fn(ddp, r: int, size_: int):  # noqa: ANN001, ANN202
        ids = batches.global_ids(step)
        x, y = data.batch(ids[r * BATCH // size_ : (r + 1) * BATCH // size_])
        return ddp(x, y) * (len(x) * size_ / BATCH)

    if rank == n - 1:
        die_in_backward(model.blocks, out, lambda: step == k)
    while step <= k:
        t = time.monotonic()
        if edp.step(loss_fn, opt):
            ends.append((step, t, time.monotonic()))
            step += 1
        else:
            marks["dropped"] = time.monotonic()
    write(out, f"inplace-{rank}.json", {"marks": marks, "steps": ends, "left": edp.world_size})
    edp.comm.close()


def restart_rank(size: str, k: int, every: int, zero: int, out: str) -> None:
    """One rank of the restart run (under torchrun): Trainer3D, ZeRO stage
    `zero` over dp (0: all-reduce)."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.parallel3d import (
        Trainer3D,
        TrainOptions,
        load_trainer,
        save_trainer,
    )
    from pycollectives.strategies.parallel_dims import ParallelDims

    marks = {"start": T_START, "imported": time.monotonic()}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = f"restart{attempt}-{rank}.json"
    ends, saves = [], []

    def on_term(signum: int, frame: object) -> None:
        marks["sigterm"] = time.monotonic()
        write(out, name, {"marks": marks, "steps": ends, "saves": saves})
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(1)
    comm = pc.init(timeout=120)
    dims = ParallelDims(comm, dp=n)
    marks["init"] = time.monotonic()
    opts = TrainOptions(microbatches=1, global_batch=BATCH, lr=LR, zero=zero)
    trainer = Trainer3D(dims, config(size), opts)
    marks["built"] = time.monotonic()
    ckpt = Path(out, "ckpt")
    if attempt:
        load_trainer(trainer, ckpt)
        marks["loaded"] = time.monotonic()
    else:
        blocks = trainer.stages[0].blocks
        if rank == n - 1:
            die_in_backward(blocks, out, lambda: trainer.step_index == k)
    while trainer.step_index <= k:
        t = time.monotonic()
        try:
            trainer.step()
        except pc.PyCollectivesError:  # wait to be stopped, as NCCL ranks would
            marks["failed"] = time.monotonic()
            time.sleep(600)
        ends.append((trainer.step_index - 1, t, time.monotonic()))
        if trainer.step_index % every == 0 and trainer.step_index <= k:
            t = time.monotonic()
            save_trainer(trainer, ckpt)
            saves.append(time.monotonic() - t)
    write(out, name, {"marks": marks, "steps": ends, "saves": saves, "mem": mem()})
    dims.close()
    comm.close()


def _loads(out: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]


def _step_s(steps: list) -> float:
    return statistics.median(end - start for s, start, end in steps[1:-1])


def inplace_run(
    size: str, n: int, k: int, out: Path, strategy: str = "ddp", refresh: int = 1
) -> dict:
    """One in-place run: the slowest survivor's times (seconds)."""
    cmd = [sys.executable, __file__, "--worker", "inplace", "--sizes", size, "--ranks", str(n),
           "--kill-step", str(k), "--out", str(out), "--strategy", strategy,
           "--refresh", str(refresh)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL)
    kill = json.loads((out / "kill.json").read_text())["t"]
    ranks = _loads(out, "inplace-*.json")
    assert len(ranks) == n - 1 and all(r["left"] == n - 1 for r in ranks), ranks
    if strategy == "zero2":
        return inplace_zero_summary(ranks, kill)
    slow = max(ranks, key=lambda r: r["steps"][-1][2])
    m, (_, _, commit) = slow["marks"], slow["steps"][-1]
    (a0, a1), (s0, s1) = m["agree"], m["shrink"]
    return {"detect": a0 - kill, "agree": a1 - a0, "shrink": s1 - s0,
            "rebuild": (s0 - a1) + (m["dropped"] - s1), "retry": commit - m["dropped"],
            "total": commit - kill, "step": _step_s(slow["steps"])}  # fmt: skip


def restart_run(size: str, n: int, k: int, every: int, out: Path, strategy: str = "ddp") -> dict:
    """One restart run: the slowest restarted rank's times (seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n), "--max-restarts", "1", __file__, "--worker", "restart", "--sizes", size,
           "--ranks", str(n), "--kill-step", str(k), "--every", str(every), "--out", str(out),
           "--strategy", strategy]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    kill = json.loads((out / "kill.json").read_text())["t"]
    old, new = _loads(out, "restart0-*.json"), _loads(out, "restart1-*.json")
    assert len(old) == n - 1 and len(new) == n, (old, new)
    term = min(r["marks"]["sigterm"] for r in old)
    slow = max(new, key=lambda r: r["steps"][-1][2])
    m, steps = slow["marks"], slow["steps"]
    first = min(r["marks"]["start"] for r in new)
    before = old[0]  # rank 0 of the first attempt: its steps and saves
    recomputed = steps[-2][2] if len(steps) > 1 else m["loaded"]
    return {"detect": term - kill, "respawn": first - term, "imports": m["imported"] - m["start"],
            "rendezvous": m["init"] - m["imported"], "build": m["built"] - m["init"],
            "load": m["loaded"] - m["built"], "recompute": recomputed - m["loaded"],
            "recomputed": len(steps) - 1, "lost_step": steps[-1][2] - recomputed,
            "total": steps[-1][2] - kill, "step": _step_s(before["steps"] + [None]),
            "save": statistics.median(before["saves"]),
            "mem": {"anon": max(r["mem"]["anon"] for r in new),
                    "shmem": max(r["mem"]["shmem"] for r in new),
                    "hwm": max(r["mem"]["hwm"] for r in new)}}  # fmt: skip


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _line(got: dict) -> str:
    """One run's figures: seconds as ms, counts as they are, memory (MiB) apart."""
    out = [f"{key} {v}" if isinstance(v, int) else f"{key} {v * 1e3:.1f} ms"
           for key, v in got.items() if key != "mem"]  # fmt: skip
    return ", ".join(out) + (f", memory MiB {json.dumps(got['mem'])}" if "mem" in got else "")


def _summary(size: str, n: int, a: list[dict], b: list[dict], strategy: str) -> str:
    """The medians of the in-place runs `a` and the restarts `b`."""

    def ms(runs: list[dict], *keys: str) -> str:
        return ", ".join(f"{key} {_med(runs, key) * 1e3:.0f}" for key in keys)

    def sec(runs: list[dict], *keys: str) -> str:
        return ", ".join(f"{key} {_med(runs, key):.2f}" for key in keys)

    rebuild = (
        ("rebuild", "gather", "reshard", "copy", "redo") if strategy == "zero2" else ("rebuild",)
    )
    extra = ""
    if strategy == "zero2":
        peak = statistics.median(r["mem"]["assemble_sum"] for r in a)
        extra = (f"; refresh {_med(a, 'refresh') * 1e3:.1f} ms; survivors' RssAnon at the "
                 f"rebuild's peak {peak:.0f} MiB in all")  # fmt: skip
    return (f"== {size}, {n} ranks, {strategy}, medians of {len(a)}: in place "
            f"{_med(a, 'total'):.3f} s (detect {_med(a, 'detect') * 1e3:.0f} ms, agree "
            f"{_med(a, 'agree') * 1e3:.1f}, shrink {_med(a, 'shrink') * 1e3:.1f}, "
            f"{ms(a, *rebuild)}, retry {_med(a, 'retry') * 1e3:.0f}); restart "
            f"{_med(b, 'total'):.2f} s ({sec(b, 'detect', 'respawn', 'imports', 'rendezvous')}, "
            f"{sec(b, 'build', 'load', 'recompute')}, lost step {_med(b, 'lost_step'):.2f}); "
            f"restart / in place x{_med(b, 'total') / _med(a, 'total'):.1f}; step "
            f"{_med(a, 'step') * 1e3:.0f} / {_med(b, 'step') * 1e3:.0f} ms, save "
            f"{_med(b, 'save'):.2f} s{extra}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["10M", "50M", "200M"], choices=list(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=6, help="the step the last rank dies in")
    ap.add_argument("--every", type=int, default=4, help="restart: save every this many steps")
    ap.add_argument("--strategy", choices=["ddp", "zero2"], default="ddp",
                    help="ddp: ElasticDataParallel / Trainer3D; zero2: ElasticZero (stage 2, "
                         "buddy copies) / Trainer3D --zero 2")  # fmt: skip
    ap.add_argument("--refresh", type=int, default=1,
                    help="zero2: refresh the buddy copies every this many steps")  # fmt: skip
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--worker", choices=["inplace", "restart"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    k, every, strategy, refresh = args.kill_step, args.every, args.strategy, args.refresh
    if not 0 < every <= k or min(args.ranks) < 2 or args.repeats < 1 or not 0 < refresh <= k:
        ap.error("wants 0 < --every <= --kill-step, 0 < --refresh <= --kill-step, "
                 "--ranks >= 2, --repeats >= 1")  # fmt: skip
    if args.worker == "inplace":
        from pycollectives.launcher import spawn

        if strategy == "zero2":
            target = (inplace_zero_rank, args.ranks[0], (args.sizes[0], k, refresh, args.out))
        else:
            target = (inplace_rank, args.ranks[0], (args.sizes[0], k, args.out))
        return spawn(*target, prog="recovery_vs_restart", survive=True)
    if args.worker == "restart":
        restart_rank(args.sizes[0], k, every, 2 if strategy == "zero2" else 0, args.out)
        return 0
    copies = f"; in place: buddy copies every {refresh} steps" if strategy == "zero2" else ""
    print(f"{strategy}: kill in the backward of step {k}; restart: saved every {every} steps "
          f"(recomputes steps {k - k % every}..{k - 1}, then step {k}){copies}", flush=True)  # fmt: skip
    results = []
    for size in args.sizes:
        for n in args.ranks:
            runs = {"inplace": [], "restart": []}
            for rep in range(args.repeats):
                order = ["inplace", "restart"] if rep % 2 == 0 else ["restart", "inplace"]
                for mode in order:
                    with tempfile.TemporaryDirectory(prefix="pycoll-rvr-") as out:
                        if mode == "inplace":
                            got = inplace_run(size, n, k, Path(out), strategy, refresh)
                        else:
                            got = restart_run(size, n, k, every, Path(out), strategy)
                    runs[mode].append(got)
                    print(f"{size} {n} ranks {mode}: {_line(got)}", flush=True)
            results.append({"size": size, "ranks": n, "strategy": strategy, **runs})
            print(_summary(size, n, runs["inplace"], runs["restart"], strategy), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
