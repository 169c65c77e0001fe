"""Recovery across hosts (network namespaces, netns.py; docs/recovery.md): 2
hosts x 2 ranks, shared memory within each host, TCP between, the job's
TCPStore served by rank 0 on host 0. One rank killed (SIGKILL), a whole
host's ranks killed, host 1's link cut, and a second rank killed during the
recovery: the survivors agree on the same failed ranks and shrink to a
communicator whose all-reduce adds exactly their contributions; the ranks
cut off raise (fenced, or the store unreachable), never hang. Every run is
bounded."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import netns
import pytest
import spawn
import torch

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

LAYOUT = [0, 0, 1, 1]  # rank -> host
KILL = -signal.SIGKILL
NET_TIMEOUT = 2  # PYCOLL_NET_TIMEOUT: a cut link is found within it


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def _with_store(
    rank: int, world_size: int, hosts: list[str], port: int, env: dict, job, args: tuple
):
    """Rank `rank` on its host, with a communicator made by init on a TCPStore
    (rank 0 serves it on host 0) that agree/shrink use afterwards."""
    netns.enter(hosts[LAYOUT[rank]])
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = netns.addr(0)  # the interface that reaches it: eth0
    import torch.distributed as dist

    import pycollectives as pc

    store = dist.TCPStore(
        netns.addr(0),
        port,
        world_size,
        rank == 0,
        datetime.timedelta(seconds=20),
        wait_for_workers=False,
    )
    comm = pc.init(rank, world_size, store=store, timeout=20)
    return job(pc, comm, store, *args)


def _run(fabric, job, *args, expect_exit=None, env=None, timeout=120.0):
    e = {"PYCOLL_NET_TIMEOUT": str(NET_TIMEOUT), **(env or {})}
    port = spawn.free_port()  # free here; every test's namespaces are fresh of it too
    return spawn.run(
        _with_store,
        len(LAYOUT),
        fabric.hosts,
        port,
        e,
        job,
        args,
        timeout=timeout,
        expect_exit=expect_exit,
    )


def _sum_check(pc, comm, ranks: tuple[int, ...]) -> None:
    for numel in (3, 1 << 16):
        t = torch.full((numel,), float(1 << comm.parent_ranks[comm.rank]))
        comm.all_reduce(t)
        want = float(sum(1 << r for r in ranks))
        assert torch.equal(t, torch.full((numel,), want)), (t[:3], want)


def _until_error(pc, comm) -> float:
    """All-reduces until one raises; returns how long that took from now."""
    start = time.monotonic()
    with pytest.raises(pc.PyCollectivesError):
        for _ in range(1_000_000):
            comm.all_reduce(torch.ones(1 << 16))
    return time.monotonic() - start


def _finish(pc, comm, new, survivors: tuple[int, ...]) -> None:
    _sum_check(pc, new, survivors)
    new.barrier()
    comm.close()
    new.close()


def _kill_ranks(pc, comm, store, victims: tuple[int, ...]) -> dict:
    comm.barrier()
    if comm.rank in victims:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    detect = _until_error(pc, comm)
    t0 = time.monotonic()
    a = comm.agree(True)
    t1 = time.monotonic()
    new = comm.shrink()
    t2 = time.monotonic()
    survivors = tuple(r for r in range(comm.world_size) if r not in victims)
    assert a.failed == victims and a.value is True, a
    assert all(a.verdicts[v] == "died" for v in victims), a
    assert new.parent_ranks == survivors and new.failed == victims
    assert new.world_size == len(survivors) and new.rank == survivors.index(comm.rank)
    assert new.hosts == [LAYOUT[r] for r in survivors] or set(new.hosts) == {0}
    _finish(pc, comm, new, survivors)
    return {"detect": detect, "agree": t1 - t0, "shrink": t2 - t1}


def test_one_rank_killed_survivors_shrink_across_hosts(fabric):
    out = _run(fabric, _kill_ranks, (3,), expect_exit={3: KILL})
    for t in out[:3]:
        assert t["agree"] < 5.0 and t["shrink"] < 15.0, out


def test_a_hosts_ranks_killed_survivors_shrink_to_one_host(fabric):
    out = _run(fabric, _kill_ranks, (2, 3), expect_exit={2: KILL, 3: KILL})
    for t in out[:2]:
        assert t["agree"] < 5.0 and t["shrink"] < 15.0, out


def _cut(pc, comm, store, marker: str) -> tuple:
    comm.barrier()
    open(f"{marker}.{comm.rank}", "w").close()
    detect = _until_error(pc, comm)
    if comm.rank >= 2:  # cut off from the store's host: raises, bounded
        start = time.monotonic()
        with pytest.raises(pc.PyCollectivesError) as e:
            comm.shrink(timeout=5)
        comm.close()
        return ("cut", str(e.value), time.monotonic() - start)
    new = comm.shrink(timeout=5)
    assert new.parent_ranks == (0, 1) and new.failed == (2, 3), (new.parent_ranks, new.failed)
    assert new._c.default_timeout == 20  # the parent's (init's), not shrink's bound
    _finish(pc, comm, new, (0, 1))
    return ("survived", detect, "")


def test_link_cut_host_with_the_store_goes_on(fabric, tmp_path):
    marker = str(tmp_path / "up")
    out: list = []

    def cut():
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in range(4)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(0.3)
        fabric.link(1, False)

    th = threading.Thread(target=cut)
    th.start()
    try:
        out = _run(fabric, _cut, marker, timeout=120)
    finally:
        th.join()
        fabric.link(1, True)
    assert [o[0] for o in out] == ["survived"] * 2 + ["cut"] * 2, out
    for o in out[2:]:  # the store out of reach, or fenced: within the bounds, not a hang
        assert o[2] < 60 and ("store failed" in o[1] or "fenced" in o[1]), out


def _second_death(pc, comm, store, where: str) -> tuple:
    """Rank 3 dies in an all-reduce; rank 2 at `where` in the survivors' shrink."""
    from pycollectives import _recovery_hosts

    if comm.rank == 2:
        if where == "adopted":  # once the first agreement of shrink decided it alive
            agree = _recovery_hosts.agree

            def then_die(*a):
                out = agree(*a)
                os.kill(os.getpid(), signal.SIGKILL)
                return out

            _recovery_hosts.agree = then_die
        else:  # in the middle of building the new communicator

            def die(*a, **k):
                os.kill(os.getpid(), signal.SIGKILL)

            _recovery_hosts._RENDEZVOUS["init"] = die
    comm.barrier()
    if comm.rank == 3:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    _until_error(pc, comm)
    new = comm.shrink(timeout=5)
    out = (new.parent_ranks, new.failed)
    _finish(pc, comm, new, (0, 1))
    return out


