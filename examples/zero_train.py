"""Trains a tiny GPT with ZeRO (stage 1, 2 or 3) or FSDP on pycollectives.

python examples/zero_train.py --stage 3              # spawns 2 local ranks itself
python examples/zero_train.py --fsdp --nproc 4 --bf16
torchrun --nproc-per-node 2 examples/zero_train.py --stage 2

Each rank trains on its own slice of every batch of a synthetic language (a
sparse Markov chain: the loss falls from log(vocab) towards log(2)). ZeRO:
ZeroOptimizer shards AdamW's state (stage 1), the gradients (2) and the
parameters (3). FSDP: fully_shard per block, then the root. The script prints
the loss, the bytes this rank holds by role, and checks that every rank ends
with the same full parameters.
"""

import argparse
import os
import sys

import torch

import pycollectives as pc
from pycollectives.launcher import run_rank, spawn
from pycollectives.strategies.data import SyntheticSequences
from pycollectives.strategies.data_parallel.fsdp import MixedPrecisionPolicy, fully_shard
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig


def say(line: str) -> None:
    """Prints one whole line at once (the ranks share the terminal)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(args: argparse.Namespace) -> None:
    comm = pc.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun or main()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32)
    model = GPT(cfg)
    bf16 = torch.bfloat16 if args.bf16 else None
    if args.fsdp:
        for block in model.blocks:
            fully_shard(block, comm, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
        fully_shard(model, comm, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)  # over this rank's shards
        what = "FSDP"
    else:
        opt = ZeroOptimizer(model, torch.optim.AdamW, comm, args.stage, param_dtype=bf16, lr=3e-2)
        what = f"ZeRO-{args.stage}"
    data = SyntheticSequences(cfg.vocab_size, cfg.seq_len, 4096, seed=1)
    per_rank = 8
    for step in range(args.steps):
        first = (step * comm.world_size + comm.rank) * per_rank
        x, y = data.batch(torch.arange(first, first + per_rank))
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()  # stage 2/3 and FSDP: gradients reduce-scattered during backward
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            say(f"rank {comm.rank} {what} step {step}: loss {loss.item():.3f}")
    full = opt.full_parameters() if not args.fsdp else model.full_parameters()
    flat = torch.cat([t.reshape(-1).float() for t in full.values()])
    every = torch.empty(comm.world_size * flat.numel())
    comm.all_gather(every, flat)
    same = all(torch.equal(c, flat) for c in every.view(comm.world_size, -1))
    held = model.sharding_unit.engine.storage(opt) if args.fsdp else opt.storage()
    say(f"rank {comm.rank}: bytes held {held}; parameters identical on all ranks: {same}")
    assert same
    comm.close()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    ap.add_argument("--fsdp", action="store_true", help="fully_shard instead of ZeroOptimizer")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    ap.add_argument("--nproc", type=int, default=2, help="local ranks (without torchrun)")
    ap.add_argument("--steps", type=int, default=30, help="training steps")
    args = ap.parse_args()
    if args.nproc < 1 or args.steps < 1:
        ap.error(f"--nproc {args.nproc} and --steps {args.steps} must be >= 1")
    if "RANK" in os.environ:  # under torchrun
        return run_rank(lambda: train(args), "zero_train.py")
    return spawn(train, args.nproc, (args,), prog="zero_train.py")


if __name__ == "__main__":
    sys.exit(main())
