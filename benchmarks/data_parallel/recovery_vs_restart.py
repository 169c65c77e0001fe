"""Time to recover from a lost rank: in place (ElasticDataParallel) against a
restart from a checkpoint (torchrun --max-restarts=1, the project's checkpoints).

    python benchmarks/data_parallel/recovery_vs_restart.py [--sizes 10M 50M 200M]
        [--ranks 4 8] [--repeats 3] [--kill-step 6] [--every 4] [--json FILE]

Both train the reference GPT (vocab 64, 16 tokens, global batch 8, AdamW) data
parallel on --ranks CPU ranks, one thread each; the last rank SIGKILLs itself in
the backward of step --kill-step (a hook on the last block's parameter, the
backward's first gradients), after writing the instant (CLOCK_MONOTONIC, one
clock for every process of the host).

- in place: ElasticDataParallel over ranks started by pycollectives.launcher.spawn
  (survive=True). From the kill to the slowest survivor's commit of the retried
  step: detect (to its agree(): the backward's failing all-reduce), agree,
  shrink, rebuild (DDP detached, the old communicator closed, DDP wrapped again
  with its broadcast of parameters), the retried step.
- restart: Trainer3D (dp = ranks) under `torchrun --standalone --max-restarts 1`
  (its default --monitor-interval 0.1 s), save_trainer every --every steps. The
  survivors' all-reduce fails and they wait, as NCCL ranks would, for torchrun to
  stop them. From the kill to the restarted job's end of the lost step: detect
  (the first SIGTERM torchrun sends the survivors), stop + respawn (to the new
  processes' first line), imports (torch, pycollectives), rendezvous (init),
  build (the model and AdamW), load (load_trainer), the steps recomputed since
  the save, the lost step.

Runs alternate in-place / restart (the order flips every repeat); prints the
medians over --repeats per size and ranks, and with --json every run's figures.
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

SIZES = {"10M": (256, 12), "50M": (512, 16), "100M": (768, 14), "200M": (1024, 16)}
VOCAB, SEQ, BATCH, HEADS, LR = 64, 16, 8, 8, 3e-4


def _config(size: str):  # noqa: ANN202
    from pycollectives.strategies.models import GPTConfig

    d, layers = SIZES[size]
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=layers, n_head=HEADS, d_model=d)


def _write(out: str, name: str, rec: dict) -> None:
    Path(out, name).write_text(json.dumps(rec))


def _die_in_backward(blocks, out: str, when) -> None:  # noqa: ANN001
    """SIGKILL this process in the backward when `when()` holds, after writing the instant."""
    import torch

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when():
            _write(out, "kill.json", {"t": time.monotonic()})
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    list(blocks[-1].parameters())[-1].register_hook(hook)


def inplace_rank(size: str, k: int, out: str) -> None:
    """One rank of the in-place run (started by spawn)."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
    from pycollectives.strategies.data_parallel import ElasticDataParallel
    from pycollectives.strategies.models.gpt import GPT

    torch.set_num_threads(1)
    comm = pc.init(timeout=120)
    rank, n, marks = comm.rank, comm.world_size, {}
    config = _config(size)
    model = GPT(config)
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
        _die_in_backward(model.blocks, out, lambda: step == k)
    while step <= k:
        t = time.monotonic()
        if edp.step(loss_fn, opt):
            ends.append((step, t, time.monotonic()))
            step += 1
        else:
            marks["dropped"] = time.monotonic()
    _write(out, f"inplace-{rank}.json", {"marks": marks, "steps": ends, "left": edp.world_size})
    edp.comm.close()


def restart_rank(size: str, k: int, every: int, out: str) -> None:
    """One rank of the restart run (under torchrun)."""
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
        _write(out, name, {"marks": marks, "steps": ends, "saves": saves})
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(1)
    comm = pc.init(timeout=120)
    dims = ParallelDims(comm, dp=n)
    marks["init"] = time.monotonic()
    opts = TrainOptions(microbatches=1, global_batch=BATCH, lr=LR)
    trainer = Trainer3D(dims, _config(size), opts)
    marks["built"] = time.monotonic()
    ckpt = Path(out, "ckpt")
    if attempt:
        load_trainer(trainer, ckpt)
        marks["loaded"] = time.monotonic()
    else:
        blocks = trainer.stages[0].blocks
        if rank == n - 1:
            _die_in_backward(blocks, out, lambda: trainer.step_index == k)
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
    _write(out, name, {"marks": marks, "steps": ends, "saves": saves})
    dims.close()
    comm.close()


def _loads(out: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]


def _step_s(steps: list) -> float:
    return statistics.median(end - start for s, start, end in steps[1:-1])


