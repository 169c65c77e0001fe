"""Shared by the framework examples: run one twice on 2 CPU ranks, under "gloo"
and under "pycoll", and check that every rank ends with the same parameters,
bit for bit.

Run without arguments, an example is the driver: it starts
`torchrun --nproc-per-node 2 <example> --backend B --out DIR` for B = gloo,
then pycoll, and compares the parameters the ranks saved. Under torchrun (RANK
set) it is one rank: it trains with its backend and saves its parameters.
`python _compare.py <example>` is the same driver without importing the
example (nor its framework: Lightning's import alone is ~8 s of CPU), as
tests/torch_backend/test_frameworks.py runs it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(script: str, train: Callable[[str], torch.nn.Module]) -> None:
    """The example's entry point: the driver, or (under torchrun) one rank
    running train(backend) and saving the parameters of the module it returns.
    Exits non-zero with a message if a run fails or the parameters differ."""
    p = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    p.add_argument("--backend", choices=("gloo", "pycoll"), help="(set by the driver)")
    p.add_argument("--out", help="(set by the driver) where the ranks save their parameters")
    args = p.parse_args()
    if "RANK" not in os.environ:
        drive(script)
        return
    # One rank, under torchrun.
    import pycollectives  # noqa: F401 - registers the "pycoll" backend

    model = train(args.backend)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, Path(args.out) / f"{args.backend}-{os.environ['RANK']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.backend == "gloo":
        # The reference run's parameters are saved. torch 2.13's gloo sometimes aborts
        # the process in its teardown at exit ("terminate called without an active
        # exception", SIGABRT; seen in CI under Lightning Fabric and accelerate, with and
        # without destroy_process_group; torch #179291 is a kin): not ours to test, so
        # the gloo rank leaves without the interpreter's teardown. "pycoll" ranks exit
        # normally, their teardown checked.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def drive(script: str) -> None:
    """The driver: `script` (a framework example) under torchrun on 2 ranks with
    gloo, then pycoll; exits non-zero with a message if a run fails or the
    parameters differ, else prints that they are the same."""
    with tempfile.TemporaryDirectory() as out:
        for backend in ("gloo", "pycoll"):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}",
                   f"--master-port={_free_port()}", script, "--backend", backend, "--out", out]  # fmt: skip
            env = {"OMP_NUM_THREADS": "1", **os.environ}  # (torchrun's banner otherwise)
            if subprocess.run(cmd, env=env).returncode:
                sys.exit(f"{Path(script).name}: the {backend} run failed")
        runs = {
            (b, r): torch.load(Path(out) / f"{b}-{r}.pt")
            for b in ("gloo", "pycoll")
            for r in range(RANKS)
        }
    ref = runs["gloo", 0]
    for (b, r), state in runs.items():
        bad = [k for k in ref if not torch.equal(state[k], ref[k])]
        if state.keys() != ref.keys() or bad:
            sys.exit(f"{Path(script).name}: {b} rank {r} differs from gloo rank 0 in {bad}")
    print(f"{Path(script).name}: pycoll and gloo trained the same parameters on {RANKS} ranks")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python _compare.py EXAMPLE (e.g. lightning_trainer.py)")
    drive(sys.argv[1])