@pytest.mark.parametrize("where", ["adopted", "building"])
def test_second_death_during_recovery_across_hosts(fabric, where):
    out = _run(fabric, _second_death, where, expect_exit={2: KILL, 3: KILL})
    assert out[:2] == [((0, 1), (2, 3))] * 2, out


def _stopped(pc, comm, store) -> str:
    """Rank 3 (host 1) stops inside an all-reduce past the timeout; the others
    shrink without it; it resumes (SIGCONT from rank 0) into a communicator
    it was fenced out of."""
    from test_faults import expect

    pids = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.all_gather(pids, torch.tensor([os.getpid()]))
    comm.barrier()
    if comm.rank == 3:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
        with pytest.raises(pc.PyCollectivesError):
            for _ in range(1_000_000):
                comm.all_reduce(torch.ones(1 << 12), timeout=2)
        msg = expect(pc.CommunicatorAborted, lambda: comm.shrink(timeout=3), "fenced")
        expect(pc.CommunicatorAborted, lambda: comm.agree(True), "fenced")
        expect(pc.PyCollectivesError, lambda: comm.all_reduce(torch.ones(4)))
        store.set("test/fenced", "1")
        comm.close()
        return msg
    with pytest.raises(pc.PyCollectivesError):
        for _ in range(1_000_000):
            comm.all_reduce(torch.ones(1 << 12), timeout=2)
    new = comm.shrink(timeout=3)
    assert new.parent_ranks == (0, 1, 2) and new.failed == (3,), (new.parent_ranks, new.failed)
    if comm.rank == 0:
        os.kill(int(pids[3]), signal.SIGCONT)
        store.wait(["test/fenced"], datetime.timedelta(seconds=30))  # it is done with the store
    _finish(pc, comm, new, (0, 1, 2))
    return ""


def test_stopped_rank_on_another_host_is_fenced_out(fabric):
    out = _run(fabric, _stopped, env={"PYCOLL_CMA": "0"})
    assert "unresponsive" in out[3] or "died" in out[3], out


def _no_store(comm) -> None:
    """pc.init's own store is gone once the communicator is made: agree and
    shrink ask for one; a split communicator is not recoverable by itself."""
    from test_faults import expect

    import pycollectives as pc

    expect(ValueError, lambda: comm.agree(True), f"rank {comm.rank}", "agree", "store=")
    expect(ValueError, lambda: comm.shrink(), f"rank {comm.rank}", "shrink", "store=")
    sub = comm.split(0, comm.rank)
    expect(ValueError, lambda: sub.agree(True), "split")
    sub.close()
    assert isinstance(comm, pc.Communicator)


def test_recovery_across_hosts_needs_a_store(fabric):
    from multihost_jobs import run_on_hosts

    run_on_hosts(fabric, LAYOUT, _no_store, timeout=90)
