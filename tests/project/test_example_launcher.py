"""The examples as a user meets them: the source tree without a build, the
options checked before any rank starts, Ctrl-C and a stopped rank under the
self-spawning launcher (pycollectives.launcher) and under torchrun."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import paths
import pytest

ROOT = paths.ROOT
TRAIN_GPT = str(ROOT / "examples" / "train_gpt.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _copy_package(dest: Path, with_extension: bool) -> Path:
    """pycollectives/ copied under `dest`, with or without its compiled _C."""
    ext = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    skip = shutil.ignore_patterns(
        "__pycache__", *([] if with_extension else [f"_C{s}" for s in ext])
    )
    shutil.copytree(ROOT / "pycollectives", dest / "pycollectives", ignore=skip)
    return dest / "pycollectives"


def test_source_tree_without_build_says_so_in_one_line(tmp_path):
    """Imported from a clone that was never built (the clone's root is the
    current directory, nothing installed): one line saying so, no
    "partially initialized module" (circular import) error."""
    src = _copy_package(tmp_path, with_extension=False)
    p = subprocess.run([sys.executable, "-S", "-c", "import pycollectives"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: pycollectives is imported from its source tree at {src}, which has no "
        "compiled extension: run `pip install -e .` or run from another directory"
    ), p.stderr
    assert "circular" not in p.stderr and "partially initialized" not in p.stderr, p.stderr


def test_source_tree_uses_the_installed_build(tmp_path):
    """`python -m pycollectives...` from the root of a clone installed with
    `pip install .`: the unbuilt source folder comes first on sys.path, and
    the package then loads the installed (built) one's modules."""
    (tmp_path / "clone").mkdir()
    (tmp_path / "site").mkdir()
    _copy_package(tmp_path / "clone", with_extension=False)
    site = _copy_package(tmp_path / "site", with_extension=True)
    code = (
        f"import sys; sys.path.insert(1, {str(tmp_path / 'site')!r}); import pycollectives as pc; "
    )
    code += "print(pc._C.__file__); print(pc.communicator.__file__)"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "clone", capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    ext, module = p.stdout.splitlines()
    assert Path(ext).parent == site and Path(module).parent == site, p.stdout


def _load_train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_example", TRAIN_GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--dp", "2", "--batch", "6"], "--batch 6 is not divisible by --dp 2 x --microbatches 4"),
        (["--tp", "2", "--heads", "3", "--d-model", "30"], "n_head=3 is not divisible by --tp 2"),
        (["--pp", "2", "--fsdp", "--schedule", "zbh1"], "--fsdp with --pp 2 and --schedule zbh1"),
        (["--pp", "8"], "fewer layers than stages"),
        (["--dp", "0"], "--dp 0 must be >= 1"),
        (["--timeout", "0"], "--timeout 0.0 must be > 0 seconds"),
    ],
)
def test_train_gpt_checks_options_before_starting_ranks(argv, says, monkeypatch, capsys):
    """Bad values are reported (exit 2) without starting a rank."""
    module = _load_train_gpt()
    started = []
    monkeypatch.setattr(module, "spawn", lambda *a, **k: started.append(a) or 0)
    monkeypatch.delenv("RANK", raising=False)
    assert module.main([*argv, "--steps", "1"]) == 2
    assert not started
    err = capsys.readouterr().err
    assert err.startswith("train_gpt.py: error: ") and says in err, err


def test_train_gpt_checks_world_size_under_torchrun(monkeypatch, capsys):
    module = _load_train_gpt()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert module.main(["--dp", "2"]) == 2
    assert "--dp 2 x --tp 1 x --pp 1 = 2, but the world size is 4" in capsys.readouterr().err


def test_train_gpt_help_shows_defaults(capsys):
    """--help (its parser in process; the other tests run the script)."""
    with pytest.raises(SystemExit) as e:
        _load_train_gpt().parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "(default: 1f1b)" in text and "(default: 600.0)" in text, out
    assert "--timeout" in text


