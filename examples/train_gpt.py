"""Trains the reference GPT with data x tensor x pipeline parallelism on
pycollectives (strategies/parallel3d/).

    python examples/train_gpt.py --dp 2 --tp 2 --pp 2 --steps 20
    python examples/train_gpt.py --dp 2 --pp 2 --schedule zbh1 --microbatches 4
    python examples/train_gpt.py --dp 2 --pp 2 --zero 1
    python examples/train_gpt.py --dp 2 --tp 2 --fsdp
    python examples/train_gpt.py --dp 2 --pp 2 --fsdp
    python examples/train_gpt.py --tp 2 --pp 2 --sequence-parallel --device cuda
    torchrun --nproc-per-node 8 examples/train_gpt.py --dp 2 --tp 2 --pp 2

Under torchrun each process is one rank; otherwise the script starts
dp x tp x pp local ranks itself. Rank 0 shows a progress bar (tqdm if
installed, else a line every --log-every steps) with the loss and tokens/s.
The defaults train a tiny model on a synthetic language (a sparse Markov
chain: the loss falls towards log(2)) in seconds on two cores. Bad options
raise the same error on every rank; the script prints it once and exits 2.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone as is

import torch  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or zbh1")
    p.add_argument("--virtual-stages", type=int, default=2, help="interleaved: stages per rank")
    p.add_argument("--microbatches", type=int, default=4, help="per step and dp rank")
    p.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage on dp (2, 3: --pp 1)")
    p.add_argument("--fsdp", action="store_true", help="FSDP on the dp axis (not with zbh1)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp (any --pp)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: cuda:(LOCAL_RANK %% GPUs)"
    )
    p.add_argument("--log-every", type=int, default=10, help="plain progress lines")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint at the end")
    p.add_argument("--resume", metavar="DIR", help="start from a checkpoint")
    return p.parse_args(argv)


def save(trainer, directory: str) -> None:  # noqa: ANN001
    """Writes the checkpoint of `trainer` into `directory` (collective)."""
    from pycollectives.strategies.parallel3d.checkpoint import save_trainer

    save_trainer(trainer, directory)


def resume(trainer, directory: str) -> None:  # noqa: ANN001
    """Loads `directory` into `trainer`, which continues at the saved step (collective)."""
    from pycollectives.strategies.parallel3d.checkpoint import load_trainer

    load_trainer(trainer, directory)


class Progress:
    """Rank 0's progress: a tqdm bar if tqdm is installed, else plain lines."""

    def __init__(self, total: int, first: int, every: int, enabled: bool) -> None:
        self.enabled, self.every, self.total, self.bar = enabled, every, total, None
        if enabled:
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
            self.bar.update(1)
        elif (step + 1) % self.every == 0 or step + 1 == self.total or step == 0:
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  tokens/s {tokens_per_s:,.0f}")
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(args: argparse.Namespace) -> int:
    """One rank's training (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); returns the exit code."""
    import pycollectives as pc
    from pycollectives.strategies.mesh import ParallelDims
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import Trainer3D, TrainOptions, full_shapes

    comm = pc.init(timeout=120)
    rank = comm.rank
    try:
        config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers,
                           n_head=args.heads, d_model=args.d_model, seed=args.seed)  # fmt: skip
        opts = TrainOptions(
            schedule=args.schedule, microbatches=args.microbatches, zero=args.zero,
            virtual_stages=args.virtual_stages, fsdp=args.fsdp, global_batch=args.batch,
            sequence_parallel=args.sequence_parallel, data_seed=args.seed, lr=args.lr,
            dtype=DTYPES[args.dtype], device=args.device, timeout=120,
        )  # fmt: skip
        dims = ParallelDims(comm, dp=args.dp, tp=args.tp, pp=args.pp)
        trainer = Trainer3D(dims, config, opts)
        if args.resume:
            resume(trainer, args.resume)
    except ValueError as e:
        if rank == 0:
            print(f"train_gpt.py: error: {e}", file=sys.stderr)
        comm.close()
        return 2
    if rank == 0:
        n = sum(math.prod(shape) for shape in full_shapes(config).values())
        print(f"GPT {n:,} parameters; dp={dims.dp} x tp={dims.tp} x pp={dims.pp} = "
              f"{comm.world_size} ranks, schedule {args.schedule}, "
              f"{args.microbatches} micro-batches, zero={args.zero}, on {args.device}; steps "
              f"{trainer.step_index}..{args.steps}")  # fmt: skip
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
    if rank == 0 and rates:
        median = statistics.median(rates[1:] or rates)
        print(f"final loss {loss:.4f} after {trainer.step_index} steps; "
              f"median {median:,.0f} tokens/s")  # fmt: skip
    dims.close()
    comm.close()
    return 0


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sys.exit(train(parse_args(argv)))  # the process's exit code


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts dp x tp x pp local ranks; returns the worst exit code."""
    world = args.dp * args.tp * args.pp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train(args)
    if min(args.dp, args.tp, args.pp) < 1:
        print(f"train_gpt.py: error: --dp {args.dp} --tp {args.tp} --pp {args.pp} must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    return spawn(args, argv)


if __name__ == "__main__":
    sys.exit(main())
