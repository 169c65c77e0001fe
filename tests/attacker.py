"""The TCP transport's handshake seen from outside (csrc/transport/tcp_auth.h,
written here again from its description, with Python's hmac), for the tests
that attack a job: a Hello of either protocol version, the MACs a key holder
computes, the key a job derives, the frames an injector would send.

Run as a script (`ip netns exec <ns> python tests/attacker.py --target ...`)
inside an attacker's network namespace, it floods listeners: it holds
`--count` idle connections from one source address and as many from several
others that send the start of a Hello and stop, reopening each one a
listener drops, until --stop appears (see test_multihost_security.py)."""

from __future__ import annotations

import argparse
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
    """n bytes from s, or fewer if it closes."""
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def frame(seq: int, w0: int, count: int, payload: bytes) -> bytes:
    """A data frame (tcp_socket.h's DataHeader, then the payload)."""
    return DATA_HEADER.pack(seq, 0, w0, count, len(payload)) + payload


def all_reduce_w0(dtype: int = 0, op: int = 0) -> int:
    """OpSig::word0 of an all-reduce (kind 0) of `dtype` (0: float32) with `op` (0: sum)."""
    return 0 | dtype << 8 | op << 16


def read_store(host: str, port: int, keys: list[str], timeout: float = 30.0) -> dict[str, bytes]:
    """Reads `keys` from a TCPStore at host:port as a client (waiting for each)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)  # fmt: skip
    return {k: store.get(k) for k in keys}


def _targets_from(spec: str, seen: set) -> list[tuple[str, int]]:
    """The addresses `spec` names now: file:PATH (ip:port, once the file
    exists), store:HOST:PORT:KEY (a TCPStore's value, as a reader of the
    store would take it) or proc:PID:IP (every TCP port listening in PID's
    network namespace, as a port scan would find them), less those in `seen`."""
    kind, _, rest = spec.partition(":")
    if kind == "file":
        if not os.path.exists(rest):
            return []
        with open(rest) as f:
            text = f.read().strip()
    elif kind == "store":
        host, port, key = rest.split(":", 2)
        text = read_store(host, int(port), [key])[key].decode()
    elif kind == "proc":
        pid, ip = rest.split(":", 1)
        ports = []
        with open(f"/proc/{pid}/net/tcp") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    ports.append(int(local.split(":")[1], 16))
        new = [(ip, p) for p in ports if (ip, p) not in seen]
        return new
    else:
        raise SystemExit(f"attacker: unknown target {spec!r}")
    if not text:
        return []
    host, port = text.rsplit(":", 1)
    target = (host.strip("[]"), int(port))
    return [] if target in seen else [target]


def _dead(s: socket.socket) -> bool:
    """Whether the listener closed or refused non-blocking socket s (what it
    sent before is read and dropped)."""
    try:
        while s.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _connect(target: tuple[str, int], source: str, garbage: bool) -> socket.socket | None:
    s = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET)
    s.setblocking(False)
    try:
        s.bind((source, 0))
        s.connect_ex(target)
    except OSError:
        s.close()
        return None
    return s


def main() -> None:
    ap = argparse.ArgumentParser(
        description="a flood of connections, for test_multihost_security.py"
    )
    ap.add_argument("--target", action="append", required=True,
                    help="file:PATH, store:HOST:PORT:KEY or proc:PID:IP (repeatable)")  # fmt: skip
    ap.add_argument("--count", type=int, default=300, help="connections held per target and kind")
    ap.add_argument("--one", required=True, help="the source of the idle connections")
    ap.add_argument("--many", required=True, help="comma-separated sources of the garbage ones")
    ap.add_argument("--ready", required=True, help="written once every target is flooded")
    ap.add_argument("--stop", required=True, help="the flood ends when this file exists")
    ap.add_argument("--wait-targets", type=int, default=1, help="targets to find before --ready")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    many = args.many.split(",")
    # (target, source, garbage) -> socket: every slot is kept filled until --stop
    slots: dict[tuple, socket.socket | None] = {}
    seen: set = set()
    opened = dropped = 0
    deadline = time.monotonic() + 180
    ready = False
    while not os.path.exists(args.stop) and time.monotonic() < deadline:
        for spec in args.target:
            try:
                found = _targets_from(spec, seen)
            except (OSError, RuntimeError, ValueError):
                found = []
            for t in found:
                seen.add(t)
                for i in range(args.count):
                    slots[(t, args.one, False, i)] = None
                    slots[(t, many[i % len(many)], True, i)] = None
        budget = 400  # new connections per pass (~10 ms), so the machine's CPUs stay shared
        for key, s in slots.items():
            if s is not None:
                if not _dead(s):
                    continue
                s.close()
                dropped += 1
            if budget == 0:
                slots[key] = None
                continue
            budget -= 1
            t, source, garbage, _ = key
            slots[key] = _connect(t, source, garbage)
            opened += 1
            if garbage and slots[key] is not None:
                slots[key]._pending = struct.pack("=Q", MAGIC) + os.urandom(36)  # type: ignore[attr-defined]
        for s in slots.values():  # garbage goes once connected
            data = getattr(s, "_pending", None)
            if data:
                try:
                    s.send(data)
                    s._pending = b""  # type: ignore[attr-defined]
                except OSError:
                    pass
        if (
            not ready
            and len(seen) >= args.wait_targets
            and all(s is not None for s in slots.values())
        ):
            time.sleep(0.05)  # their handshakes reach the listeners
            with open(args.ready, "w") as out:
                out.write(f"{len(seen)} targets, {len(slots)} connections\n")
            ready = True
        time.sleep(0.01)
    print(f"attacker: {len(seen)} targets, {opened} connections opened, {dropped} dropped by them",
          file=sys.stderr, flush=True)  # fmt: skip
    for s in slots.values():
        if s is not None:
            s.close()


if __name__ == "__main__":
    main()
