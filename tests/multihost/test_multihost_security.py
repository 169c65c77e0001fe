"""Attacks on a job across hosts (network namespaces, netns.py: hosts 0 and 1
run the ranks, host 2 is the attacker's, with 32 more addresses), each from
the attacker's namespace (tests/support/attacker.py):

- floods: hundreds of idle connections from one address and garbage ones
  from 32, reopened as the listeners drop them, on every rank's port
  before and during init() and after it, and on the ports a cross-host
  split() opens: the collectives that follow succeed, the refusals are
  logged at a bounded rate, and the ports close once every connection is in;
- the issue's injection: a reader of the store takes the communicator's id
  and rank 0's address and sends a forged Hello (from rank 1) and an
  all-reduce frame of 1000.0 before rank 1 does (version 1, then 2): refused
  and logged, the result stays 2.0; the job's secret is gone from the store;
- an address replaced in the store (a relay that rewrites 7.0 into 1000.0 on
  its way to rank 1): init fails naming the refused peer; no rank returns.
Each with the job's own secret (through the store) and with PYCOLL_AUTH_KEY."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import paths
import pytest
import spawn
import torch

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

ROOT = paths.ROOT
ATTACKER = 2  # the attacker's host
ONE = netns.addr(ATTACKER)
MANY = [f"10.250.0.{100 + i}" for i in range(32)]
KEY = "5c" * 32
RELAY_PORT = 47001


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(3) as f:
        for ip in MANY:
            f.add_address(ATTACKER, ip)
        yield f


class _Store:
    """The store as this rank's init sees it: `gate` (key suffix, file) holds
    a get of that key until the file exists; `swap` (key suffix, value)
    returns another value for it (a writer of the store, without the race)."""

    def __init__(self, store, gate=None, swap=None) -> None:
        self._store, self._gate, self._swap = store, gate, swap

    def get(self, key: str) -> bytes:
        if self._gate and key.endswith(self._gate[0]):
            deadline = time.monotonic() + 60
            while not os.path.exists(self._gate[1]) and time.monotonic() < deadline:
                time.sleep(0.005)
        value = self._store.get(key)
        return self._swap[1].encode() if self._swap and key.endswith(self._swap[0]) else value

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def _rank(rank, world, hosts, d, env, gate, swap, job, args):
    """Rank `rank` on host `rank` (one rank per host): stderr to d/stderr<r>,
    its pid to d/pid<r>; pc.init with a store this rank keeps (rank 0 serves
    it at MASTER_ADDR:MASTER_PORT); then job(comm, store, d, *args)."""
    netns.enter(hosts[rank])
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = netns.addr(0)  # the interface that reaches it is eth0
    fd = os.open(f"{d}/stderr{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    Path(f"{d}/pid{rank}").write_text(str(os.getpid()))
    import torch.distributed as dist

    import pycollectives as pc

    store = dist.TCPStore(netns.addr(0), int(os.environ["MASTER_PORT"]), world, rank == 0,
                          datetime.timedelta(seconds=60), wait_for_workers=False)  # fmt: skip
    view = _Store(store, gate if rank == 0 else None, swap if rank == 0 else None)
    try:
        comm = pc.init(rank=rank, world_size=world, store=view, timeout=60)
    except pc.PyCollectivesError as e:
        return {"init": f"{type(e).__name__}: {e}"}
    try:
        return job(comm, store, d, *args)
    finally:
        comm.close()


def _run(fabric, d, job, *args, env=None, gate=None, swap=None, timeout=150):
    env = dict(env or {}, MASTER_PORT=str(spawn.free_port()))
    return spawn.run(_rank, 2, fabric.hosts, str(d), env, gate, swap, job, args, timeout=timeout)


def _attacker(fabric, *argv: str) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", fabric.hosts[ATTACKER], sys.executable,
           str(paths.SUPPORT / "attacker.py"), *argv]  # fmt: skip
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen, stop: Path) -> str:
    stop.touch()
    try:
        return proc.communicate(timeout=30)[1]
    finally:
        proc.kill()


def _attacked(proc: subprocess.Popen, stop: Path, d: Path, call) -> tuple:
    """(call(), the attacker's log), the attacker stopped after call() either way.
    A RankError (a rank raised, died or hung: spawn.run) is raised again with the
    attacker's log and the end of every rank's stderr (its refusals) appended."""
    try:
        out = call()
    except spawn.RankError as e:
        log = _stop(proc, stop)
        tails = "".join(f"\n--- {f.name} (its end) ---\n{f.read_text()[-3000:]}"
                        for f in sorted(d.glob("stderr*")))  # fmt: skip
        raise spawn.RankError(f"{e}\n--- the attacker's stderr ---\n{log}{tails}") from None
    except BaseException:
        _stop(proc, stop)
        raise
    return out, _stop(proc, stop)


def _await(path: Path, what: str, seconds: float = 60.0) -> None:
    """Returns once `path` exists; raises TimeoutError saying `what` did not
    come after `seconds` (a rank never waits for the attacker for ever)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come within {seconds:.0f} s ({path} is missing)")
        time.sleep(0.01)


def _refusals(d: Path, rank: int) -> list[str]:
    text = (d / f"stderr{rank}").read_text()
    return [line for line in text.splitlines() if "refused" in line and "pycollectives" in line]


def _collectives(comm, tag: str) -> dict:
    """All-reduce at three sizes, all-to-all (which connects every pair) and a
    barrier: whether each result was exact, and the TCP side's state."""
    n, r, bad = comm.world_size, comm.rank, []
    for count in (1, 1000, 300_001):
        x = torch.arange(count, dtype=torch.float32) % 7 + r
        comm.all_reduce(x)
        if not torch.equal(x, (torch.arange(count, dtype=torch.float32) % 7) * n + n * (n - 1) / 2):
            bad.append(f"{tag}: all_reduce {count}")
    out = torch.empty(n * 1000)
    comm.all_to_all(out, torch.full((n * 1000,), float(r)))
    if not torch.equal(out, torch.arange(n).repeat_interleave(1000).float()):
        bad.append(f"{tag}: all_to_all")
    comm.barrier()
    info = comm.net_info()
    return {"bad": bad, "rejected": info["rejected"], "listening": info.get("listening")}


# ---- floods -------------------------------------------------------------------------------


def _job_flooded_init(comm, store, d) -> dict:
    return _collectives(comm, "after init")


@pytest.mark.parametrize("secret", ["store", "env"])
def test_a_flood_before_during_and_after_init_costs_the_job_nothing(fabric, tmp_path, secret):
    """The attacker reads both ranks' addresses from the store as they are
    published and floods both ports (300 idle connections from one address,
    300 garbage ones from 32, each reopened when dropped); rank 0 dials rank 1
    only once the flood is in place, and every data connection after init is
    made through it too. (Before: the 257th connection was refused, and with
    it rank 0's: init failed.)"""
    port_env = {"PYCOLL_AUTH_KEY": KEY} if secret == "env" else {}
    env = dict(port_env, MASTER_PORT=str(spawn.free_port()))
    store = f"store:{netns.addr(0)}:{env['MASTER_PORT']}"
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    proc = _attacker(fabric, "flood", "--target", f"{store}:pycoll/0/addr/0", "--target",
                     f"{store}:pycoll/0/addr/1", "--one", ONE, "--many", ",".join(MANY),
                     "--ready", str(ready), "--stop", str(stop), "--wait-targets", "2")  # fmt: skip
    t0 = time.monotonic()
    out, log = _attacked(proc, stop, tmp_path, lambda: spawn.run(
        _rank, 2, fabric.hosts, str(tmp_path), env, ("addr/1", str(ready)), None,
        _job_flooded_init, (), timeout=150))  # fmt: skip
    took = time.monotonic() - t0
    print(log, out)
    assert ready.exists(), log
    for r, o in enumerate(out):
        assert "init" not in o and not o["bad"], (r, o)
        assert not o["listening"], (r, o)  # every connection in: the port is closed
        assert o["rejected"] > 300, (r, o)
        lines = _refusals(tmp_path, r)
        # 10 at once, then one a second; each later one counts those left out
        assert 1 <= len(lines) <= 10 + took + 1, (r, len(lines), took)
        assert any("more refused since the last report" in x or "more connections, not shown" in x
                   for x in lines), lines  # fmt: skip


def _job_flooded_split(comm, store, d, shaped: str) -> dict:
    r = comm.rank
    res = _collectives(comm, "parent")  # the parent's connections are all made
    _await(Path(d) / "ready", "the attacker's --ready (its flood in place)")
    out = {"parent": res, "children": [], "took": []}  # took: seconds of each split, its checks
    for i in range(2):
        t0 = time.monotonic()
        if r == 0:  # its packets crawl while split runs: the flood lands before its connection
            subprocess.run(["tc", "qdisc", "replace", "dev", "eth0", "root", *shaped.split()],
                           check=True, timeout=20)  # fmt: skip
        try:
            sub = comm.split(0)
        finally:
            if r == 0:
                subprocess.run(["tc", "qdisc", "del", "dev", "eth0", "root"], timeout=20)
        t1 = time.monotonic()
        time.sleep(0.3)  # the flood reaches the new ports
        out["children"].append(_collectives(sub, f"child {i}"))
        sub.close()
        out["took"].append((round(t1 - t0, 2), round(time.monotonic() - t1, 2)))
    return out


def test_a_flood_during_a_split_across_hosts_costs_it_nothing(fabric, tmp_path):
    """The attacker scans rank 1's host for listening ports and floods each
    new one (the split's); rank 0's link is slowed to 50 kbit/s while split
    runs, so the flood is in place before its connections arrive."""
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    proc = _attacker(fabric, "flood", "--target", f"proc:{tmp_path / 'pid1'}:{netns.addr(1)}",
                     "--one", ONE, "--many", ",".join(MANY), "--ready", str(ready), "--stop",
                     str(stop), "--wait-targets", "0")  # fmt: skip
    shaped = "tbf rate 50kbit burst 1600 latency 5s"
    out, log = _attacked(proc, stop, tmp_path,
                         lambda: _run(fabric, tmp_path, _job_flooded_split, shaped))  # fmt: skip
    print(log, out)
    assert log.count("attacker: flooding") >= 2, log  # both children's ports were found
    for r, o in enumerate(out):
        assert "init" not in o and not o["parent"]["bad"], (r, o)
        for child in o["children"]:
            assert not child["bad"] and not child["listening"], (r, o)
    assert all(c["rejected"] > 0 for c in out[1]["children"]), out[1]


# ---- injection and relay -----------------------------------------------------------------


def _job_injected(comm, store, d) -> dict:
    r = comm.rank
    secret_left = store.check(["pycoll/0/authkey"])
    if r == 1:  # rank 1 comes once the attacker has tried
        _await(Path(d) / "done", "the attacker's --done (its injection tried)")
    else:
        (Path(d) / "go").touch()
    x = torch.ones(1)
    comm.all_reduce(x)
    y = torch.full((1000,), float(r))
    comm.all_reduce(y)
    return {"first": float(x[0]), "second_ok": bool((y == 1).all()), "secret_left": secret_left}


@pytest.mark.parametrize("secret", ["store", "env"])
def test_a_store_reader_cannot_inject_a_frame(fabric, tmp_path, secret):
    """The issue's attack, after init, from a reader of the store: rank 0's
    all-reduce returned 1001.0 (its 1 plus the injected 1000) in 2 of 3 runs."""
    env = {"PYCOLL_AUTH_KEY": KEY} if secret == "env" else {}
    env["MASTER_PORT"] = str(spawn.free_port())
    report = tmp_path / "report.json"
    proc = _attacker(fabric, "inject", "--store", f"{netns.addr(0)}:{env['MASTER_PORT']}",
                     "--go", str(tmp_path / "go"), "--report", str(report), "--done",
                     str(tmp_path / "done"))  # fmt: skip
    try:
        out = spawn.run(_rank, 2, fabric.hosts, str(tmp_path), env, None, None, _job_injected, (),
                        timeout=120)  # fmt: skip
    finally:
        log = proc.communicate(timeout=30)[1]
    seen = json.loads(report.read_text())
    print(log, seen, out)
    for r, o in enumerate(out):
        assert o == {"first": 2.0, "second_ok": True, "secret_left": False}, (r, o)
    assert not seen["secret_in_store"], seen  # deleted once both ranks read it
    assert seen["v2_challenge_status"] == 0 and seen["v2_ack_status"] == 5, seen  # Refusal::kAuth
    lines = _refusals(tmp_path, 0)
    assert any(f"from {ONE}" in x and "protocol version 1" in x for x in lines), lines
    assert any(f"from {ONE}" in x and "claims to be rank 1" in x and "did not verify" in x
               for x in lines), lines  # fmt: skip


def _job_relayed(comm, store, d) -> dict:
    x = torch.full((4,), 7.0)
    comm.all_reduce(x)
    return {"result": x.tolist()}


@pytest.mark.parametrize("secret", ["store", "env"])
def test_an_address_replaced_in_the_store_is_refused(fabric, tmp_path, secret):
    """Rank 0 reads the attacker's address for rank 1 (a writer of the store
    replaced it): the attacker relays every connection to the real rank 1,
    rewriting 7.0 into 1000.0 on the way. Before, the relay was invisible and
    rank 1's all-reduce returned 1007.0; now rank 0 refuses the relay (it
    cannot sign the address rank 0 dialled) and init fails on both ranks,
    naming rank 1 and the relay's address."""
    env = {"PYCOLL_AUTH_KEY": KEY} if secret == "env" else {}
    env["MASTER_PORT"] = str(spawn.free_port())
    relay = f"{ONE}:{RELAY_PORT}"
    stop = tmp_path / "stop"
    proc = _attacker(fabric, "relay", "--store", f"{netns.addr(0)}:{env['MASTER_PORT']}",
                     "--listen", relay, "--stop", str(stop))  # fmt: skip
    time.sleep(1.0)  # it listens
    try:
        out = spawn.run(_rank, 2, fabric.hosts, str(tmp_path), env, None, ("addr/1", relay),
                        _job_relayed, (), timeout=120)  # fmt: skip
    finally:
        log = _stop(proc, stop)
    print(log, out)
    assert "relaying a connection" in log, log
    for r, o in enumerate(out):
        assert "result" not in o, (r, o)  # nothing returns, let alone 1007.0
        assert "could not connect to rank 1 at " + relay in o["init"], (r, o)
        assert "failed authentication" in o["init"], (r, o)


def _job_send_to_3(comm, store, d) -> dict:
    import pycollectives as pc

    t = torch.full((100,), 7.0 if comm.rank == 0 else 0.0)
    try:
        if comm.rank == 0:
            comm.send(t, 3)
        elif comm.rank == 3:
            comm.recv(t, 0)
        comm.barrier()
    except pc.PyCollectivesError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"result": float(t[0])}