def inplace_run(size: str, n: int, k: int, out: Path) -> dict:
    """One in-place run: the slowest survivor's times (seconds)."""
    cmd = [sys.executable, __file__, "--worker", "inplace", "--sizes", size, "--ranks", str(n),
           "--kill-step", str(k), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL)
    kill = json.loads((out / "kill.json").read_text())["t"]
    ranks = _loads(out, "inplace-*.json")
    assert len(ranks) == n - 1 and all(r["left"] == n - 1 for r in ranks), ranks
    slow = max(ranks, key=lambda r: r["steps"][-1][2])
    m, (_, _, commit) = slow["marks"], slow["steps"][-1]
    (a0, a1), (s0, s1) = m["agree"], m["shrink"]
    return {"detect": a0 - kill, "agree": a1 - a0, "shrink": s1 - s0,
            "rebuild": (s0 - a1) + (m["dropped"] - s1), "retry": commit - m["dropped"],
            "total": commit - kill, "step": _step_s(slow["steps"])}  # fmt: skip


def restart_run(size: str, n: int, k: int, every: int, out: Path) -> dict:
    """One restart run: the slowest restarted rank's times (seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n), "--max-restarts", "1", __file__, "--worker", "restart", "--sizes", size,
           "--ranks", str(n), "--kill-step", str(k), "--every", str(every), "--out", str(out)]  # fmt: skip
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
            "save": statistics.median(before["saves"])}  # fmt: skip


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["10M", "50M", "200M"], choices=list(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=6, help="the step the last rank dies in")
    ap.add_argument("--every", type=int, default=4, help="restart: save every this many steps")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--worker", choices=["inplace", "restart"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    k, every = args.kill_step, args.every
    if not 0 < every <= k or min(args.ranks) < 2 or args.repeats < 1:
        ap.error("wants 0 < --every <= --kill-step, --ranks >= 2, --repeats >= 1")
    if args.worker == "inplace":
        from pycollectives.launcher import spawn

        target = (inplace_rank, args.ranks[0], (args.sizes[0], k, args.out))
        return spawn(*target, prog="recovery_vs_restart", survive=True)
    if args.worker == "restart":
        restart_rank(args.sizes[0], k, every, args.out)
        return 0
    print(f"kill in the backward of step {k}; restart: saved every {every} steps "
          f"(recomputes steps {k - k % every}..{k - 1}, then step {k})", flush=True)  # fmt: skip
    results = []
    for size in args.sizes:
        for n in args.ranks:
            runs = {"inplace": [], "restart": []}
            for rep in range(args.repeats):
                order = ["inplace", "restart"] if rep % 2 == 0 else ["restart", "inplace"]
                for mode in order:
                    with tempfile.TemporaryDirectory(prefix="pycoll-rvr-") as out:
                        if mode == "inplace":
                            got = inplace_run(size, n, k, Path(out))
                        else:
                            got = restart_run(size, n, k, every, Path(out))
                    runs[mode].append(got)
                    print(f"{size} {n} ranks {mode}: " + ", ".join(
                        f"{key} {v * 1e3:.1f} ms" if key != "recomputed" else f"{key} {v}"
                        for key, v in got.items()), flush=True)  # fmt: skip
            results.append({"size": size, "ranks": n, **runs})
            a, b = runs["inplace"], runs["restart"]
            print(f"== {size}, {n} ranks, medians of {args.repeats}: in place "
                  f"{_med(a, 'total'):.3f} s (detect {_med(a, 'detect') * 1e3:.0f} ms, agree "
                  f"{_med(a, 'agree') * 1e3:.1f}, shrink {_med(a, 'shrink') * 1e3:.1f}, rebuild "
                  f"{_med(a, 'rebuild') * 1e3:.0f}, retry {_med(a, 'retry') * 1e3:.0f}); restart "
                  f"{_med(b, 'total'):.2f} s (detect {_med(b, 'detect'):.2f} s, respawn "
                  f"{_med(b, 'respawn'):.2f}, imports {_med(b, 'imports'):.2f}, rendezvous "
                  f"{_med(b, 'rendezvous'):.2f}, build {_med(b, 'build'):.2f}, load "
                  f"{_med(b, 'load'):.2f}, recompute {_med(b, 'recompute'):.2f}, lost step "
                  f"{_med(b, 'lost_step'):.2f}); restart / in place "
                  f"x{_med(b, 'total') / _med(a, 'total'):.1f}; step {_med(a, 'step') * 1e3:.0f} "
                  f"/ {_med(b, 'step') * 1e3:.0f} ms, save {_med(b, 'save'):.2f} s", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
