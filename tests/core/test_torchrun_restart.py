"""pycollectives.init under `torchrun --max-restarts`: the agent's store outlives
the failed attempt, and the restarted ranks must not read its keys (they would
find the dead attempt's ranks: "rank 0 (pid ...) died while rank 1 was setting
up a communicator with it")."""

from __future__ import annotations

import re
import subprocess
import sys

import paths

SCRIPT = """
import os, torch, pycollectives as pc
comm = pc.init(timeout=60)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(4)
comm.all_reduce(t)
if attempt == 0 and comm.rank == 1:
    os._exit(3)  # the first attempt fails after its communicator was built
if attempt == 0:
    try:
        comm.all_reduce(t)
    except pc.PyCollectivesError:
        os._exit(4)
os.write(1, f"attempt {attempt} rank {comm.rank} sum {t[0].item():g}\\n".encode())  # one write
comm.close()
"""


def test_init_after_a_torchrun_restart(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "1", str(script)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=paths.ROOT)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = sorted(re.findall(r"attempt \d rank \d sum \d+", p.stdout))
    assert lines == ["attempt 1 rank 0 sum 2", "attempt 1 rank 1 sum 2"], p.stdout
