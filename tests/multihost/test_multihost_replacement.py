"""A replacement process takes a lost rank's place across hosts (network
namespaces, netns.py; strategies/parallel3d/replacement.py, docs/recovery.md):
ElasticTrainer3D's tp=2 x pp=2 grid of test_replacement.py's tiny GPT over 2
hosts, the job's TCPStore served by rank 0 on host 0. Ranks 0, 1 (stage 0's
tensor-parallel pair) on host 0, ranks 2, 3 (stage 1's) on host 1: each
pipeline pair spans the hosts, and every rank's buddy copy is on the other
host (BuddyCopy's "auto" placement: 0 <-> 2, 1 <-> 3).

- rank 3 SIGKILLed in the forward of step AT; a newcomer started on host 1
  once it died joins, receives rank 3's stage shard and AdamW state from rank
  1's copy, every rank redoes step AT;
- host 1's two ranks SIGKILLed at once (rank 3 kills rank 2 and itself);
  two newcomers, on host 1 (the host restarted) or on host 0, receive the
  lost ranks' copies from host 0's ranks;
- host 1's link cut in the forward of step AT (rank 3 pulls its own
  cable): host 0's ranks, with the store, take in two newcomers started on
  host 0; host 1's ranks raise within a bound (the store out of reach, or
  fenced), never hang;

and in each every grid rank's parameters and loss equal, bit for bit, those
of an uninterrupted run of the same grid on the same hosts. Then rank 0
alone on host 0, ranks 1-3 on host 1 (no placement can put three ranks'
copies on another host: buddies 0->3, 1->0, 2->1, 3->2), host 1's ranks
killed, three newcomers on host 1: with dp=1 the state of ranks 2 and 3 is
lost (their buddies were on host 1, and no replica), and rank 0 and the
newcomers raise ReplacementFailed naming them, within seconds and before
anyone waits for a newcomer; with dp=2 x tp=2 (zero=0) every lost rank's
state is still on rank 0 (its buddy copy of rank 1, its own as rank 2's
replica, and rank 1's copy again for rank 3, rank 1's replica) and the run
matches the uninterrupted one bit for bit. Every run is bounded."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from typing import Any

import netns
import pytest
import spawn
import torch

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

STEPS, AT = 5, 2  # rank 3 goes down in step AT; with copies every step, AT is redone
GRID = {"dp": 1, "tp": 2, "pp": 2}
LAYOUT = [0, 0, 1, 1]  # grid rank -> host
KILL = -signal.SIGKILL
NET = {"kill": "10", "cut": "3"}  # PYCOLL_NET_TIMEOUT (test_multihost_buddies.py: why 10)
WORLD_TIMEOUT = 20.0  # the world communicator's: the agreements, the shrink, the wait for newcomers


def _config() -> tuple[Any, Any]:
    from pycollectives.strategies.models import GPTConfig
    from pycollectives.strategies.parallel3d import TrainOptions

    config = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, d_model=16, seed=5)
    opts = TrainOptions(microbatches=2, global_batch=8, dtype=torch.float64, timeout=60)
    return config, opts


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def _params(trainer: Any) -> dict[str, list[float]]:
    """float64 to float is exact: bitwise comparable after the process exits."""
    return {n: p.detach().reshape(-1).tolist() for n, p in trainer.named_params}


def _enter(host: str, net: str) -> None:
    netns.enter(host)
    os.environ["MASTER_ADDR"] = netns.addr(0)  # the interface that reaches the store: eth0
    os.environ["PYCOLL_NET_TIMEOUT"] = net


def _store(proc: int, port: int) -> Any:
    import torch.distributed as dist

    t = datetime.timedelta(seconds=60)
    return dist.TCPStore(netns.addr(0), port, None, proc == 0, t, wait_for_workers=False)


# -- the uninterrupted run ---------------------------------------------------------


def _reference(
    rank: int, world_size: int, hosts: list[str], port: int, grid: dict, layout: list[int]
) -> Any:
    import pycollectives as pc
    from pycollectives.strategies.parallel3d import Trainer3D
    from pycollectives.strategies.parallel_dims import ParallelDims

    _enter(hosts[layout[rank]], NET["kill"])
    config, opts = _config()
    comm = pc.init(rank, 4, store=_store(rank, port), timeout=WORLD_TIMEOUT)
    with ParallelDims(comm, **grid) as dims:
        trainer = Trainer3D(dims, config, opts)
        start = _params(trainer)
        losses = [trainer.step().loss for _ in range(STEPS)]
        out = (_params(trainer), losses[-1], start)
    comm.close()
    return out


@pytest.fixture(scope="module")
def reference(fabric) -> list[Any]:
    """Each grid rank's parameters, last loss and first parameters, run once."""
    return spawn.run(_reference, 4, fabric.hosts, spawn.free_port(), GRID, LAYOUT, timeout=180)


