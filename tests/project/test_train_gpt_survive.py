"""examples/train_gpt.py --survive beyond plain data parallel: a rank killed
under --zero / --fsdp (the survivors rebuild its shards from the buddy copies
and go on), and under --tp x --pp (the launcher starts a new process in the
lost place, it receives the place's state, every rank resumes at the failed
step and the run's loss is the uninterrupted run's); the launcher's bound on
replacements. Tiny models, few steps, each run bounded."""

from __future__ import annotations

import re
import subprocess
import sys

import paths
import pytest

ROOT = paths.ROOT
TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--vocab", "32", "--seq-len", "8",
        "--log-every", "1", "--timeout", "60"]  # fmt: skip


def _start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRAIN_GPT, *argv, *TINY], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)  # fmt: skip


def _finish(p: subprocess.Popen, timeout: float = 90) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out


def _final(out: str) -> str:
    """The final loss, as printed (4 decimals)."""
    m = re.search(r"^final loss (\S+) after \d+ steps", out, re.M)
    assert m, out
    return m.group(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "kill", "then", "header"),
    [
        (["--zero", "2"], "2@2", "the step is retried", "ElasticZero stage 2"),
        (["--fsdp", "--copy-every", "2"], "2@3", "back to step 2, the buddy copy's", "ElasticFSDP"),
    ],
    ids=["zero2-k1", "fsdp-k2"],
)
def test_sharded_survive_rank_killed_the_others_rebuild_its_shards_and_go_on(
    mode, kill, then, header
):
    status, out = _finish(_start("--dp", "4", "--batch", "12", "--microbatches", "1", "--survive",
                                 "--steps", "4", "--kill", kill, *mode))  # fmt: skip
    assert status == 0, out
    assert header in next(ln for ln in out.splitlines() if ln.startswith("GPT ")), out
    assert "train_gpt.py: rank 2 killed by SIGKILL: the others go on" in out, out
    step = kill.split("@")[1]
    assert re.search(rf"^rank 2 died at step {step}: 3 ranks go on \(agree [\d.]+ ms, shrink "
                     rf"[\d.]+ ms; {re.escape(then)}\)$", out, re.M), out  # fmt: skip
    assert re.search(r"^step 4/4 ", out, re.M), out
    assert re.search(r"^final loss \S+ after 4 steps on 3 ranks", out, re.M), out


@pytest.mark.timeout(150)
def test_tp_pp_survive_a_new_process_takes_the_lost_place_and_the_loss_matches():
    """--tp 2 --pp 2, rank 1 killed in step 1: the launcher names it and starts
    a replacement, the survivors' lowest rank reports the recovery and its
    time, the run finishes (exit 0) with the final loss of the same run
    without --survive (Trainer3D, uninterrupted: printed alike to 4 decimals;
    the test of the library, tests/strategies/parallel3d/test_replacement.py,
    checks every parameter bit for bit)."""
    grid = ["--tp", "2", "--pp", "2", "--microbatches", "2", "--batch", "8", "--steps", "3"]
    killed = _start(*grid, "--survive", "--kill", "1@1")
    whole = _start(*grid)
    (status, out), (want_status, want) = _finish(killed, 140), _finish(whole, 140)
    assert status == 0, out
    assert want_status == 0, want
    assert "train_gpt.py: rank 1 killed by SIGKILL: a new process takes its place " \
           "(replacement 1 of 3)" in out, out  # fmt: skip
    assert re.search(r"^rank 1 \(dp=0, tp=1, pp=0\) died at step 1: a new process took its "
                     r"place in [\d.]+ s, with its stage shard and AdamW state from rank 2's copy "
                     r"\(agree [\d.]+ ms, shrink and grow [\d.]+ ms, restore [\d.]+ ms; the step "
                     r"is retried\)$", out, re.M), out  # fmt: skip
    assert re.search(r"^step 3/3 ", out, re.M), out
    assert _final(out) == _final(want), (out, want)


@pytest.mark.timeout(120)
def test_tp_survive_with_no_replacement_left_ends_the_run_naming_the_rank():
    """--max-replacements 0: the lost rank cannot be replaced; the launcher
    says so naming it, ends the survivor (waiting for a newcomer that will not
    come) after its grace period and exits with the lost rank's status."""
    status, out = _finish(_start("--tp", "2", "--microbatches", "2", "--batch", "8", "--steps",
                                 "3", "--survive", "--max-replacements", "0", "--kill", "1@1"))  # fmt: skip
    assert status == 128 + 9, out
    assert "train_gpt.py: rank 1 killed by SIGKILL, and no replacement is left (0 of 0 used): " \
           "the run ends" in out, out  # fmt: skip
    assert "train_gpt.py: rank 1 failed first: killed by SIGKILL, and no replacement" in out, out
    assert "Traceback" not in out, out


def test_tp_survive_refused_for_ranks_started_by_hand(monkeypatch, capsys):
    """Ranks started with RANK/WORLD_SIZE (no launcher of this script's): nobody
    would start the replacements, so --survive with --tp is refused."""
    from test_example_launcher import _load_train_gpt

    module = _load_train_gpt()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert module.main(["--tp", "2", "--survive", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--survive: --tp 2 / --pp 1 with ranks started by hand" in err, err
