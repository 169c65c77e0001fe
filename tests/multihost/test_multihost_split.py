"""comm.split across hosts (network namespaces, netns.py): on 2 hosts x 2
ranks (ranks 0, 1 on host 0; 2, 3 on host 1), a color per host, colors that
cross hosts ({0, 2} and {1, 3}), a 3-way split whose middle color crosses
hosts with its first rank on host 1, and an uneven color over 3 ranks; each
new communicator runs every collective and point-to-point messages, over
shared memory within a host and TCP between hosts (its own listening
addresses, its handshakes carrying its own id). A failure on one rank of a
color raises on every rank of that color, naming it, while the other colors
and the parent go on. Then strategies.parallel_dims.ParallelDims(dp=2, tp=2): TP
within a host, DP across hosts, each checked against torch."""

from __future__ import annotations

import os
import socket
import time

import attacker
import netns
import pytest
import test_batch_p2p as bp
import test_ddp as td
import test_tensor_parallel as ttp
import torch
from multihost_jobs import run_on_hosts
from test_multihost_faults import _address

import pycollectives as pc
from pycollectives.strategies.parallel_dims import ParallelDims

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

LAYOUT = [0, 0, 1, 1]  # rank r on host LAYOUT[r]
BIG = 300_001  # floats: past the one-shot size and several slots


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def members(sub: pc.Communicator, world_rank: int) -> list[int]:
    """The parent ranks of `sub`'s members, in its rank order."""
    out = torch.empty(sub.world_size, dtype=torch.int64)
    sub.all_gather(out, torch.tensor([world_rank]))
    return out.tolist()


def check_collectives(sub: pc.Communicator, world_rank: int) -> list[str]:
    """Every collective on `sub`, small and large, and a ring of messages."""
    n, r, bad = sub.world_size, sub.rank, []
    for count in (1, 1000, BIG):
        x = torch.arange(count, dtype=torch.float32) % 13 + r
        sub.all_reduce(x)
        want = (torch.arange(count, dtype=torch.float32) % 13) * n + n * (n - 1) / 2
        if not torch.equal(x, want):
            bad.append(f"all_reduce {count}")
        g = torch.empty(n * count)
        sub.all_gather(g, torch.full((count,), float(r)))
        if not torch.equal(g, torch.arange(n).repeat_interleave(count).float()):
            bad.append(f"all_gather {count}")
        out = torch.empty(count)
        sub.reduce_scatter(out, torch.arange(n * count, dtype=torch.float32))
        if not torch.equal(out, torch.arange(r * count, (r + 1) * count).float() * n):
            bad.append(f"reduce_scatter {count}")
        b = torch.full((count,), float(r))
        sub.broadcast(b, src=n - 1)
        if not torch.equal(b, torch.full((count,), float(n - 1))):
            bad.append(f"broadcast {count}")
        bad += [f"p2p {count}: {e}" for e in bp.job_ring_shift(sub, count, torch.float32)]
    return bad


def job_splits(comm: pc.Communicator) -> dict:
    r = comm.rank
    out: dict = {}
    cases = {
        "per_host": (comm.hosts[r], 0),
        "across": (r % 2, 0),
        "three_way": ([0, 1, 1, 2][r], -r),  # {0}, {2, 1} (led by host 1's rank 2), {3}
        "uneven": (None if r == 2 else 0, -r),  # {3, 1, 0}: hosts of 1 and 2 ranks
    }
    for name, (color, key) in cases.items():
        sub = comm.split(color, key)
        comm.all_reduce(torch.ones(3))  # the parent goes on beside its child
        if sub is None:
            out[name] = None
            continue
        info = sub.net_info()
        rejected = None
        if name == "across":  # another id at the new listener: refused, the child goes on
            peer = _address(sub, 2, via=comm)  # rank 2: sub rank 1 of rank 0's color
            if r == 0:
                with socket.create_connection(peer, timeout=5) as s:
                    s.sendall(attacker.hello(os.urandom(16), 0, 1))
                    s.settimeout(5)
                    while s.recv(4096):
                        pass  # until the listener closes it
            comm.barrier()
            rejected = sub.net_info()["rejected"]
        out[name] = {
            "members": members(sub, r),
            "hosts": sub.hosts,
            "bad": check_collectives(sub, r),
            "listens": bool(info["address"]) and info["address"] != comm.net_info()["address"],
            "paths": sorted(k for k, v in sub.stats()["all_reduce"]["paths"].items() if v),
            "rejected": rejected,
            # {0, 2} and {1, 3} made every connection they expect: their ports are closed
            "still_listening": sub.net_info()["listening"],
        }
        sub.close()
    # A failure: rank 0 (the first of color 0) has a bad setting: color 0
    # ({0, 2}, across hosts) raises on both its ranks, color 1 is made.
    os.environ["PYCOLL_ALGO"] = "bogus" if r == 0 else "auto"
    try:
        sub = comm.split(r % 2)
        y = torch.ones(4)
        sub.all_reduce(y)
        out["failure"] = f"made: {y.tolist()}"
        sub.close()
    except ValueError as e:
        out["failure"] = f"ValueError: {e}"
    os.environ.pop("PYCOLL_ALGO")
    t = torch.ones(5)
    comm.all_reduce(t)
    out["parent_after"] = bool((t == comm.world_size).all())
    return out


