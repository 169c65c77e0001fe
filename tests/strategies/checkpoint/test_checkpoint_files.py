"""strategies.checkpoint on disk: a rank killed in the middle of a save
leaves the previous checkpoint loadable and nothing partial (the other ranks
raise, never hang); an incomplete or truncated checkpoint is refused;
consolidation streams (its peak memory, measured in a child process, is
about the largest tensor, not the checkpoint)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import paths
import pytest
import torch
from spawn import run
from zero_common import CFG, DATA, OPT, build, differ, local_batch

import pycollectives as pc
from pycollectives.strategies.checkpoint import (
    CheckpointError,
    Piece,
    consolidate,
    load,
    read_index,
    save,
)
from pycollectives.strategies.checkpoint import format as fmt
from pycollectives.strategies.checkpoint.piece_files import save_pieces
from pycollectives.strategies.models.gpt import GPT

ROOT = paths.ROOT
KILLED = 1  # the rank killed mid-write
KILL_AFTER = 2048  # bytes of its file written when it dies


def _train(comm: pc.Communicator, model: GPT, opt: object, step: int) -> None:
    opt.zero_grad()
    model(*local_batch(comm, step)).backward()
    opt.step()


def _killed_mid_save(rank: int, world: int, root: str) -> tuple[str, float, dict]:
    comm = pc.init(timeout=30)
    model, opt = build(comm, "zero3")
    _train(comm, model, opt, 0)
    save(f"{root}/ck", comm, model, opt, extra={"step": 1})
    before = {n: t.numpy() for n, t in opt.full_parameters().items()}  # by value: the rank exits
    _train(comm, model, opt, 1)
    if rank == KILLED:
        fmt.CHUNK = 512  # several writes per tensor, so the kill lands inside the file

        def die(name: str, done: int) -> None:
            if done >= KILL_AFTER:
                Path(root, "killed").write_text(f"{name} {done}")
                os.kill(os.getpid(), signal.SIGKILL)

        fmt.on_chunk = die
    start = time.monotonic()
    try:
        save(f"{root}/ck", comm, model, opt, extra={"step": 2})
    except CheckpointError as e:
        return str(e), time.monotonic() - start, before
    return "no error", 0.0, before


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    out = run(
        _killed_mid_save, 3, str(tmp_path), timeout=120, expect_exit={KILLED: -signal.SIGKILL}
    )
    assert (tmp_path / "killed").exists(), "the rank was not killed while writing"
    for r in (0, 2):
        msg, seconds, _ = out[r]
        assert "rank 1" in msg and "unchanged" in msg and f"rank {r}" in msg, msg
        assert seconds < 10, f"rank {r} took {seconds:.1f} s to notice"
    # the previous checkpoint is intact; its rank-1 file is larger than where the kill landed
    assert read_index(tmp_path / "ck")["extra"]["user"] == {"step": 1}
    assert (tmp_path / "ck" / fmt.file_name(KILLED, 3)).stat().st_size > 2 * KILL_AFTER
    assert not list(tmp_path.glob("ck.tmp-*")), "the unfinished save was left behind"
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    assert load(tmp_path / "ck", None, model, opt) == {"step": 1}
    got = {n: p.detach() for n, p in model.named_parameters()}
    before = {n: torch.from_numpy(a) for n, a in out[0][2].items()}
    assert differ(got, before) is None, differ(got, before)
    # consolidated, it holds the same parameters and optimizer state
    consolidate(tmp_path / "ck", tmp_path / "all.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "all.safetensors"), "pt") as f:
        for n, p in model.named_parameters():
            assert torch.equal(f.get_tensor(n), p.detach()), n
            assert torch.equal(f.get_tensor(f"optim/exp_avg/{n}"), opt.state[p]["exp_avg"]), n
            assert torch.equal(f.get_tensor(f"optim/step/{n}"), opt.state[p]["step"]), n


def test_incomplete_or_truncated_checkpoint_is_refused(tmp_path):
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    model(*DATA.batch(torch.arange(2))).backward()
    opt.step()
    save(tmp_path / "ck", None, model, opt)
    shutil.copytree(tmp_path / "ck", tmp_path / "partial")
    (tmp_path / "partial" / "index.json").unlink()
    with pytest.raises(ValueError, match="not a checkpoint"):
        load(tmp_path / "partial", None, GPT(CFG))
    f = tmp_path / "ck" / fmt.file_name(0, 1)
    f.write_bytes(f.read_bytes()[:-100])
    fresh = GPT(CFG)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **OPT)
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, the index says \d+"):
        load(tmp_path / "ck", None, fresh, fresh_opt)
    assert not fresh_opt.state, "a failed load left optimizer state behind"
    with pytest.raises(CheckpointError, match="the index says"):
        consolidate(tmp_path / "ck", tmp_path / "out.safetensors")
    assert not list(tmp_path.glob("out.safetensors*")), "a partial output was left"


N_TENSORS, ROWS, COLS = 24, 512, 1024  # 24 tensors of 2 MiB: 48 MiB


def _value(i: int) -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32) + i * ROWS * COLS).view(ROWS, COLS)


def job_big_checkpoint(comm: pc.Communicator, path: str) -> None:
    """Every tensor in N pieces: even ones flat shards, odd ones split along dim 1."""
    r, n = comm.rank, comm.world_size
    pieces = []
    for i in range(N_TENSORS):
        t = _value(i)
        if i % 2 == 0:
            c = -(-t.numel() // n)
            lo, hi = r * c, min(t.numel(), (r + 1) * c)
            pieces.append(Piece(f"t{i}", t.shape, t.dtype, flat=(lo, hi), data=t.view(-1)[lo:hi]))
        else:
            w = COLS // n
            part = t[:, r * w : (r + 1) * w].contiguous()
            pieces.append(Piece(f"t{i}", t.shape, t.dtype, (0, r * w), (ROWS, w), data=part))
    save_pieces(comm, path, pieces)


def _peak_kib(code: str) -> int:
    """Peak RSS (KiB, VmHWM: ru_maxrss would keep the forking pytest's peak
    across exec) of a fresh interpreter running `code`."""
    prog = (
        "from pycollectives.strategies.checkpoint.consolidation import consolidate\n"
        "from pycollectives.strategies.checkpoint.format import read_index\n"
        f"{code}\n"
        "print(next(line.split()[1] for line in open('/proc/self/status') "
        "if line.startswith('VmHWM')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_consolidation_streams(pool, tmp_path):
    src, out = tmp_path / "big", tmp_path / "big.safetensors"
    pool(4).run(job_big_checkpoint, str(src), timeout=120)
    size = sum(f.stat().st_size for f in src.iterdir())
    base = _peak_kib(f"read_index({str(src)!r})")
    peak = _peak_kib(f"consolidate({str(src)!r}, {str(out)!r})")
    largest = ROWS * COLS * 4
    grew = (peak - base) * 1024
    print(
        f"consolidation of {size / 2**20:.1f} MiB: peak RSS {peak / 1024:.1f} MiB, "
        f"{grew / 2**20:.1f} MiB above the interpreter; largest tensor {largest / 2**20:.1f} MiB"
    )
    assert grew <= largest + (4 << 20), (grew, largest)
    assert grew < size / 8, (grew, size)
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == sorted(f"t{i}" for i in range(N_TENSORS))
        for i in range(N_TENSORS):
            assert torch.equal(f.get_tensor(f"t{i}"), _value(i)), i
