"""The strategies' recovery across hosts (network namespaces, netns.py;
docs/recovery.md): 2 hosts x 2 ranks (0, 1 on host 0, which serves the job's
TCPStore; 2, 3 on host 1), shared memory within a host, TCP between, the
agreements and the shrink through the store (pycollectives/_recovery_hosts.py).

- ElasticDataParallel, rank 3 SIGKILLed mid-backward of step K: the 3
  survivors (two hosts still) drop step K, shrink and go on.
- ElasticDataParallel, host 1's ranks SIGKILLed at once (rank 3 kills rank 2
  and itself mid-backward: the host's power goes off): host 0 goes on alone.
- ElasticDataParallel, host 1's link cut mid-backward (rank 3 downs its own
  cable): host 0, with the store, goes on; host 1's ranks raise within a
  bound, never hang.
- ElasticZero (ZeRO-3, buddy copies every step), rank 3 SIGKILLed
  mid-backward: the survivors rebuild its shard from its buddy's copy (rank
  1's: each rank's buddy is on the other host; test_multihost_buddies.py
  loses a whole host).

The survivors' parameters equal, bit for bit, a reference made by the
one-host tests' own jobs (test_elastic.py, test_elastic_sharded.py), run on
the same hosts without a failure: trained on the 4 ranks up to the dropped
step, then on the survivors' layout (a split) from there. The ElasticSampler
ledger, the same on every survivor, holds every sample of epoch 0 exactly
once, and each survivor fed exactly its shares. Each run also measures the
recovery's parts (detection, agreement, shrink, rebuild) for docs/recovery.md.

Last, `examples/train_gpt.py --survive` started as 4 rank processes, 2 per
host, from the rendezvous variables torchrun would set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): host 1's two processes SIGKILLed from outside,
host 0's train to the end and print the recovery line. Every run is bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import netns
import pytest
import spawn
import test_elastic as te
import test_elastic_sharded as tes
import test_multihost_recovery as mr
import torch
from zero_common import OPT

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

LAYOUT = mr.LAYOUT  # rank -> host: [0, 0, 1, 1]
KILL = -signal.SIGKILL
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO_AT = 3  # ElasticZero: rank 3 dies in the step after 3 committed (test_elastic_sharded's)


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


# -- running the jobs on the hosts -----------------------------------------------


def _plain(
    rank: int, world_size: int, hosts: list[str], job: Any, args: tuple, net: float = mr.NET_TIMEOUT
) -> Any:
    """job(rank, world_size, *args) on rank's host: a one-host test's job, whose
    pc.init() finds rank 0's store on host 0 (MASTER_ADDR) the torchrun way."""
    netns.enter(hosts[LAYOUT[rank]])
    os.environ["MASTER_ADDR"] = netns.addr(0)
    os.environ["PYCOLL_NET_TIMEOUT"] = str(net)
    return job(rank, world_size, *args)


def _on_hosts(
    fabric: netns.Fabric, job: Any, *args: Any, timeout: float = 240.0, net: float = mr.NET_TIMEOUT
) -> list[Any]:
    return spawn.run(_plain, len(LAYOUT), fabric.hosts, job, args, net, timeout=timeout)