# -- the jobs ------------------------------------------------------------------------


def _down(how: str, marks: str, switch: str, victims: tuple[int, ...]) -> None:
    """What befalls host 1 from rank 3 (in its forward of step AT): "rank" (it
    dies), "host" (`victims` die: their pids from the marks folder, then rank
    3), "cut" (host 1's cable is pulled; the ranks live on). Writes the time
    first: the newcomers start then."""
    with open(f"{marks}/down_at.tmp", "w") as f:
        f.write(repr(time.time()))
    os.rename(f"{marks}/down_at.tmp", f"{marks}/down_at")
    if how == "cut":
        subprocess.run(["ip", "-n", switch, "link", "set", "p1", "down"], check=True, timeout=20)
        return
    for r in victims:
        if r != 3:
            with open(f"{marks}/pid.{r}") as f:
                os.kill(int(f.read()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _await(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def _proc(
    proc: int, nprocs: int, hosts: list[str], on: list[int], port: int, how: str, marks: str,
    switch: str, victims: tuple[int, ...], grid: dict,
) -> dict[str, Any]:  # fmt: skip
    """Process `proc` on host hosts[on[proc]]: grid rank `proc` below 4, else a
    newcomer, which joins once host 1 went down (started after the failure,
    as a scheduler would). Returns what it trained, or, cut off or refused,
    what it raised and how long after the failure."""
    import pycollectives as pc
    from pycollectives.strategies.models.gpt import Block
    from pycollectives.strategies.parallel3d import ElasticTrainer3D, ReplacementFailed
    from pycollectives.strategies.parallel_dims import ParallelDims

    _enter(hosts[on[proc]], NET["cut" if how == "cut" else "kill"])
    cut = (2, 3) if how == "cut" else ()
    reach = tuple(p for p in range(1, nprocs) if p not in victims and p not in cut)
    config, opts = _config()
    store = _store(proc, port)
    with open(f"{marks}/pid.{proc}", "w") as f:
        f.write(str(os.getpid()))
    committed: list[int] = []
    try:
        if proc >= 4:
            _await(f"{marks}/down_at", 120)
            et = ElasticTrainer3D.join(store, config, opts, timeout=120, **grid)
        else:
            comm = pc.init(proc, 4, store=store, timeout=WORLD_TIMEOUT)
            et = ElasticTrainer3D(ParallelDims(comm, **grid), config, opts, store)
            if proc == 3:
                block = [b for b in et.trainer.stages[0].blocks if isinstance(b, Block)][-1]
                due = lambda: et.steps == AT and not et.recoveries  # noqa: E731
                block.register_forward_pre_hook(
                    lambda m, a: _down(how, marks, switch, victims) if due() else None
                )
        while et.steps < STEPS:
            s = et.steps
            if et.step():
                committed.append(s)
    except (pc.PyCollectivesError, ReplacementFailed) as e:
        with open(f"{marks}/down_at") as f:
            after = time.time() - float(f.read())
        out = {"raised": f"{type(e).__name__}: {e}", "failed": getattr(e, "failed", None),
               "after_s": after, "committed": committed}  # fmt: skip
        return _done(store, proc, reach, out)
    recoveries = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in et.recoveries]
    took = [r["agree_s"] + r["replace_s"] + r["restore_s"] for r in et.recoveries]
    out = {"rank": et.dims.world.rank, "params": _params(et.trainer), "loss": et.last.loss,
           "recoveries": recoveries, "took_s": took, "committed": committed,
           "hosts": et.dims.world.hosts}  # fmt: skip
    et.close()
    return _done(store, proc, reach, out)


def _done(store: Any, proc: int, reach: tuple[int, ...], out: dict[str, Any]) -> dict[str, Any]:
    """Process 0 serves the store: it stays until every other process in
    `reach` (those that live on and reach it) is done with it."""
    if proc == 0:
        store.wait([f"done/{p}" for p in reach], datetime.timedelta(seconds=60))
    elif proc in reach:
        store.set(f"done/{proc}", "1")
    return out


def _run(
    fabric, on: list[int], how: str, marks: str, victims: tuple[int, ...], grid: dict = GRID, **kw
) -> list:
    return spawn.run(
        _proc, len(on), fabric.hosts, on, spawn.free_port(), how, marks, fabric.switch, victims,
        grid, **kw,
    )  # fmt: skip


def _check_matches(
    got: dict[int, dict], reference: list[Any], lost: tuple[int, ...], sources: dict | None = None
) -> None:
    """Every grid rank trained to the uninterrupted run's parameters and loss,
    bit for bit; the survivors redid step AT once, with each lost rank's state
    from `sources` (default: its buddy on host 0, rank r - 2)."""
    assert sorted(got) == [0, 1, 2, 3], sorted(got)
    for w, g in got.items():
        want, want_loss, start = reference[w]
        assert g["params"].keys() == want.keys(), w
        for name in want:
            assert g["params"][name] == want[name], (w, name)
        assert g["loss"] == want_loss and g["params"] != start, (w, g["loss"], want_loss)
        if w in lost:  # a newcomer: joined at the step rolled back to
            assert g["recoveries"] == [] and g["committed"] == list(range(AT, STEPS)), g
            continue
        assert g["committed"] == list(range(STEPS)), g  # AT failed once, then counted
        [rec] = g["recoveries"]
        assert rec["failed"] == lost and rec["step"] == AT and rec["rolled_back_to"] == AT, rec
        assert rec["sources"] == (sources or {r: (r - 2, "remote") for r in lost}), rec


def _say(what: str, got: dict[int, dict], lost: tuple[int, ...], wall: float) -> None:
    took = max(t for w, g in got.items() if w not in lost for t in g["took_s"])
    load = os.getloadavg()[0]
    print(
        f"\n{what}: recovered in {took:.2f} s (slowest survivor); run {wall:.1f} s; load {load:.1f}"
    )


# -- the tests ---------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_killed_rank_is_replaced_on_its_host_bitwise(fabric, reference, tmp_path):
    start = time.monotonic()
    out = _run(
        fabric, LAYOUT + [1], "rank", str(tmp_path), (3,), expect_exit={3: KILL}, timeout=240
    )
    got = {g["rank"]: g for p, g in enumerate(out) if p != 3}
    _check_matches(got, reference, (3,))
    assert got[3] is out[4], "the newcomer took rank 3's place"
    assert got[0]["hosts"] == [0, 0, 1, 1], got[0]["hosts"]  # the newcomer is on host 1
    _say("rank 3 killed, replaced on host 1", got, (3,), time.monotonic() - start)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("newcomers_on", [1, 0], ids=["on-host1-restarted", "on-host0"])
def test_a_killed_hosts_ranks_are_replaced_from_the_other_hosts_copies_bitwise(
    fabric, reference, tmp_path, newcomers_on
):
    start = time.monotonic()
    on = LAYOUT + [newcomers_on] * 2
    dead = {2: KILL, 3: KILL}
    out = _run(fabric, on, "host", str(tmp_path), (2, 3), expect_exit=dead, timeout=240)
    got = {g["rank"]: g for p, g in enumerate(out) if p not in dead}
    _check_matches(got, reference, (2, 3))
    assert {id(got[2]), id(got[3])} == {id(out[4]), id(out[5])}, "the newcomers took 2 and 3"
    assert got[0]["hosts"] == [0, 0, newcomers_on, newcomers_on], got[0]["hosts"]
    _say(
        f"host 1's ranks killed, replaced on host {newcomers_on}",
        got,
        (2, 3),
        time.monotonic() - start,
    )


@pytest.mark.timeout(300)
def test_a_cut_link_host_0_takes_in_newcomers_and_host_1_raises_bounded(
    fabric, reference, tmp_path
):
    start = time.monotonic()
    try:
        out = _run(fabric, LAYOUT + [0, 0], "cut", str(tmp_path), (), timeout=240)
    finally:
        fabric.link(1, True)
    for r in (2, 3):  # cut off from the store's host: raised, within the store's bound
        g = out[r]
        assert "raised" in g, g
        assert "store failed" in g["raised"] or "fenced" in g["raised"], g
        assert g["after_s"] < 2 * WORLD_TIMEOUT + 10, g
        assert g["committed"] == list(range(AT)), g
    got = {g["rank"]: g for p, g in enumerate(out) if p not in (2, 3)}
    _check_matches(got, reference, (2, 3))
    assert got[0]["hosts"] == [0, 0, 0, 0], got[0]["hosts"]
    print(f"\nhost 1 cut off: its ranks raised {out[2]['after_s']:.1f} s, {out[3]['after_s']:.1f} s "
          "after the cut")  # fmt: skip
    _say("host 1 cut off, replaced on host 0", got, (2, 3), time.monotonic() - start)


@pytest.mark.timeout(300)
def test_a_lost_hosts_state_lost_with_it_fails_every_process_naming_the_ranks(fabric, tmp_path):
    """Rank 0 on host 0, ranks 1-3 on host 1: buddies 0->3, 1->0, 2->1, 3->2 (no
    placement can put three ranks' copies on one other rank's host)."""
    on = [0, 1, 1, 1, 1, 1, 1]
    dead = {1: KILL, 2: KILL, 3: KILL}
    out = _run(fabric, on, "host", str(tmp_path), (1, 2, 3), expect_exit=dead, timeout=240)
    for p in (0, 4, 5, 6):  # rank 0 and the newcomers
        g = out[p]
        assert "raised" in g and g["raised"].startswith("ReplacementFailed: "), (p, g)
        assert g["failed"] == (1, 2, 3), (p, g)
        for lost, buddy in ((2, "rank 1 (dp=0, tp=1, pp=0)"), (3, "rank 2 (dp=0, tp=0, pp=1)")):
            where = f"rank {lost} (dp=0, tp={lost % 2}, pp=1)"
            assert f"the state of {where} is lost: its buddy {buddy}" in g["raised"], (p, g)
        assert "the state of rank 1 " not in g["raised"], (p, g)  # its buddy, rank 0, lives
        assert g["after_s"] < WORLD_TIMEOUT, (p, g)  # nobody waited for a newcomer
    assert out[0]["committed"] == list(range(AT)), out[0]


DP_GRID = {"dp": 2, "tp": 2, "pp": 1}
ONE_AND_THREE = [0, 1, 1, 1]  # rank 0 alone on host 0


@pytest.mark.timeout(300)
def test_a_lost_hosts_state_comes_from_dp_replicas_and_their_buddies_bitwise(fabric, tmp_path):
    """dp=2 x tp=2 (zero=0: the dp replicas 0, 2 and 1, 3 hold the same state),
    rank 0 alone on host 0 (buddies 0->3, 1->0, 2->1, 3->2): host 1's ranks
    killed, three newcomers on host 1. Rank 1's state comes from its buddy's
    copy (rank 0's), rank 2's from its replica's own (rank 0's), and rank
    3's, whose buddy and replica are both lost, from the copy of its replica
    (rank 1) that rank 0 holds: all from host 0's one rank."""
    start = time.monotonic()
    want = spawn.run(
        _reference, 4, fabric.hosts, spawn.free_port(), DP_GRID, ONE_AND_THREE, timeout=180
    )
    dead = {1: KILL, 2: KILL, 3: KILL}
    on = ONE_AND_THREE + [1, 1, 1]
    out = _run(fabric, on, "host", str(tmp_path), (1, 2, 3), DP_GRID, expect_exit=dead, timeout=240)
    got = {g["rank"]: g for p, g in enumerate(out) if p not in dead}
    froms = {1: (0, "remote"), 2: (0, "local"), 3: (0, "remote")}
    _check_matches(got, want, (1, 2, 3), froms)
    assert got[0]["hosts"] == [0, 1, 1, 1], got[0]["hosts"]
    _say("dp=2 x tp=2, host 1's 3 ranks killed", got, (1, 2, 3), time.monotonic() - start)