def numbered(hosts: list[int]) -> list[int]:
    """Hosts renumbered in the order of their first rank (as Communicator.hosts)."""
    first: dict[int, int] = {}
    return [first.setdefault(h, len(first)) for h in hosts]


def test_split_across_hosts(fabric):
    out = run_on_hosts(fabric, LAYOUT, job_splits, timeout=120)
    groups = {
        "per_host": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "across": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "three_way": [[0], [2, 1], [2, 1], [3]],
        "uneven": [[3, 1, 0], [3, 1, 0], None, [3, 1, 0]],
    }
    for name, want in groups.items():
        for r, o in enumerate(out):
            got = o[name]
            if want[r] is None:
                assert got is None, (name, r, got)
                continue
            assert got["members"] == want[r] and not got["bad"], (name, r, got)
            assert got["hosts"] == numbered([LAYOUT[m] for m in want[r]]), (name, r, got)
            spans = len({LAYOUT[m] for m in want[r]}) > 1
            assert got["listens"] == spans, (name, r, got)
            if spans:
                uniform = name != "uneven"
                assert ("hierarchical" if uniform else "flat") in got["paths"], (name, r, got)
    assert out[2]["across"]["rejected"] >= 1, out[2]
    assert not any(o["across"]["still_listening"] for o in out), out
    for r, o in enumerate(out):
        assert o["parent_after"], o
        if r % 2 == 0:  # color 0: rank 0's setting refused, named on both ranks
            assert o["failure"].startswith("ValueError") and "PYCOLL_ALGO" in o["failure"], o
            if r == 2:
                assert "rank 0" in o["failure"], o
        else:
            assert o["failure"] == "made: [2.0, 2.0, 2.0, 2.0]", o


def job_mesh(comm: pc.Communicator) -> list[str]:
    """TP layers (sequence parallel, forward and every gradient) on the
    host's pair, DDP training across the hosts, each against torch."""
    bad: list[str] = []
    with ParallelDims(comm, dp=2, tp=2) as dims:
        if len(set(dims.tp_comm.hosts)) != 1 or dims.tp_comm.net_info()["address"]:
            bad.append(f"tp group spans hosts: {dims.tp_comm.hosts}")
        if dims.dp_comm.hosts != [0, 1]:
            bad.append(f"dp group is not across the hosts: {dims.dp_comm.hosts}")
        ttp.run_column(dims.tp_comm, "random", True, True, False, bad)
        ttp.run_row(dims.tp_comm, "random", True, True, bad)
        if err := td.train_and_compare(dims.dp_comm, "mlp", "adamw"):
            bad.append(f"ddp across hosts: {err}")
    return bad


def test_parallel_dims_tp_within_dp_across_hosts(fabric):
    for r, bad in enumerate(run_on_hosts(fabric, LAYOUT, job_mesh, timeout=120)):
        assert not bad, f"rank {r}: {bad}"


CONNECT_BOUND = 5.0  # s: every rank of the color raises within this of the first failure


def job_child_connect_failure(comm: pc.Communicator, bad: int) -> tuple[float, float, str, bool]:
    """Rank `bad` listens for the new communicator on loopback only
    (PYCOLL_SOCKET_IFNAME='=lo'), where the other host cannot reach it: the
    rank that should connect to it fails. Returns (when split was entered,
    when it returned or raised, what happened, whether the parent still works)."""
    if comm.rank == bad:
        os.environ["PYCOLL_SOCKET_IFNAME"] = "=lo"
    comm.barrier()
    t0 = time.time()
    try:
        sub = comm.split(0)
        what = "made"
        try:
            sub.all_reduce(torch.ones(4), timeout=30)
        except pc.PyCollectivesError as e:
            what = f"made, then all_reduce raised {type(e).__name__}: {e}"
        sub.close()
    except (pc.PyCollectivesError, ValueError) as e:
        what = f"{type(e).__name__}: {e}"
    t1 = time.time()
    os.environ.pop("PYCOLL_SOCKET_IFNAME", None)
    t = torch.ones(5)
    comm.all_reduce(t, timeout=60)  # past the child's wait for its connections, if it waits
    return t0, t1, what, bool((t == comm.world_size).all())


def test_child_connect_failure_raises_promptly_on_every_rank(fabric):
    """split across hosts where rank 0 cannot connect to rank 2 (rank 2
    listens on loopback): every rank raises within CONNECT_BOUND seconds,
    naming rank 0, and the parent goes on. (Before the fifth exchange of
    split, ranks 1 and 3 got a communicator whose first all-reduce raised,
    and rank 2 waited for rank 0's connection for the parent's whole timeout:
    20 s here, 600 s by default.)"""
    out = run_on_hosts(fabric, LAYOUT, job_child_connect_failure, 2, init_timeout=20, timeout=120)
    first = min(t1 for _, t1, _, _ in out)
    for r, (t0, t1, what, _) in enumerate(out):
        print(f"rank {r}: {t1 - t0:.2f} s in split ({t1 - first:.2f} s after the first): {what}")
    for r, (_, t1, what, parent_ok) in enumerate(out):
        # rank 0 raises its own error; the others, the error rank 0 published in the exchange
        kind = "PeerFailure: pycollectives: rank 0: " if r == 0 else "PyCollectivesError: "
        assert what.startswith(kind) and "could not connect to rank 2" in what, (r, what)
        assert r == 0 or f"rank {r}: split: rank 0 could not connect" in what, (r, what)
        assert t1 - first < CONNECT_BOUND, (r, t1 - first, what)
        assert parent_ok, r
