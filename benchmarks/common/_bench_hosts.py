"""`pycollectives-bench` across hosts made of network namespaces (tests/support/netns.py):
one bench rank process per entry of a layout, rank r started inside host layout[r]'s
namespace, met at host 0's address the torchrun way (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that the communicator finds the hosts as it
would on a cluster (shared memory within a host, TCP between). Rank 0 hands its rows back
through the launcher's file (PYCOLL_BENCH_RESULT): the same JSON as `pycollectives-bench
--json` writes. Root only (namespaces)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
import netns  # noqa: E402

from pycollectives.bench.launch import bench_command  # noqa: E402
from pycollectives.bench.specs import RESULT_ENV  # noqa: E402

__all__ = ["run_bench_hosts"]

# The bootstrap store's port on host 0, a new one per run (a closed run's may linger in
# TIME_WAIT); host 0's namespace is the fabric's own: no other process holds them.
_PORTS = itertools.count(29517)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminates these (our own) processes still running; kills those not gone in 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(procs: list[subprocess.Popen], timeout: float, layout: list[int]) -> None:
    """Returns once every rank exited with status 0; raises RuntimeError at the first that
    exits otherwise, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise RuntimeError(
                f"pycollectives-bench across hosts (layout {layout}): rank {failed[0][0]} "
                f"exited with status {failed[0][1]}"
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"pycollectives-bench across hosts (layout {layout}): no result after {timeout:g} s"
            )
        time.sleep(0.1)


def run_bench_hosts(
    fabric: netns.Fabric,
    layout: list[int],
    flags: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900.0,
) -> dict:
    """Runs `pycollectives-bench flags` on len(layout) ranks, rank r on host layout[r] of
    `fabric` (hosts numbered from 0, host 0 holding rank 0), `env` added to every rank's
    environment; returns the JSON rank 0 wrote ({"metadata", "rows"}). Raises RuntimeError
    naming the rank when one fails, and after `timeout` seconds (every rank stopped)."""
    if not layout or layout[0] != 0:
        raise ValueError(f"run_bench_hosts: layout={layout} must put rank 0 on host 0")
    if any(not 0 <= h < len(fabric.hosts) for h in layout):
        raise ValueError(
            f"run_bench_hosts: layout={layout}: the fabric has {len(fabric.hosts)} hosts"
        )
    locals_ = {h: [r for r, x in enumerate(layout) if x == h] for h in set(layout)}
    cmd = bench_command(flags)
    port = next(_PORTS)
    print(f"+ pycollectives-bench {' '.join(flags)}  (layout {layout}, {env or {}})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        procs: list[subprocess.Popen] = []
        try:
            for r, h in enumerate(layout):
                renv = dict(os.environ, **(env or {}))
                renv.update(
                    RANK=str(r),
                    WORLD_SIZE=str(len(layout)),
                    LOCAL_RANK=str(locals_[h].index(r)),
                    LOCAL_WORLD_SIZE=str(len(locals_[h])),
                    MASTER_ADDR=netns.addr(0),
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                )
                renv[RESULT_ENV] = out
                enter = functools.partial(netns.enter, fabric.hosts[h])
                procs.append(
                    subprocess.Popen(cmd, env=renv, preexec_fn=enter, stdout=subprocess.DEVNULL)
                )
            _wait(procs, timeout, layout)
        finally:
            _stop(procs)
        try:
            data = json.loads(Path(out).read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"pycollectives-bench across hosts: rank 0's rows: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise RuntimeError("pycollectives-bench across hosts: rank 0 wrote no rows")
    return data
