"""Trains the reference GPT with data x tensor x pipeline parallelism on
pycollectives (strategies/parallel3d/).

    python examples/train_gpt.py --dp 2 --tp 2 --pp 2 --steps 20
    python examples/train_gpt.py --dp 2 --pp 2 --schedule zbh1 --microbatches 4
    python examples/train_gpt.py --dp 2 --pp 2 --zero 1
    python examples/train_gpt.py --dp 2 --tp 2 --fsdp
    python examples/train_gpt.py --dp 4 --survive   # then kill -9 any rank
    python examples/train_gpt.py --dp 4 --zero 2 --survive
    python examples/train_gpt.py --tp 2 --pp 2 --survive   # a new process replaces it
    python examples/train_gpt.py --dp 2 --pp 2 --fsdp
    python examples/train_gpt.py --tp 2 --pp 2 --sequence-parallel --device cuda
    torchrun --nproc-per-node 8 examples/train_gpt.py --dp 2 --tp 2 --pp 2

Under torchrun each process is one rank; otherwise the script starts
dp x tp x pp local ranks itself. Rank 0 shows its progress with the loss and tokens/s: a tqdm bar on a
terminal when tqdm is installed, else a line every --log-every steps.
The defaults train a tiny model on a synthetic language (a sparse Markov
chain: the loss falls towards log(2)) in seconds on two cores. Bad options
are reported once, before any rank starts, with exit status 2 (what only the
ranks can check, once too). Ctrl-C: one line per rank, exit status 130. A rank
that fails (or, with --timeout, one that is stopped or hung) fails every rank,
each saying so in one line; the script ends the ranks still running a few
seconds later and exits non-zero with the first failure. With --survive a rank
that dies (kill -9) does not end the run (_survive.py, docs/recovery.md): data
parallel (also with --zero N or --fsdp) the others shrink to the survivors,
retry the step and go on; with --tp/--pp > 1 (also with --zero N or --fsdp)
this script starts a new process in the lost place (up to
--max-replacements), which receives the place's state from its peers, and
every rank resumes at the failed step. Data parallel across
hosts, start each rank with RANK, WORLD_SIZE, MASTER_ADDR (rank 0's host) and
MASTER_PORT set, as torchrun would but without its agent (which ends every rank
when one dies): a whole host may go, except rank 0's, which serves the store.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import sys
from types import SimpleNamespace

import torch

import pycollectives as pc
from pycollectives.launcher import run_rank, spawn
from pycollectives.strategies.models import GPTConfig
from pycollectives.strategies.parallel3d import SCHEDULES, TrainOptions, problems

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _survive.py, beside this file
import _survive  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}
DTYPE_BYTES = {"float32": 4, "float64": 8}
PROG = "train_gpt.py"
DEFAULT_TIMEOUT = inspect.signature(pc.init).parameters["timeout"].default  # the library's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks)")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES), help="pipeline schedule")
    p.add_argument("--virtual-stages", type=int, default=2, help="interleaved: stages per rank")
    p.add_argument("--microbatches", type=int, default=4, help="per step and dp rank")
    p.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--zero", type=int, default=0, choices=range(4),
                   help="ZeRO stage on dp (2, 3: --pp 1)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="FSDP on the dp axis (not with zbh1)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp (any --pp)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=32, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameters")
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: cuda:(LOCAL_RANK %% GPUs)"
    )
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds any collective or pipeline message may wait for a peer "
                   "(pycollectives.init's default)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=10, help="plain progress lines")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint at the end")
    p.add_argument("--resume", metavar="DIR", help="start from a checkpoint")
    p.add_argument("--plan", type=int, metavar="RANKS",
                   help="let the planner pick dp, tp, pp, --zero/--fsdp and --schedule for "
                   "RANKS ranks on this machine (replacing those flags), and print its "
                   "prediction beside what the run measures")  # fmt: skip
    _survive.add_arguments(p)
    p.add_argument(
        "--bench-json",
        metavar="FILE",
        help="with --plan: price collectives from this pycollectives-bench --json run",
    )
    return p.parse_args(argv)


# Priced.time's parts of a step (strategies/plan/layout.py) as --plan prints them.
PLAN_PARTS = {"compute": "compute", "tp_collectives": "tp collectives",
              "pipeline_bubble": "bubble", "dp_exposed": "dp exposed",
              "optimizer": "optimizer", "shared_cores": "ranks sharing cores",
              "collective_waits": "collective waits"}  # fmt: skip


def plan_layout(args: argparse.Namespace) -> list[str]:
    """--plan: sets args' layout to the planner's fastest one for args.plan local ranks
    that this script accepts (check()); returns the lines that say what was measured and
    predicted, or raises PlanInputError (nothing fits, bad input)."""
    from pycollectives.strategies.plan import PlanInputError, plan
    from pycollectives.strategies.plan.local import SCHEDULE_NAMES, choose, local_request
    from pycollectives.strategies.plan.trainer import trainer_storage

    if args.plan < 1:
        raise PlanInputError(f"--plan {args.plan} must be >= 1 ranks")
    model = dict(layers=args.layers, hidden=args.d_model, heads=args.heads, vocab=args.vocab,
                 seq=args.seq_len)  # fmt: skip
    req, links, said = local_request(model, args.batch, args.plan, args.microbatches,
                                     args.bench_json)  # fmt: skip
    fits, rejected = plan(req, links)

    def apply(lo) -> argparse.Namespace:  # noqa: ANN001
        zero = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 0}[lo.sharding]
        return argparse.Namespace(**{**vars(args), "dp": lo.dp, "tp": lo.tp, "pp": lo.pp,
            "zero": zero, "fsdp": lo.sharding == "fsdp",
            "schedule": SCHEDULE_NAMES[lo.schedule] if lo.pp > 1 else "1f1b"})  # fmt: skip

    best = choose(fits, lambda lo: not check(apply(lo), None))
    if best is None:
        why = "; ".join(sorted({r.reason for r in rejected}))[:400] or "no layout left"
        raise PlanInputError(f"--plan {args.plan}: no layout fits ({why})")
    vars(args).update(vars(apply(best.layout)))
    lo = best.layout
    mode = "zero0" if lo.sharding == "none" else lo.sharding
    storage = trainer_storage(req.model, lo.dp, lo.tp, lo.pp, mode,
                              lo.schedule if lo.pp > 1 else "1f1b", DTYPE_BYTES[args.dtype])  # fmt: skip
    args.predicted = {"step_s": best.step_s, "storage": max(sum(r.values()) for r in storage)}
    # Every part of the step the planner priced (Priced.time; dp_overlapped is hidden
    # under compute, not added), those that are 0 left out.
    parts = ", ".join(f"{PLAN_PARTS[k]} {v * 1e3:.2f}" for k, v in best.time.items()
                      if k in PLAN_PARTS and v > 0) or "nothing priced"  # fmt: skip
    return [f"plan: {line}" for line in said] + [
        f"plan: {len(fits)} layouts fit, {len(rejected)} rejected; picked {lo.name()}: "
        f"predicted step {best.step_s * 1e3:.2f} ms ({parts}), tensor storage "
        f"{args.predicted['storage'] / 2**20:.2f} MiB per rank"
    ]


def config_of(args: argparse.Namespace) -> GPTConfig:
    """The model the options describe."""
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers,
                     n_head=args.heads, d_model=args.d_model, seed=args.seed)  # fmt: skip


def options_of(args: argparse.Namespace) -> TrainOptions:
    """The training options the flags describe."""
    return TrainOptions(
        schedule=args.schedule, microbatches=args.microbatches, zero=args.zero,
        virtual_stages=args.virtual_stages, fsdp=args.fsdp, global_batch=args.batch,
        sequence_parallel=args.sequence_parallel, data_seed=args.seed, lr=args.lr,
        dtype=DTYPES[args.dtype], device=args.device, timeout=args.timeout,
    )  # fmt: skip


def check(args: argparse.Namespace, world: int | None) -> list[str]:
    """What is wrong with the options, found without starting a rank (the
    ranks check the same again, and what depends on them): sizes, the world
    size against dp x tp x pp (`world`: torchrun's, None when this script
    starts the ranks), the layout rules of Trainer3D (`problems`)."""
    out = []
    for flag in ("dp", "tp", "pp", "steps", "layers", "heads", "d_model", "vocab", "seq_len",
                 "log_every"):  # fmt: skip
        if getattr(args, flag) < 1:
            out.append(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if not args.timeout > 0:
        out.append(f"--timeout {args.timeout} must be > 0 seconds")
    out += _survive.problems(args, world)
    if out:
        return out
    size = args.dp * args.tp * args.pp
    if world is not None and world != size:
        out.append(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = {size}, "
                   f"but the world size is {world}")  # fmt: skip
    try:
        config = config_of(args)
    except ValueError as e:
        return [*out, str(e)]
    dims = SimpleNamespace(dp=args.dp, tp=args.tp, pp=args.pp)
    return out + problems(dims, config, options_of(args))  # type: ignore[arg-type]


def save(trainer, directory: str) -> None:  # noqa: ANN001
    """Writes the checkpoint of `trainer` into `directory` (collective)."""
    from pycollectives.strategies.parallel3d.checkpoint import save_trainer

    save_trainer(trainer, directory)


def resume(trainer, directory: str) -> None:  # noqa: ANN001
    """Loads `directory` into `trainer`, which continues at the saved step (collective)."""
    from pycollectives.strategies.parallel3d.checkpoint import load_trainer

    load_trainer(trainer, directory)


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal when tqdm is installed, else
    plain lines (a log or a pipe gets lines, not a bar redrawn with carriage returns)."""

    def __init__(self, total: int, first: int, every: int, enabled: bool) -> None:
        self.enabled, self.every, self.total, self.bar = enabled, every, total, None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=first, unit="step", file=sys.stdout)
            except ImportError:
                pass

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            self.bar.update(step + 1 - self.bar.n)  # a step redone after a recovery: back
        elif (step + 1) % self.every == 0 or step + 1 == self.total or step == 0:
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  tokens/s {tokens_per_s:,.0f}")
            sys.stdout.flush()

    def say(self, line: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(args: argparse.Namespace) -> int:
    """One rank's training (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); returns the exit code."""
    from pycollectives.strategies.parallel3d import Trainer3D, full_shapes
    from pycollectives.strategies.parallel_dims import ParallelDims

    comm = pc.init(timeout=args.timeout)
    rank = comm.rank
    try:
        config = config_of(args)
        dims = ParallelDims(comm, dp=args.dp, tp=args.tp, pp=args.pp)
        trainer = Trainer3D(dims, config, options_of(args))
        if args.resume:
            resume(trainer, args.resume)
    except ValueError as e:
        if rank == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        comm.close()
        return 2
    if rank == 0:
        n = sum(math.prod(shape) for shape in full_shapes(config).values())
        dp_mode = "fsdp" if args.fsdp else f"zero={args.zero}"
        print(f"GPT {n:,} parameters; dp={dims.dp} x tp={dims.tp} x pp={dims.pp} = "
              f"{comm.world_size} ranks, schedule {args.schedule}, "
              f"{args.microbatches} micro-batches, {dp_mode}, on {args.device}; steps "
              f"{trainer.step_index}..{args.steps}", flush=True)  # fmt: skip
    progress = Progress(args.steps, trainer.step_index, args.log_every, rank == 0)
    rates, loss = [], float("nan")
    while trainer.step_index < args.steps:
        stats = trainer.step()
        rates.append(stats.tokens / stats.seconds)
        loss = stats.loss
        progress.update(stats.step, loss, rates[-1])
    progress.close()
    if args.save:
        save(trainer, args.save)
    if getattr(args, "predicted", None) and rates:
        report_plan(args.predicted, trainer, comm, rates)
    if rank == 0 and rates:
        # The first step (warm-up: allocations, the first messages) is left out
        # when there are others; the progress line shows every step's rate.
        timed = rates[1:] or rates
        print(f"final loss {loss:.4f} after {trainer.step_index} steps; median {statistics.median(timed):,.0f} "
              f"tokens/s over steps {trainer.step_index - len(timed) + 1}..{trainer.step_index} "
              f"(rank 0's step times)", flush=True)  # fmt: skip
    dims.close()
    comm.close()
    return 0


def report_plan(predicted: dict, trainer, comm, rates: list[float]) -> None:  # noqa: ANN001
    """--plan: rank 0 prints the prediction beside what this run measured: the median step
    time (rank 0's, the first step left out when there are others), the tensor storage
    and the peak RSS of the busiest rank (collective)."""
    import resource

    tokens = trainer.opts.global_batch * trainer.config.seq_len
    step_s = statistics.median([tokens / r for r in (rates[1:] or rates)])
    worst = torch.tensor([float(sum(trainer.storage().values())),
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0],
                         dtype=torch.float64)  # fmt: skip
    comm.all_reduce(worst, pc.ReduceOp.MAX)
    storage, rss = worst.tolist()
    if comm.rank == 0:
        print(f"plan: predicted step {predicted['step_s'] * 1e3:.2f} ms, measured "
              f"{step_s * 1e3:.2f} ms (x{step_s / predicted['step_s']:.2f}); tensor storage "
              f"predicted {predicted['storage'] / 2**20:.2f} MiB, measured {storage / 2**20:.2f} "
              f"MiB per rank (x{storage / predicted['storage']:.3f}); peak RSS {rss / 2**20:.0f} "
              f"MiB (busiest rank: interpreter, torch and the communicator included)",
              flush=True)  # fmt: skip


def _rank_main(argv: list[str], world: int, planned: dict | None = None) -> int:
    """A rank started by spawn(): RANK, WORLD_SIZE, MASTER_ADDR/PORT are set. `planned`:
    the layout --plan chose before the ranks started (the same on every rank)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    args = parse_args(argv)
    if planned:
        vars(args).update(planned)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """One rank's training, --survive's or Trainer3D's; returns the exit code."""
    if args.survive:
        return _survive.train(args, config_of(args), options_of(args), Progress)
    return train(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    planned = None
    if args.plan is not None and args.survive:
        print(f"{PROG}: error: {'; '.join(_survive.problems(args, None))}", file=sys.stderr)
        return 2
    if args.plan is not None:
        from pycollectives.strategies.plan import PlanInputError

        if torchrun:
            print(f"{PROG}: error: --plan picks the layout before the ranks start: run it "
                  "without torchrun (it starts --plan RANKS local ranks)", file=sys.stderr)  # fmt: skip
            return 2
        try:
            said = plan_layout(args)
        except PlanInputError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        print("\n".join(said), flush=True)
        keys = ("dp", "tp", "pp", "zero", "fsdp", "schedule", "predicted")
        planned = {k: getattr(args, k) for k in keys}
    found = check(args, int(os.environ["WORLD_SIZE"]) if torchrun else None)
    if found:  # before any rank starts (under torchrun: each rank, before init)
        if not torchrun or os.environ.get("RANK") == "0":
            print(f"{PROG}: error: {'; '.join(found)}", file=sys.stderr)
        return 2
    if torchrun:  # with --survive: each rank started by hand or a cluster's launcher
        return run_rank(lambda: run(args), PROG)
    world = args.dp * args.tp * args.pp
    replace = args.max_replacements if args.survive and _survive.replaces(args) else None
    # --tp/--pp --survive: a rank stopped past --timeout, which the survivors fence out, is
    # killed so that a new process can take its place (it would never exit by itself).
    stopped = args.timeout if replace is not None else None
    return spawn(_rank_main, world, (argv, world, planned), prog=PROG, survive=args.survive,
                 replace=replace, serve_store=args.survive, stopped=stopped)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
