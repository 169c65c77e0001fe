"""A peer that holds the job's key (PYCOLL_AUTH_KEY) but misbehaves on its
control connection (network namespaces, netns.py): rank 1 is a fake, written
in Python from the protocol's description (tests/support/attacker.py), that joins
through the store and answers rank 0's control handshake, then
- streams 32 MiB of control frames as fast as it can: rank 0's buffer of
  unparsed control bytes never holds more than one frame (8 B + 64 KiB);
- answers rank 0's question at a timeout (where are your ranks?) with
  idle_ns = INT64_MAX: the verdict names rank 1 as stopped in the operation
  (the subtraction overflowed before, and the verdict named nobody right)."""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from pathlib import Path

import attacker as a
import netns
import pytest
import spawn

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

KEY = "a7" * 32
QUERY, STATUS = 3, 4  # tcp_socket.h's CtlType
ENTRY = struct.Struct("=iIIIQq")  # CtlStatusEntry: rank started done pad waiting idle_ns


@pytest.fixture(scope="module")
def fabric():
    with netns.Fabric(2) as f:
        yield f


def _fake_rank1(port: int, d: str, scenario: str) -> str:
    """Joins as rank 1 of 2 through the store, takes rank 0's control
    connection (a full handshake with the key), then misbehaves."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(netns.addr(0), port, 2, False, datetime.timedelta(seconds=30))
    k = "pycoll/0/"
    store.set(k + "id/1", "fake:1:0:fake")  # another host's process: not checked
    store.set(k + "host/1", "fake-host")
    assert store.get(k + "config").decode().endswith(";env")  # PYCOLL_AUTH_KEY's secret
    comm_id = bytes.fromhex(store.get(k + "commid").decode())
    srv = socket.create_server((netns.addr(1), 0))
    mine = srv.getsockname()
    store.set(k + "addr/1", f"{mine[0]}:{mine[1]}")
    conn, _ = srv.accept()  # rank 0's control connection
    conn.settimeout(30)
    hello = a.recv_exact(conn, a.HELLO.size)
    fields = a.HELLO.unpack(hello)
    assert fields[2] == a.CONTROL and fields[4:6] == (0, 1), fields
    key = a.derive_key(bytes.fromhex(KEY), comm_id)
    nonce = os.urandom(32)
    conn.sendall(a.CHALLENGE.pack(a.MAGIC, 1, 0, nonce, a.mac(key, True, hello, nonce, mine)))
    proof = a.recv_exact(conn, 32)
    assert proof == a.mac(key, False, hello, nonce, mine), "rank 0's proof"
    conn.sendall(a.ACK.pack(a.MAGIC, 1, 0))
    # rank 0's address before "connected": rank 0 lets its store go once every
    # rank has said so (a read after it failed once under load, and rank 0
    # then waited for a file that never came)
    target = a.store_address(store.get(k + "addr/0").decode())
    store.add(k + "connected", 1)
    if scenario == "duplicate":  # rank 1's data connection to rank 0, twice
        first, got1 = a.connect_as(key, comm_id, target, 1, 0)
        second, got2 = a.connect_as(key, comm_id, target, 1, 0)
        Path(d, "streamed").write_text(f"{got1} {got2}")
        first.close()
        second.close()
    elif scenario == "stream":
        big = a.CTL_HEADER.pack(99, 4096) + bytes(4096)  # a type it ignores
        small = a.CTL_HEADER.pack(99, 0) * 512
        for _ in range(4096):
            conn.sendall(big + small)
        Path(d, "streamed").touch()
    else:  # answer the timeout's question with an idle time that overflows
        header = a.recv_exact(conn, a.CTL_HEADER.size)
        kind, nbytes = a.CTL_HEADER.unpack(header)
        body = a.recv_exact(conn, nbytes)
        assert kind == QUERY, kind
        entry = ENTRY.pack(1, 1, 0, 0, 1 << 32 | 1, 2**63 - 1)  # in op 1, waiting for rank 0
        conn.sendall(a.CTL_HEADER.pack(STATUS, len(body) + ENTRY.size) + body + entry)
    conn.settimeout(60)
    while conn.recv(65536):  # until rank 0 closes
        pass
    return "done"


def _pair(rank: int, world: int, hosts: list[str], d: str, scenario: str):
    netns.enter(hosts[rank])
    os.environ.update(MASTER_ADDR=netns.addr(0), PYCOLL_AUTH_KEY=KEY)
    port = int(os.environ["MASTER_PORT"])
    if rank == 1:
        return _fake_rank1(port, d, scenario)
    fd = os.open(f"{d}/stderr0", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # the refusals' log
    import torch

    import pycollectives as pc

    comm = pc.init(timeout=30)
    try:
        if scenario in ("stream", "duplicate"):
            deadline = time.monotonic() + 60
            while not Path(d, "streamed").exists():
                assert time.monotonic() < deadline, "rank 1 never said it was done"
                time.sleep(0.01)
            time.sleep(0.5)  # the last bytes are read
            if scenario == "duplicate":
                comm.close()  # the count stays readable after close
                return comm.net_info()["rejected"]
            return comm.net_info()["control_buffer_peak"]
        try:
            comm.all_reduce(torch.ones(4), timeout=1.0)
        except pc.PyCollectivesError as e:
            return str(e)
        return "no error"
    finally:
        comm.close()


def test_a_streaming_peer_cannot_grow_the_control_buffer(fabric, tmp_path):
    peak, _ = spawn.run(_pair, 2, fabric.hosts, str(tmp_path), "stream", timeout=90)
    assert 0 < peak <= 8 + (64 << 10), peak


def test_an_idle_time_that_would_overflow_is_clamped(fabric, tmp_path):
    msg, _ = spawn.run(_pair, 2, fabric.hosts, str(tmp_path), "status", timeout=90)
    assert "Timed out" in msg and "for rank 1 (it reached this operation but has not waited" in msg
    # clamped to a day (plus the milliseconds the answer took to be read, under load)
    assert re.search(r"for 864000\d\d ms", msg), msg


def test_a_second_connection_for_the_same_stripe_is_refused(fabric, tmp_path):
    """Even a holder of the key cannot swap a connection in: the second data
    connection claiming (1 -> 0, stripe 0) passes the handshake and is
    refused (kDuplicate), logged, never adopted. (PYCOLL_SOCKET_NSOCKS=2 on
    rank 0 keeps its port open after the first: it expects stripe 1 too.)"""
    rejected, _ = spawn.run(_pair, 2, fabric.hosts, str(tmp_path), "duplicate", timeout=90,
                            env={"PYCOLL_SOCKET_NSOCKS": "2"})  # fmt: skip
    assert (tmp_path / "streamed").read_text() == "0 6", "statuses: adopted, then kDuplicate"
    assert rejected == 1, rejected
    log = (tmp_path / "stderr0").read_text()
    assert "is connected already: a second one is never adopted" in log, log