def _down(how: str, marks: str, switch: str = "") -> None:
    """What befalls host 1 from rank 3, in the middle of its backward: "rank"
    (rank 3 dies), "host" (rank 2 and rank 3 die at once), "cut" (host 1's
    cable is pulled; the ranks live on). Writes the wall-clock time first."""
    with open(f"{marks}/down_at", "w") as f:
        f.write(repr(time.time()))
    if how == "cut":
        subprocess.run(
            ["ip", "-n", switch, "link", "set", "p1", "down"], check=True, timeout=20
        )  # fabric.link(1, False), from inside
        return
    if how == "host":
        with open(f"{marks}/pid.2") as f:
            os.kill(int(f.read()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _down_at(marks: str) -> float:
    with open(f"{marks}/down_at") as f:
        return float(f.read())


def _parts(recovery: dict, ended: float, down_at: float) -> dict[str, float]:
    """A recovery's parts in seconds: detection (from the failure to the
    survivor entering the agreement: the failed step's collectives raising),
    the agreement, the shrink and the rebuild (with the new wrapper; the
    record's shrink_s holds both: the whole recovery after the agreement)."""
    agree, whole = recovery["agree_s"], recovery["shrink_s"]
    rebuild = recovery.get("rebuild_s", 0.0)
    return {
        "detect": ended - agree - whole - down_at,
        "agree": agree,
        "shrink": whole - rebuild,
        "rebuild": rebuild,
    }


# -- ElasticDataParallel -----------------------------------------------------------


def _ddp_job(pc: Any, comm: Any, store: Any, how: str, marks: str, switch: str) -> dict:
    """test_elastic's training (its model, data, loss, sampler, DDP buckets)
    under ElasticDataParallel on the store's communicator; rank 3 brings host 1
    down `how` mid-backward of step K (test_elastic's "backward" point: a
    tensor hook, before the gradient reaches DDP's bucket)."""
    from pycollectives.strategies.data import ElasticSampler
    from pycollectives.strategies.data_parallel import ElasticDataParallel

    rank = comm.rank
    with open(f"{marks}/pid.{rank}", "w") as f:
        f.write(str(os.getpid()))
    comm.barrier()  # every pid is written
    m, opt = te._model()
    sampler = ElasticSampler(te.NUM, local_batch_size=te.LOCAL)
    model = ElasticDataParallel(m, comm, sampler=sampler, **te.DDP)
    if rank == 3:
        fired: list[bool] = []

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if model.steps == te.K and not fired:
                fired.append(True)
                _down(how, marks, switch)
            return grad

        m[0].weight.register_hook(hook)
    fed: list[list[int]] = []  # the ids this rank fed, per committed step
    ended: list[float] = []  # when each recovery was over (wall clock)

    def loss_fn(ddp: torch.nn.Module, r: int, n: int) -> torch.Tensor:
        ids = sampler.ids(r, n)
        fed.append(ids.tolist())
        return te._loss(ddp, ids, sampler.scale(n))

    agreed_at: list[float] = []  # when this rank entered the latest agreement
    agree = comm.agree

    def timed_agree(*args: Any, **kwargs: Any) -> Any:
        agreed_at[:] = [time.time()]
        return agree(*args, **kwargs)

    comm.agree = timed_agree  # the step's agreement on the first communicator
    start = time.monotonic()
    try:
        while model.steps < te.STEPS:
            if not model.step(loss_fn, opt):
                ended.append(time.time())
                fed.pop()  # dropped: not consumed
    except pc.PyCollectivesError as e:  # cut off from the store's host
        if how != "cut" or LAYOUT[rank] != 1:
            raise
        down_at = _down_at(marks)
        took = time.time() - down_at
        model.comm.close()
        detect = agreed_at[0] - down_at if agreed_at and agreed_at[0] > down_at else None
        return {"raised": f"{type(e).__name__}: {e}", "after_cut_s": took, "detect_s": detect}
    down_at = _down_at(marks)
    out = {
        "params": te._params(m),
        "world_size": model.world_size,
        "recoveries": [(r["step"], r["failed"], r["world_size"]) for r in model.recoveries],
        "parts": [_parts(r, t, down_at) for r, t in zip(model.recoveries, ended, strict=True)],
        "ledger": [(e.epoch, e.step, [s.tolist() for s in e.shares]) for e in sampler.ledger],
        "fed": fed,
        "run_s": time.monotonic() - start,
    }
    model.comm.close()
    return out


@pytest.fixture(scope="module")
def ddp_reference(fabric) -> list[dict]:
    """test_elastic's reference job on these hosts: 4 ranks up to step K, then
    the first 3 (two hosts) or the first 2 (host 0) from step K."""
    return _on_hosts(fabric, te._reference, [(te.K, 3), (te.K, 2)])


CASES = {  # how host 1 goes down: (survivors, expected exits)
    "rank": (3, {3: KILL}),
    "host": (2, {2: KILL, 3: KILL}),
    "cut": (2, {}),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", list(CASES))
def test_elastic_data_parallel_across_hosts_matches_the_surviving_layout_bitwise(
    fabric, ddp_reference, tmp_path, how
):
    n, expect = CASES[how]
    try:
        got = mr._run(
            fabric, _ddp_job, how, str(tmp_path), fabric.switch, expect_exit=expect, timeout=240
        )
    finally:
        fabric.link(1, True)
    dead = tuple(range(n, 4))
    if how == "cut":  # host 1's ranks raised, within the store's bound: no hang
        for r in dead:
            assert "store failed" in got[r]["raised"] or "fenced" in got[r]["raised"], got[r]
            # One store call's bound (the timeout, 20 s, + 5) after the step failed, not
            # two: a call after one that timed out raises at once (HostRecovery.call).
            assert got[r]["after_cut_s"] < 40, got[r]
        said = "; ".join(
            f"rank {r}: its step failed {got[r]['detect_s']:.1f} s after the cut, it raised "
            f"{got[r]['after_cut_s']:.1f} s after it"
            for r in dead
            if got[r]["detect_s"] is not None
        )
        print(f"\nhost 1 cut off: {said}")
    got = got[:n]
    for r, g in enumerate(got):  # every survivor dropped step K, saw the same ranks go
        assert g["world_size"] == n and g["recoveries"] == [(te.K, dead, n)], (r, g)
        assert g["params"] == ddp_reference[r][te.K, n], (how, r)
    assert got[0]["params"] != te._params(te._model()[0])  # it trained

    # The ledger: alike on every survivor; the steps before K on 4 ranks, the rest
    # on the survivors; epoch 0's samples each consumed exactly once, epoch 1's at
    # most once; each survivor fed exactly its shares.
    ledger = got[0]["ledger"]
    assert all(g["ledger"] == ledger for g in got)
    assert [len(shares) for _, _, shares in ledger] == [
        4 if i < te.K else n for i in range(te.STEPS)
    ]
    for epoch in (0, 1):
        ids = [i for e, _, shares in ledger if e == epoch for s in shares for i in s]
        assert len(ids) == len(set(ids)), (epoch, ids)
        if epoch == 0:
            assert sorted(ids) == list(range(te.NUM))
    assert ledger[-1][0] == 1  # the run went past the end of epoch 0
    for r, g in enumerate(got):
        assert g["fed"] == [shares[r] for _, _, shares in ledger], r
    _report(f"ElasticDataParallel, {how}", [g["parts"][0] for g in got])


# -- ElasticZero -----------------------------------------------------------------


def _zero_job(pc: Any, comm: Any, store: Any, marks: str) -> tuple:
    """test_elastic_sharded's ZeRO-3 run with buddy copies every step (its GPT,
    data and loss) on the store's communicator; rank 3 dies mid-backward of the
    step after ZERO_AT (its "zero3-k1-backward" case)."""
    from pycollectives.strategies.data_parallel import ElasticZero

    model = tes._gpt()
    ez = ElasticZero(model, torch.optim.AdamW, comm, 3, copy_every=1, **OPT)
    if comm.rank == 3:

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if ez.steps == ZERO_AT:
                _down("rank", marks)
            return grad

        model.blocks[0].mlp.fc.weight.register_hook(hook)
    ended: list[float] = []
    while ez.steps < tes.TOTAL:
        s = ez.steps
        if not ez.step(lambda m, r, n, s=s: tes._loss(m, s, r, n)):
            ended.append(time.time())
    down_at = _down_at(marks)
    recoveries = [
        {k: r[k] for k in ("failed", "world_size", "rolled_back_to")} for r in ez.recoveries
    ]
    parts = [_parts(r, t, down_at) for r, t in zip(ez.recoveries, ended, strict=True)]
    out = (tes._lists(ez.zero.full_parameters()), ez.world_size, recoveries, parts)
    ez.comm.close()
    return out


@pytest.mark.timeout(600)
def test_elastic_zero3_across_hosts_rebuilds_the_lost_shard_bitwise(fabric, tmp_path):
    got = mr._run(fabric, _zero_job, str(tmp_path), expect_exit={3: KILL}, timeout=240)
    want = _on_hosts(fabric, tes._reference, 3, ZERO_AT, 3, str(tmp_path / "ck"))
    for r in range(3):
        params, size, recoveries, _ = got[r]
        assert size == 3 and recoveries == [
            {"failed": (3,), "world_size": 3, "rolled_back_to": ZERO_AT}
        ], recoveries
        assert params.keys() == want[r].keys()
        for name in params:
            assert params[name] == want[r][name], (r, name)
    assert got[0][0] != tes._lists(dict(tes._gpt().named_parameters()))  # it trained
    _report("ElasticZero (ZeRO-3, k=1), rank", [g[3][0] for g in got[:3]])


def _report(what: str, parts: list[dict[str, float]]) -> None:
    """The recovery's parts, slowest survivor's, with the load (pytest -s shows it)."""
    worst = {k: max(p[k] for p in parts) for k in parts[0]}
    load = os.getloadavg()[0]
    said = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in worst.items())
    print(f"\nrecovery across hosts, {what}: {said} (slowest survivor; load {load:.1f})")
    assert all(v >= 0 for v in worst.values()), worst


# -- pc.init's own store, kept -------------------------------------------------------


def _kept_store(rank: int, world_size: int) -> tuple:
    """pc.init the torchrun way (its own TCPStore, rank 0 serving it on host 0)
    with keep_store=True: after rank 3 dies, the survivors shrink through it."""
    import pycollectives as pc

    comm = pc.init(timeout=20, keep_store=True)
    comm.barrier()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(pc.PyCollectivesError):
        for _ in range(1_000_000):
            comm.all_reduce(torch.ones(1 << 12))
    new = comm.shrink(timeout=10)
    mr._sum_check(pc, new, (0, 1, 2))
    out = (new.parent_ranks, new.failed)
    new.close()
    comm.close()
    return out


def test_init_keep_store_lets_the_survivors_shrink_across_hosts(fabric):
    got = spawn.run(_plain, 4, fabric.hosts, _kept_store, (), timeout=120, expect_exit={3: KILL})
    assert got[:3] == [((0, 1, 2), (3,))] * 3, got


# -- examples/train_gpt.py --survive ------------------------------------------------


def test_train_gpt_survive_across_hosts_goes_on_when_a_host_is_lost(fabric, tmp_path):
    """4 rank processes of train_gpt.py --survive, 2 per host, each started as a
    cluster's launcher (or torchrun without its agent) would: RANK, WORLD_SIZE,
    MASTER_ADDR (host 0), MASTER_PORT. Once rank 0 reports step 3, host 1's two
    processes are SIGKILLed together: rank 0 prints the recovery line, host 0's
    ranks train to the last step and exit 0."""
    steps, port = 40, spawn.free_port()
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--dp", "4",
           "--survive", "--steps", str(steps), "--log-every", "1", "--timeout", "20"]  # fmt: skip
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    procs: list[subprocess.Popen] = []
    for rank, host in enumerate(LAYOUT):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": netns.addr(0), "MASTER_PORT": str(port),
               "PYCOLL_NET_TIMEOUT": str(mr.NET_TIMEOUT), "OMP_NUM_THREADS": "1"}  # fmt: skip
        env.pop("TORCHELASTIC_RUN_ID", None)
        with open(logs[rank], "w") as log:
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", fabric.hosts[host], *cmd],  # exec: the pid is python's
                    stdout=subprocess.PIPE if rank == 0 else log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
            )
    # Bounded: past 240 s every rank is killed, which ends rank 0's output.
    watchdog = threading.Timer(240, lambda: [p.kill() for p in procs])
    watchdog.start()
    lines: list[str] = []
    killed = False
    try:
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("step 3/") and not killed:
                killed = True
                for p in procs[2:]:  # host 1's power goes off
                    os.kill(p.pid, signal.SIGKILL)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = "".join(lines) + "".join(f"--- rank {r}\n{logs[r].read_text()}" for r in (1, 2, 3))
    assert killed and codes == [0, 0, KILL, KILL], (codes, out)
    found = re.search(
        r"^ranks 2, 3 died at step (\d+): 2 ranks go on \(agree ([\d.]+) ms, shrink ([\d.]+) "
        r"ms; the step is retried\)$",
        out,
        re.M,
    )
    assert found and int(found.group(1)) >= 3, out
    assert re.search(rf"^step {steps}/{steps} ", out, re.M), out
    assert re.search(rf"^final loss \S+ after {steps} steps on 2 ranks", out, re.M), out
    load = os.getloadavg()[0]
    print(f"\ntrain_gpt.py --survive across hosts: {found.group(0)} (load {load:.1f})")