def _descendants(pid: int) -> set[int]:
    """The processes below `pid` (from /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


FORKSERVER = "multiprocessing.forkserver import main"  # the launcher's fork server (and its forks)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _ranks(pids: set[int]) -> list[int]:
    """The rank processes among `pids`: forked by the launcher's fork server (not the server
    itself), started fresh (PYCOLL_LAUNCHER_START_METHOD=spawn), or by torchrun."""

    def is_rank(q: int, cmd: str) -> bool:
        if FORKSERVER in cmd:
            return FORKSERVER in _cmdline(_parent(q))
        return "spawn_main" in cmd or ("train_gpt.py" in cmd and "torch.distributed.run" not in cmd)

    return [q for q in pids if is_rank(q, _cmdline(q))]


def _run_then_signal(cmd: list[str], marker: str, sig: int, to_group: bool, limit: float = 150):
    """Runs `cmd` in its own process group until a line starting with `marker`,
    then sends `sig` (to the group, else to the highest-numbered rank process);
    returns (exit status, output, seconds from the signal to the exit, pids)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=ROOT, start_new_session=True)  # fmt: skip
    lines, deadline = [], time.monotonic() + limit
    try:
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(marker):
                break
        assert lines and lines[-1].startswith(marker), "".join(lines)
        pids = _descendants(p.pid)
        if to_group:
            os.killpg(p.pid, sig)
        else:
            os.kill(max(_ranks(pids)), sig)
        sent = time.monotonic()
        out, _ = p.communicate(timeout=limit)
        return p.returncode, "".join(lines) + out, time.monotonic() - sent, pids
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _segments_of(pids: set[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pycoll-{q}-") for q in pids)]


def test_ctrl_c_under_the_spawning_launcher():
    """SIGINT to the process group (Ctrl-C) during FSDP x pipeline training:
    one line per rank saying it was interrupted, exit status 130, no
    mismatch, nothing left in /dev/shm. (The header says fsdp, not zero=0.)"""
    cmd = [sys.executable, TRAIN_GPT, "--dp", "2", "--pp", "2", "--fsdp", "--steps", "1000",
           "--log-every", "1"]  # fmt: skip
    status, out, took, pids = _run_then_signal(cmd, "step 2/", signal.SIGINT, to_group=True)
    assert status == 130, out
    header = next(ln for ln in out.splitlines() if ln.startswith("GPT "))
    assert ", fsdp," in header and "zero=" not in header, header
    said = re.findall(r"^train_gpt\.py: rank (\d): interrupted", out, re.M)
    assert sorted(said) == ["0", "1", "2", "3"], out
    assert "Traceback" not in out and "ismatch" not in out, out
    assert took < 30, (took, out)
    assert not _segments_of(pids), _segments_of(pids)


@pytest.mark.parametrize("to_group", [True, False], ids=["ctrl-c", "one-rank"])
def test_ctrl_c_under_torchrun(to_group):
    """The same under torchrun: each rank one line, no false mismatch (the
    pipeline's stop signal made a peer report `send/recv mismatch ...
    count=0`). SIGINT to rank 1 alone: rank 0 says that rank 1 was interrupted.

    torchrun's own ending is not ours: on Ctrl-C its agent turns SIGINT into a
    SignalException, sends SIGINT to the ranks, then re-raises it (torch 2.13:
    its traceback, status 1); when a rank ends first it prints ChildFailedError
    with each rank's exit code. What is ours: the ranks' lines and statuses
    (130), no traceback from a rank, nothing left in /dev/shm."""
    cmd = [*TORCHRUN, "--nproc-per-node", "2", TRAIN_GPT, "--pp", "2", "--steps", "1000",
           "--log-every", "1"]  # fmt: skip
    status, out, took, pids = _run_then_signal(cmd, "step 2/", signal.SIGINT, to_group=to_group)
    assert status != 0, out  # torchrun reports the interrupted job as failed
    said = re.findall(r"^train_gpt\.py: rank (\d): interrupted", out, re.M)
    assert sorted(said) == ["0", "1"], out
    assert "ismatch" not in out and "stop signal" not in out, out
    # Any traceback is torchrun's: every frame is torch's (or runpy's), none a rank's.
    frames = re.findall(r'^\s*File "([^"]+)"', out, re.M)
    assert all(f.startswith("<frozen ") or "/torch/" in f for f in frames), out
    if not to_group:
        # "(signal)" where rank 1 was inside a wait of the core, "(SIGINT)" in Python code
        assert re.search(r"^train_gpt\.py: rank 0: interrupted: .*rank 1 \(dp=0, tp=0, pp=1\) "
                         r"was interrupted \((SIGINT|signal)\)", out, re.M), out  # fmt: skip
        # torchrun's summary of its failed ranks: both ended with 130, as Ctrl-C does.
        assert re.findall(r"^\s+exitcode\s+: (-?\d+)", out, re.M) == ["130", "130"], out
    rank_lines = [ln for ln in out.splitlines() if ln.startswith("train_gpt.py: rank")]
    assert len(rank_lines) == 2, out
    assert took < 30, (took, out)
    assert not _segments_of(pids), _segments_of(pids)


def test_stopped_rank_fails_every_rank_and_the_launcher_ends():
    """SIGSTOP one rank of dp2 x pp2 with --timeout 5: the others fail naming
    it by world rank and coordinates, the launcher kills the stopped rank after
    its grace period and exits non-zero with the first failure, in bounded time."""
    cmd = [sys.executable, TRAIN_GPT, "--dp", "2", "--pp", "2", "--steps", "1000",
           "--log-every", "1", "--timeout", "5"]  # fmt: skip
    status, out, took, pids = _run_then_signal(cmd, "step 2/", signal.SIGSTOP, to_group=False)
    assert status not in (0, 130), out
    assert took < 60, (took, out)
    failed = dict(re.findall(r"^train_gpt\.py: rank (\d): (.*)$", out, re.M))
    assert sorted(failed) == ["0", "1", "2"], out
    where = {"0": "dp=0, tp=0, pp=0", "1": "dp=1, tp=0, pp=0", "2": "dp=0, tp=0, pp=1"}
    for rank, msg in failed.items():  # every rank says where it is, with coordinates
        assert re.match(rf"\w+: step \d+ on rank {rank} \({where[rank]}\): ", msg), out
    # Its pp and dp peers: one of them waits on it directly and names it in world terms; the
    # other may have got past it (rank 3 stopped after its last message to it) into a later
    # collective, where rank 3 is among the ranks that have not reached it (rank 0: a knock-on).
    direct = []
    for rank in ("1", "2"):
        msg = failed[rank]
        named = "rank 3 (dp=1, tp=0, pp=1)" in msg
        listed = re.search(r"ranks that have not reached this operation: \[[^\]]*\b3\b", msg)
        assert named or listed, out
        direct.append(named)
        assert not re.search(r"\brank \d+\b(?! \(dp=)", msg.split("[ranks of")[0]), msg
    assert any(direct), out
    assert "train_gpt.py: rank 3 still running 5 s after rank" in out, out
    assert re.search(r"^train_gpt\.py: rank \d failed first: ", out, re.M), out
    assert not _segments_of(pids), _segments_of(pids)


SCRIPT_INTERRUPTED = """
import sys, torch, pycollectives as pc
comm = pc.init(timeout=60)
if comm.rank == 1:
    raise KeyboardInterrupt  # Ctrl-C in Python code, uncaught: the process exits
try:
    comm.all_reduce(torch.ones(4))
except pc.PyCollectivesError as e:
    print(f"rank 0: {type(e).__name__}: {e}", flush=True)
"""


def test_an_uncaught_ctrl_c_aborts_with_the_reason(tmp_path):
    """Any program: a rank that exits on an uncaught KeyboardInterrupt aborts
    its communicators saying so (atexit), so its peer names the interrupt
    instead of reporting a closed communicator."""
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT_INTERRUPTED)
    p = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", str(script)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("rank 0: ")), "")
    assert line.startswith("rank 0: CommunicatorAborted: "), p.stdout + p.stderr
    assert "rank 1 was interrupted (SIGINT)" in line, line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--dp", "2", "--plan", "2"], "--survive: --plan with --survive"),
        (["--dp", "2", "--copy-every", "0"], "--survive: --copy-every 0 must be >= 1"),
        (["--tp", "2", "--max-replacements", "-1"], "--max-replacements -1 must be >= 0"),
        (["--dp", "2", "--kill", "2@0"], "--kill 2@0: rank must be < 2 (dp x tp x pp)"),
        (["--dp", "2", "--kill", "0@1", "--kill", "1@1"], "--kill: 2 kills leave no rank"),
    ],
)
def test_train_gpt_survive_refuses_what_cannot_survive_before_starting_ranks(
    argv, says, monkeypatch, capsys
):
    """--survive with what it cannot recover (or run): exit 2, one line naming the option."""
    module = _load_train_gpt()
    started = []
    monkeypatch.setattr(module, "spawn", lambda *a, **k: started.append(a) or 0)
    monkeypatch.delenv("RANK", raising=False)
    assert module.main([*argv, "--survive", "--steps", "4"]) == 2
    assert not started
    err = capsys.readouterr().err
    assert err.startswith("train_gpt.py: error: ") and says in err, err
    assert module.main(["--kill", "0@1"]) == 2  # --kill alone
    assert "--kill needs --survive" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--tp", "2", "--dp", "2", "--zero", "2"], ["--pp", "2", "--fsdp"]]
)
def test_train_gpt_survive_takes_tp_pp_with_sharded_dp_state(argv, monkeypatch):
    """--tp/--pp with --zero/--fsdp: started, the launcher replacing lost ranks."""
    module = _load_train_gpt()
    started = []
    monkeypatch.setattr(module, "spawn", lambda *a, **k: started.append(k) or 0)
    monkeypatch.delenv("RANK", raising=False)
    assert module.main([*argv, "--survive", "--steps", "4"]) == 0
    [kwargs] = started
    assert kwargs["replace"] == 3 and kwargs["survive"], kwargs


