"""Sharded checkpoints that load into another layout (strategies.checkpoint).

torchrun --nproc-per-node 2 examples/checkpoint_resume.py --dir ckpt
python -m pycollectives.strategies.checkpoint consolidate ckpt/step-4 model.safetensors

Trains a small GPT under ZeRO-3 for 4 steps, saves a sharded checkpoint
(one safetensors file per rank + index.json), trains 4 more steps; then
builds the model afresh under FSDP (fully_shard + torch AdamW), loads the
checkpoint (parameters and AdamW state), trains the same 4 steps and compares
with the uninterrupted run. Rank 0 finally consolidates the checkpoint into
one safetensors file (DIR/model.safetensors), as the second line does, and
loads it into a plain model. It says where each file went.
"""

import argparse
import getpass
import os
import sys
import tempfile

import torch

import pycollectives as pc
from pycollectives.strategies.checkpoint import consolidate, load, save
from pycollectives.strategies.data import SyntheticSequences
from pycollectives.strategies.data_parallel.fsdp import fully_shard
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
DATA = SyntheticSequences(CFG.vocab_size, CFG.seq_len, 1024, seed=1)
OPT = {"lr": 1e-2, "eps": 1e-3}


def train(comm: pc.Communicator, model: GPT, opt, steps: range) -> float:
    for step in steps:
        rows = torch.arange(step * 4 * comm.world_size, (step + 1) * 4 * comm.world_size)
        x, y = DATA.batch(rows[comm.rank * 4 : (comm.rank + 1) * 4])
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
    return loss.item()


def main() -> None:
    default = os.path.join(tempfile.gettempdir(), f"pycollectives-ckpt-{getpass.getuser()}")
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=default, help="where the checkpoints go")
    args = parser.parse_args()
    comm = pc.init()
    path = os.path.join(args.dir, "step-4")

    model = GPT(CFG)
    zero = ZeroOptimizer(model, torch.optim.AdamW, comm, stage=3, **OPT)
    train(comm, model, zero, range(4))
    save(path, comm, model, zero, extra={"step": 4})  # atomic: replaces an earlier step-4
    if comm.rank == 0:
        print(f"saved step 4 (ZeRO-3, {comm.world_size} ranks) in {path}", flush=True)
    loss = train(comm, model, zero, range(4, 8))
    uninterrupted = zero.full_parameters()

    fresh = GPT(CFG)
    for block in fresh.blocks:
        fully_shard(block, comm)
    fully_shard(fresh, comm)
    opt = torch.optim.AdamW(fresh.parameters(), **OPT)
    extra = load(path, comm, fresh, opt)  # ZeRO-3's shards into FSDP's
    resumed_loss = train(comm, fresh, opt, range(extra["step"], 8))
    resumed = fresh.full_parameters()
    diff = max((resumed[n] - uninterrupted[n]).abs().max().item() for n in resumed)
    sys.stdout.write(  # the whole line in one write, flushed: the ranks share the terminal
        f"rank {comm.rank}: loss {loss:.4f} uninterrupted (ZeRO-3), {resumed_loss:.4f} resumed "
        f"under FSDP from step {extra['step']} of {path}; max |parameter difference| {diff:.3g}\n"
    )
    sys.stdout.flush()
    assert diff <= 1e-5, diff

    if comm.rank == 0:
        out = os.path.join(args.dir, "model.safetensors")
        stats = consolidate(path, out, model_only=True)
        print(f"consolidated {stats['tensors']} tensors ({stats['bytes']} bytes) into {out}")
        try:
            from safetensors.torch import load_file
        except ImportError:
            print("(pip install safetensors to load it into a plain model)")
        else:
            plain = GPT(CFG)
            missing = plain.load_state_dict(load_file(out), strict=False).missing_keys
            print(f"loaded into a plain GPT; missing only the tied {missing}")
    comm.close()


if __name__ == "__main__":
    main()
