"""train_gpt.py --survive: training that goes on when a rank dies
(docs/recovery.md). Its options, its refusals, and one rank's training:

- data parallel (--tp 1 --pp 1): the survivors go on without the lost rank
  (ElasticTrainer: ElasticDataParallel, or with --zero N / --fsdp ElasticZero /
  ElasticFSDP and their buddy copies), the step's global batch re-split over
  them (ElasticSampler);
- --tp/--pp > 1: a tensor- or pipeline-parallel group cannot go on short, so
  the launcher (pycollectives.launcher.spawn(replace=N), which serves the
  job's store) starts a new process in the lost place; it joins
  (ElasticTrainer3D.join), receives its place's state from its peers' buddy
  copies (its stage shard and AdamW state; with --zero N / --fsdp its shard
  of them) and every rank resumes at the failed step (at the copy's with
  --copy-every > 1).

Rank 0 (after a loss, the lowest surviving rank for the recovery's line)
reports each recovery in one line, with its time.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
from typing import Any

import pycollectives as pc


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--survive and its options (--kill hidden: tests and demonstrations)."""
    p.add_argument("--survive", action="store_true",
                   help="when a rank dies the training goes on: data parallel (with --zero N or "
                   "--fsdp too), the others without it (the communicator shrinks, the step's "
                   "batch is re-split over them); with --tp/--pp, a new process takes its "
                   "place; docs/recovery.md")  # fmt: skip
    p.add_argument("--copy-every", type=int, default=1, metavar="K",
                   help="--survive with --zero/--fsdp/--tp/--pp: refresh the buddy copies of the "
                   "training state every K steps (a loss redoes up to K - 1 completed steps)")  # fmt: skip
    p.add_argument("--max-replacements", type=int, default=3, metavar="N",
                   help="--survive with --tp/--pp: new processes the launcher may start in lost "
                   "places; one more loss ends the run")  # fmt: skip
    # --kill RANK@STEP (with --survive; repeatable): that rank's first process
    # SIGKILLs itself in that step (for the tests and the README's demonstration).
    p.add_argument("--kill", action="append", default=[], type=_rank_at_step,
                   help=argparse.SUPPRESS)  # fmt: skip


def _rank_at_step(text: str) -> tuple[int, int]:
    """--kill's RANK@STEP."""
    rank, at, step = text.partition("@")
    if not at or not rank.isdigit() or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not RANK@STEP (two integers >= 0)")
    return int(rank), int(step)


def replaces(args: argparse.Namespace) -> bool:
    """Whether a lost rank is replaced (--tp/--pp > 1) rather than left behind."""
    return args.tp * args.pp > 1


def problems(args: argparse.Namespace, world: int | None) -> list[str]:
    """--survive's refusals (what a survivor cannot rebuild, or this script
    cannot run so) and --kill's checks. `world`: the world size of ranks
    started with RANK/WORLD_SIZE set (None when this script starts them)."""
    if not args.survive:
        return ["--kill needs --survive"] if args.kill else []
    refused = [(replaces(args) and world is not None, f"--tp {args.tp} / --pp {args.pp} with "
                "ranks started by hand (RANK, WORLD_SIZE set): the replacements are started by "
                "this script's launcher (run it without them)"),
               (args.plan is not None, "--plan with --survive: the planner does not price the "
                "buddy copies and the agreement"),
               (args.save or args.resume, "--save/--resume with --survive: the checkpoint is "
                "Trainer3D's (not written from a shrunk run)"), (args.device != "cpu",
                f"--device {args.device} with --survive: the recovery runs on the CPU only"),
               (world is not None and "TORCHELASTIC_RUN_ID" in os.environ, "--survive under "
                "torchrun: its agent ends every rank when one dies (run without torchrun: this "
                "script starts the ranks; or start each rank with RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT)"),
               (args.copy_every < 1, f"--copy-every {args.copy_every} must be >= 1"),
               (args.max_replacements < 0,
                f"--max-replacements {args.max_replacements} must be >= 0")]  # fmt: skip
    out = [f"--survive: {msg}" for bad, msg in refused if bad]
    size = args.dp * args.tp * args.pp
    for rank, step in args.kill:
        if rank >= size or step >= args.steps:
            out.append(f"--kill {rank}@{step}: rank must be < {size} (dp x tp x pp), step < "
                       f"--steps {args.steps}")  # fmt: skip
    if not replaces(args) and len({r for r, _ in args.kill}) >= args.dp:
        out.append(f"--kill: {len(args.kill)} kills leave no rank of --dp {args.dp}")
    return out