def _final(out: str) -> tuple[float, int]:
    """(final loss, ranks left) of a --survive run's last line."""
    m = re.search(r"^final loss (\S+) after \d+ steps on (\d) ranks", out, re.M)
    assert m, out
    return float(m.group(1)), int(m.group(2))


def test_train_gpt_survive_rank_0_dies_and_the_run_matches_the_uninterrupted_one():
    """--kill 0@3 (rank 0 SIGKILLs itself in the backward of step 3): the three
    others drop the step, shrink, retry it re-split over themselves, the new
    rank 0 reports the recovery and the progress, the launcher exits 0, and
    the final loss is the uninterrupted run's (the same global batches)."""
    base = [sys.executable, TRAIN_GPT, "--dp", "4", "--survive", "--steps", "6",
            "--log-every", "1", "--timeout", "30"]  # fmt: skip
    run = [subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT)
           for cmd in (base + ["--kill", "0@3"], base)]  # fmt: skip
    killed, whole = run
    out = killed.stdout + killed.stderr
    assert killed.returncode == 0, out
    assert "train_gpt.py: rank 0 killed by SIGKILL: the others go on" in out, out
    assert re.search(r"^rank 0 died at step 3: 3 ranks go on \(agree [\d.]+ ms, shrink [\d.]+ "
                     r"ms; the step is retried\)$", out, re.M), out  # fmt: skip
    assert re.search(r"^step 6/6 ", out, re.M), out  # the new rank 0's progress
    assert whole.returncode == 0, whole.stdout + whole.stderr
    loss, left = _final(out)
    want, all_ = _final(whole.stdout)
    assert (left, all_) == (3, 4)
    assert abs(loss - want) <= 2e-4, (loss, want)  # printed to 4 decimals; sums regrouped


