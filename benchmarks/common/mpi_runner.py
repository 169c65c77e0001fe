"""OpenMPI across the namespace hosts of benchmarks/multihost/multihost.py: compiles
mpi_sweep.c with mpicc and runs it with one rank per host through mpirun,
started in host 0's namespace, whose launcher reaches the other hosts with
`ip netns exec` (an rsh agent) instead of ssh; TCP only (`--mca btl tcp,self`)
on eth0."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> bool:
    """Whether mpirun and mpicc are installed."""
    return shutil.which("mpirun") is not None and shutil.which("mpicc") is not None


def version() -> str:
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    return out.split("\n")[0].split()[-1] if out else "?"


def sweep(
    fabric, colls: list[str], sizes: list[int], iters_for: Callable[[int], int]
) -> list[tuple[str, int, float]]:
    """(collective, bytes, seconds per call) for each collective and size, on
    one rank per host of `fabric`. Raises CalledProcessError if a step fails."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "mpi_sweep")
        subprocess.run(["mpicc", "-O2", "-o", exe, str(HERE / "mpi_sweep.c")], check=True)
        agent = os.path.join(tmp, "agent.sh")
        Path(agent).write_text('#!/bin/sh\nh="$1"; shift\nexec ip netns exec "$h" sh -c "$*"\n')
        os.chmod(agent, 0o755)
        hostfile = os.path.join(tmp, "hosts")
        Path(hostfile).write_text("".join(f"{h} slots=1\n" for h in fabric.hosts))
        cases = [f"{c}:{s}:{iters_for(s)}" for c in colls for s in sizes]
        cmd = ["ip", "netns", "exec", fabric.hosts[0], "mpirun", "--allow-run-as-root"]
        cmd += ["--hostfile", hostfile, "-np", str(len(fabric.hosts)), "--map-by", "node"]
        cmd += ["--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1"]
        cmd += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0"]
        cmd += ["--mca", "oob_tcp_if_include", "eth0", exe, *cases]
        print("+", " ".join(cmd), flush=True)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    rows = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in colls:
            rows.append((parts[0], int(parts[1]), float(parts[2])))
    return rows