def train(args: argparse.Namespace, config: Any, opts: Any, progress: type) -> int:
    """One rank's --survive training; returns the exit code. `progress`:
    train_gpt's Progress class (rank 0's bar or lines)."""
    if replaces(args):
        return _replaced(args, config, opts, progress)
    return _shrunk(args, config, opts, progress)


def _init(args: argparse.Namespace, store: Any) -> pc.Communicator:
    """The world communicator: on the launcher's store if it serves one, else
    on init's, kept (rank 0 serves it): across hosts the survivors agree and
    shrink through it (rank 0's host must survive)."""
    if store is None:
        return pc.init(timeout=args.timeout, keep_store=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return pc.init(rank, world, store=store, timeout=args.timeout)


def _shrunk(args: argparse.Namespace, config: Any, opts: Any, progress: type) -> int:
    """Data parallel: the survivors go on without the lost rank (ElasticTrainer)."""
    from pycollectives.launcher import launcher_store
    from pycollectives.strategies.parallel3d.elastic_trainer import ElasticTrainer

    comm = _init(args, launcher_store(args.timeout))
    trainer = ElasticTrainer(comm, config, opts, tuple(args.kill), copy_every=args.copy_every)
    if comm.rank == 0:
        copies = f", buddy copies every {args.copy_every} step(s)"
        copies = "" if trainer.optimizer is not None else copies
        print(f"GPT {trainer.parameters:,} parameters; dp={comm.world_size} ranks, --survive "
              f"({trainer.mode}{copies}), on cpu; steps 0..{args.steps}", flush=True)  # fmt: skip
    bar = progress(args.steps, 0, args.log_every, comm.rank == 0)
    rates, loss = [], float("nan")
    while trainer.step_index < args.steps:
        stats = trainer.step()
        bar.enabled = trainer.rank == 0  # rank 0 may have died: its successor reports
        for rec in stats.recoveries:
            bar.say(rec.line())
        rates.append(stats.tokens / stats.seconds)
        loss = stats.loss
        bar.update(stats.step, loss, rates[-1])
    bar.close()
    if trainer.rank == 0 and rates:
        print(f"final loss {loss:.4f} after {trainer.step_index} steps on "
              f"{trainer.comm.world_size} ranks (world ranks {trainer.world_ranks} went on); "
              f"median {statistics.median(rates[1:] or rates):,.0f} tokens/s", flush=True)  # fmt: skip
    trainer.close()
    return 0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _replaced(args: argparse.Namespace, config: Any, opts: Any, progress: type) -> int:
    """--tp/--pp: a new process takes the lost rank's place (ElasticTrainer3D);
    this process is one of the first ranks, or (replacing() set) a replacement."""
    from pycollectives.launcher import launcher_store, replacing
    from pycollectives.strategies.models.gpt import Block
    from pycollectives.strategies.parallel3d import ElasticTrainer3D, full_shapes
    from pycollectives.strategies.parallel_dims import ParallelDims

    store, lost = launcher_store(args.timeout), replacing()
    if store is None:
        raise ValueError("--survive with --tp/--pp: the launcher serves no store")
    sizes = dict(dp=args.dp, tp=args.tp, pp=args.pp)
    if lost is None:
        dims = ParallelDims(_init(args, store), **sizes)
        et = ElasticTrainer3D(dims, config, opts, store, copy_every=args.copy_every)
        me = dims.world.rank
        kill = min((s for r, s in args.kill if r == me), default=None)
    else:  # waits for the survivors' recovery, then takes a lost place
        et = ElasticTrainer3D.join(store, config, opts, copy_every=args.copy_every,
                                   timeout=args.timeout, **sizes)  # fmt: skip
        kill = None  # --kill names the first processes only

    def arm() -> None:  # in the forward of this rank's last block (any schedule runs it)
        if kill is not None:
            block = [b for b in et.trainer.stages[0].blocks if isinstance(b, Block)][-1]
            block.register_forward_pre_hook(lambda m, a: _die() if et.steps == kill else None)

    arm()
    world = et.dims.world.world_size
    if et.dims.world.rank == 0 and lost is None:
        mode = " with --fsdp" if args.fsdp else f" with --zero {args.zero}" if args.zero else ""
        n = sum(math.prod(shape) for shape in full_shapes(config).values())
        print(f"GPT {n:,} parameters; dp={args.dp} x tp={args.tp} x pp={args.pp} = {world} "
              f"ranks, --survive (ElasticTrainer3D{mode}: a lost rank is replaced, up to "
              f"{args.max_replacements} times; buddy copies every {args.copy_every} step(s)), schedule "
              f"{args.schedule}, on cpu; steps {et.steps}..{args.steps}", flush=True)  # fmt: skip
    bar = progress(args.steps, et.steps, args.log_every, et.dims.world.rank == 0)
    rates, loss = [], float("nan")
    while et.steps < args.steps:
        if not et.step():  # every rank rolled back to the copy's step
            rec = et.recoveries[-1]
            if et.dims.world.rank == min(set(range(world)) - set(rec["failed"])):
                if bar.enabled:  # rank 0: above its bar
                    bar.say(_line(rec, et.dims))
                else:
                    print(_line(rec, et.dims), flush=True)
            arm()  # a new trainer
            continue
        stats = et.last
        bar.enabled = et.dims.world.rank == 0  # a replacement may hold rank 0 now
        rates.append(stats.tokens / stats.seconds)
        loss = stats.loss
        bar.update(stats.step, loss, rates[-1])
    bar.close()
    if et.dims.world.rank == 0 and rates:
        print(f"final loss {loss:.4f} after {et.steps} steps on {world} ranks; median "
              f"{statistics.median(rates[1:] or rates):,.0f} tokens/s", flush=True)  # fmt: skip
    et.close()
    return 0


def _line(rec: dict[str, Any], dims: Any) -> str:
    """The progress line of an ElasticTrainer3D recovery, e.g. "rank 1 (dp=0,
    tp=1, pp=0) died at step 2: a new process took its place in 3.10 s, with
    its ZeRO-2 shard (parameters and AdamW state) from rank 2's copy (...)"."""
    failed, k, back = rec["failed"], rec["step"], rec["rolled_back_to"]
    total = rec["agree_s"] + rec["replace_s"] + rec["restore_s"]
    took = "a new process took its place" if len(failed) == 1 else (
        f"{len(failed)} new processes took their places")  # fmt: skip
    then = "the step is retried" if back == k else f"back to step {back}, the buddy copy's"
    state = rec["state"] if len(failed) == 1 else rec["state"].replace("its ", "each ", 1)
    froms = ", ".join(f"rank {src}'s " + ("copy" if which == "remote" else "own copy (a dp replica)")
                      for src, which in rec["sources"].values())  # fmt: skip
    return (
        f"{', '.join(dims.where(r) for r in failed)} died at step {k}: {took} in "
        f"{total:.2f} s, with {state} from {froms} (agree {rec['agree_s'] * 1e3:.1f} ms, shrink and grow "
        f"{rec['replace_s'] * 1e3:.1f} ms, restore {rec['restore_s'] * 1e3:.1f} ms; {then})"
    )
