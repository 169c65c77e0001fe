"""The README's example runs under torchrun (it checks its own results)."""

from __future__ import annotations

import re
import subprocess
import sys

import paths
import pytest
import torch

ROOT = paths.ROOT


def test_allreduce_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "allreduce.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "world 2: all_reduce 1.0" in p.stdout, p.stdout
    assert "failed to bind" not in p.stderr, p.stderr


def test_ddp_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "ddp_train.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("parameters identical on all ranks: True") == 2, p.stdout
    lines = [ln for ln in p.stdout.splitlines() if "rank" in ln]
    pattern = r"rank [01]: loss [\d.]+, parameters identical on all ranks: True"
    assert len(lines) == 2 and all(re.fullmatch(pattern, ln) for ln in lines), p.stdout


def test_windows_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           str(ROOT / "examples" / "windows.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    want = "world 3: window tensors: all_reduce: direct, reduce_scatter: direct, all_gather: direct"
    assert want in lines, p.stdout
    plain = next((ln for ln in lines if ln.startswith("world 3: plain tensors:")), "")
    assert plain and "direct" not in plain, p.stdout


def _cuda_ok() -> bool:
    import torch

    from pycollectives import _C

    return bool(_C.cuda_built()) and torch.cuda.is_available()


def test_cuda_example():
    """Under torchrun on a GPU: right results through the direct path; without
    one: exit status 2 and the reason, before any rendezvous."""
    script = str(ROOT / "examples" / "cuda_allreduce.py")
    if not _cuda_ok():
        p = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "needs a GPU" in p.stderr, p.stderr
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all_reduce 3.0" in p.stdout, p.stdout
    assert "all_gather [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]" in p.stdout, p.stdout
    assert "'direct': 1" in p.stdout, p.stdout


def _train_gpt(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_train_gpt_example_spawns_saves_and_resumes_under_torchrun(tmp_path):
    """Not under torchrun, the script starts dp x tp x pp ranks itself (here
    tp=2 x pp=2, ZB-H1) and saves; under torchrun, 2 ranks with dp=2 resume
    the run at its step. The loss falls from log(vocab) = 4.16 towards the
    chain's log(2)."""
    ckpt = str(tmp_path / "ckpt")
    p = _train_gpt("--tp", "2", "--pp", "2", "--schedule", "zbh1", "--steps", "12", "--save", ckpt)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dp=1 x tp=2 x pp=2 = 4 ranks, schedule zbh1" in p.stdout, p.stdout
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("final loss")]
    assert len(final) == 1 and "after 12 steps" in final[0], p.stdout
    assert float(final[0].split()[2]) < 3.9 and "tokens/s" in final[0], final
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_gpt.py"), "--dp", "2", "--steps", "14", "--resume", ckpt]  # fmt: skip
    q = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert q.returncode == 0, q.stdout + q.stderr
    assert "dp=2 x tp=1 x pp=1 = 2 ranks" in q.stdout and "steps 12..14" in q.stdout, q.stdout
    assert "after 14 steps" in q.stdout, q.stdout


def test_train_gpt_example_bad_input():
    """Bad options: every rank raises the same error, printed once; exit 2."""
    p = _train_gpt("--tp", "2", "--heads", "3", "--d-model", "30", "--steps", "1")
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("n_head=3 is not divisible by --tp 2") == 1, p.stderr
    if not torch.cuda.is_available():  # --device cuda without a GPU: the flag and each rank named
        p = _train_gpt("--dp", "2", "--device", "cuda", "--steps", "1")
        assert p.returncode == 2, p.stdout + p.stderr
        for r in range(2):
            assert f"--device cuda: rank {r}: torch sees no CUDA device" in p.stderr, p.stderr


def test_train_gpt_plan_picks_its_layout_and_reports_beside_the_run(monkeypatch, capsys):
    """--plan 2: the planner picks a 2-rank layout this script accepts, the ranks train it,
    and rank 0 prints the prediction beside the measurement (the tensor storage within 5%:
    strategies/plan/trainer.py). Refused (main() in process, before any rank starts): --plan 0,
    nothing fits."""
    p = _train_gpt("--plan", "2", "--steps", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    picked = re.search(r"picked dp(\d) tp(\d) pp(\d)", p.stdout)
    assert picked and int(picked[1]) * int(picked[2]) * int(picked[3]) == 2, p.stdout
    assert f"dp={picked[1]} x tp={picked[2]} x pp={picked[3]} = 2 ranks" in p.stdout, p.stdout
    got = re.search(r"tensor storage predicted [\d.]+ MiB, measured [\d.]+ MiB per rank \(x([\d.]+)\)", p.stdout)  # fmt: skip
    assert got and abs(float(got[1]) - 1) <= 0.05, p.stdout
    assert re.search(r"plan: predicted step [\d.]+ ms, measured [\d.]+ ms", p.stdout), p.stdout
    # the picked layout's line: the step and the parts the planner priced, compute first
    assert re.search(r"predicted step [\d.]+ ms \(compute [\d.]+(, [a-z ]+ [\d.]+)*\)", p.stdout)
    from test_example_launcher import _load_train_gpt

    module = _load_train_gpt()
    monkeypatch.setattr(module, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.delenv("RANK", raising=False)
    assert module.main(["--plan", "0"]) == 2
    err = capsys.readouterr().err
    assert "--plan 0 must be >= 1" in err, err
    # 3 samples over dp x 4 micro-batches: none
    assert module.main(["--plan", "2", "--batch", "3"]) == 2
    err = capsys.readouterr().err
    assert "--plan 2: no layout fits" in err, err


def test_checkpoint_example_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "checkpoint_resume.py"), "--dir", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("resumed under FSDP from step 4") == 2, p.stdout
    lines = [ln for ln in p.stdout.splitlines() if "resumed under FSDP" in ln]
    assert len(lines) == 2 and all(ln.count("rank ") == 1 for ln in lines), p.stdout
    assert "consolidated 28 tensors" in p.stdout, p.stdout
    assert f"saved step 4 (ZeRO-3, 2 ranks) in {tmp_path / 'step-4'}" in p.stdout, p.stdout
    assert (tmp_path / "step-4" / "index.json").exists() and (
        tmp_path / "model.safetensors"
    ).exists()


@pytest.mark.parametrize("flags", [["--stage", "2"], ["--fsdp", "--bf16"]], ids=["zero2", "fsdp"])
def test_zero_example_spawns_its_ranks(flags):
    """Run as the README says (no torchrun: the example spawns 2 ranks); the
    loss falls and every rank ends with the same full parameters."""
    cmd = [sys.executable, str(ROOT / "examples" / "zero_train.py"), *flags, "--steps", "21"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("parameters identical on all ranks: True") == 2, p.stdout
    for rank in (0, 1):
        losses = [
            float(x) for x in re.findall(rf"rank {rank} \S+ step \d+: loss ([\d.]+)", p.stdout)
        ]
        assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, p.stdout