def test_a_data_connection_to_a_replaced_address_names_the_refusal(fabric, tmp_path):
    """2 hosts x 2 ranks; rank 0 reads the relay's address for rank 3, its
    peer on no control connection (those are 0-2 and 1-3): init succeeds, and
    its first send to rank 3 goes to the relay. The data connection fails
    authentication: rank 0 says the connection was refused by rank 3 at the
    relay's address (not that rank 3 died), every rank raises, and rank 3
    never receives the rewritten 1000.0."""
    env = {"PYCOLL_AUTH_KEY": KEY, "MASTER_PORT": str(spawn.free_port())}
    relay = f"{ONE}:{RELAY_PORT}"
    stop = tmp_path / "stop"
    proc = _attacker(fabric, "relay", "--store", f"{netns.addr(0)}:{env['MASTER_PORT']}",
                     "--listen", relay, "--stop", str(stop), "--real", "pycoll/0/addr/3")  # fmt: skip
    time.sleep(1.0)  # it listens
    hosts = [fabric.hosts[h] for h in (0, 0, 1, 1)]
    try:
        out = spawn.run(_rank, 4, hosts, str(tmp_path), env, None, ("addr/3", relay),
                        _job_send_to_3, (), timeout=120)  # fmt: skip
    finally:
        log = _stop(proc, stop)
    print(log, out)
    assert "relaying a connection" in log, log
    assert all("result" not in o for o in out), out
    msg = out[0]["error"]
    assert msg.startswith(
        "PyCollectivesError: pycollectives: rank 0: a data connection to rank 3"
    ), msg
    assert f"was refused by rank 3 at {relay}: it failed authentication" in msg, msg
    assert "died" not in msg, msg
    assert all("reported by rank 0" in o["error"] for o in out[1:]), out
