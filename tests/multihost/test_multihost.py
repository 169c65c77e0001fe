"""Ranks on several hosts: network namespaces joined by veth pairs on a bridge
(netns.py), each namespace a host with its own ranks, shared memory within a
host and TCP between hosts. The core's correctness jobs (every collective,
dtype, op and size, point-to-point, batch_p2p, receives from any source) and the DDP job run unchanged
on 2 hosts x 2 ranks (interleaved: rank r on host r % 2), 3 hosts x 1 and
2 hosts x 3 (contiguous); the flat ring (PYCOLL_ALGO=ring) and IPv6 on hosts
of 2 and 1 ranks. Every rank listens on its host's eth0 (the interface that
reaches MASTER_ADDR, or the one PYCOLL_SOCKET_IFNAME names).
Failures across hosts: test_multihost_faults.py."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import netns
import paths
import pytest
import test_batch_p2p as bp
import test_collectives as tc
import test_ddp as td
import test_recv_any as ra
import torch
from multihost_jobs import run_on_hosts
from spawn import free_port

import pycollectives as pc

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

ROOT = paths.ROOT
SIZES = (0, 1, 7, 1000, 3 * 65536 + 5)
LAYOUTS = {
    "2x2": [0, 1, 0, 1],
    "3x1": [0, 1, 2],
    "2x3": [0, 0, 0, 1, 1, 1],
}


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(3) as f:
        yield f


def job_everything(comm: pc.Communicator, ddp: bool) -> list[str]:
    """Every correctness job of the one-host suite (every dtype and op, sizes
    SIZES: the largest crosses several slots and takes the large-message
    schedules), and DDP training on two models; the paths the collectives took."""
    bad = []
    cases = tc._cases
    tc._cases = functools.partial(cases, sizes=SIZES)  # the jobs look it up when they run
    try:
        for job in tc.JOBS:
            bad += job(comm)
    finally:
        tc._cases = cases
    for count in (0, 7, 300_001):
        bad += bp.job_ring_shift(comm, count, torch.float32)
        bad += bp.job_batches_against_other_groupings(comm, count)
    bad += ra.job_any_source_order_and_mixing(comm)
    if ddp:
        for kind, opt, kw in [
            ("mlp", "sgd", {"bucket_cap_mb": 1e-3}),
            ("transformer", "adamw", {}),
        ]:
            if err := td.train_and_compare(comm, kind, opt, **kw):
                bad.append(f"ddp {kind}/{opt}: {err}")
    info = comm.net_info()
    v6 = info["address"].startswith("[")
    want = netns.addr(comm.hosts[comm.rank], v6)
    if info["interface"] != "eth0" or info["address"].rsplit(":", 1)[0].strip("[]") != want:
        bad.append(f"listens on {info}, not on its host's eth0 ({want})")
    paths = comm.stats()["all_reduce"]["paths"]
    return bad + [f"paths {sorted(k for k, v in paths.items() if v)}"]


def _check(results: list[list[str]], want_path: str) -> None:
    bad = [f"rank {r}: {x}" for r, lines in enumerate(results) for x in lines[:-1]]
    assert not bad, "\n".join(bad[:20])
    for lines in results:
        assert want_path in lines[-1], lines[-1]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_across_hosts(fabric, name):
    layout = LAYOUTS[name]
    results = run_on_hosts(fabric, layout, job_everything, name == "2x2", timeout=240)
    _check(results, "hierarchical")


def test_flat_ring_ipv6_uneven_hosts(fabric):
    """PYCOLL_ALGO=ring over hosts of 2 and 1 ranks (the flat ring, shared
    memory and TCP links in one ring), over IPv6 on the interface
    PYCOLL_SOCKET_IFNAME names."""
    env = {"PYCOLL_ALGO": "ring", "PYCOLL_SOCKET_FAMILY": "AF_INET6", "PYCOLL_SOCKET_IFNAME": "eth"}
    results = run_on_hosts(fabric, [0, 1, 0], job_everything, False, env=env, timeout=240)
    _check(results, "flat")


def test_readme_two_host_torchrun_line(fabric):
    """The README's launch line for two hosts: one torchrun per host
    (namespace), --nnodes 2 --node-rank i --master-addr <host 0>, running
    examples/ddp_train.py (which checks that every rank ends with the same
    parameters)."""
    port = str(free_port())
    procs = []
    for node in range(2):
        cmd = ["ip", "netns", "exec", fabric.hosts[node], sys.executable, "-m",
               "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", netns.addr(0), "--master-port", port,
               "examples/ddp_train.py"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "".join(outs).count("parameters identical on all ranks: True") == 4, outs