def test_train_gpt_survive_goes_on_after_kill_9_from_outside():
    """The user's kill -9 of a rank process: the launcher names it and leaves the
    others running (without --survive it ends them 5 s later), they finish and
    the script exits 0."""
    cmd = [sys.executable, TRAIN_GPT, "--dp", "4", "--survive", "--steps", "30",
           "--log-every", "1", "--timeout", "30"]  # fmt: skip
    status, out, took, pids = _run_then_signal(cmd, "step 3/", signal.SIGKILL, to_group=False)
    assert status == 0, out
    assert re.search(r"^train_gpt\.py: rank \d killed by SIGKILL: the others go on$", out, re.M)
    assert re.search(r"^rank \d died at step \d+: 3 ranks go on ", out, re.M), out
    assert _final(out)[1] == 3 and "still running" not in out, out
    assert not _segments_of(pids), _segments_of(pids)


def test_train_gpt_survive_a_stopped_rank_is_fenced_and_the_others_go_on():
    """SIGSTOP a rank past --timeout: the survivors leave it out and go on; when it
    resumes (SIGCONT) it finds itself fenced out and exits, and the launcher takes
    that as a lost rank, not a failure that ends the others: exit 0."""
    cmd = [sys.executable, TRAIN_GPT, "--dp", "4", "--survive", "--steps", "30",
           "--log-every", "1", "--timeout", "3"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=ROOT, start_new_session=True)  # fmt: skip
    lines, stopped = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step 3/") and stopped is None:
                stopped = max(_ranks(_descendants(p.pid)))
                os.kill(stopped, signal.SIGSTOP)
            if " died at step " in line:
                os.kill(stopped, signal.SIGCONT)
        p.wait(timeout=150)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = "".join(lines)
    assert p.returncode == 0, out
    assert re.search(r"^train_gpt\.py: rank \d was fenced out \(stopped past the timeout\): "
                     r"the others go on$", out, re.M), out  # fmt: skip
    assert _final(out)[1] == 3 and "still running" not in out, out
