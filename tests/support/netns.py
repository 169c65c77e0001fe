"""Several hosts on one machine for the multi-host tests: one network namespace
per host, each with an `eth0` (a veth pair whose other end sits on a bridge in
a switch namespace of its own), addresses 10.250.0.<h+1>/24 and
fd00:250::<h+1>/64 (created here only, inside these namespaces: the machine's
own network is not touched).

`Fabric(nhosts)` makes them (root only: `unavailable()` says why not);
`enter(name)` moves the calling process into a namespace (before it opens any
socket); `link(h, up)` cuts or restores host h's cable; `shape(h, ...)` puts
`tc netem` (or, without it, a rate limit) on it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from typing import Any

CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None where namespaces can be made here, else why they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (the multi-host tests run as root in CI)"
    name = f"pc25probe{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns add` cannot run: {e}"
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def enter(name: str) -> None:
    """Moves this process (single-threaded, no sockets yet) into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def addr(h: int, v6: bool = False) -> str:
    """Host h's address."""
    return f"fd00:250::{h + 1}" if v6 else f"10.250.0.{h + 1}"


class Fabric:
    """nhosts namespaces on one bridge (a context manager: removed on exit)."""

    def __init__(self, nhosts: int) -> None:
        tag = f"pc{os.getpid() % 100000}"
        self.hosts = [f"{tag}h{h}" for h in range(nhosts)]
        self.switch = f"{tag}sw"
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in [self.switch, *self.hosts]:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        sw = self.switch
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h, ns in enumerate(self.hosts):
            port = f"p{h}"
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr(h)}/24", "dev", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr(h, True)}/64", "dev", "eth0", "nodad")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def add_address(self, h: int, ip: str) -> None:
        """Gives host h's eth0 one more IPv4 address (on the fabric's /24)."""
        _ip("-n", self.hosts[h], "addr", "add", f"{ip}/24", "dev", "eth0")

    def link(self, h: int, up: bool) -> None:
        """Cuts (up=False) or restores host h's link to the switch."""
        _ip("-n", self.switch, "link", "set", f"p{h}", "up" if up else "down")

    def shape(self, h: int, rate: str, delay: str) -> str:
        """Shapes host h's eth0: `tc netem` with `rate` (e.g. "10gbit") and one-way
        `delay` ("50us"); where the kernel has no netem, a token bucket (tbf) at
        `rate` without the delay. Returns what it installed."""
        base = ["tc", "-n", self.hosts[h], "qdisc", "replace", "dev", "eth0", "root"]
        netem = ["netem", "delay", delay, "rate", rate, "limit", "100000"]
        run = lambda args: subprocess.run(args, capture_output=True, timeout=20)  # noqa: E731
        if run(base + netem).returncode == 0:
            return f"netem rate {rate} delay {delay}"
        tbf = ["tbf", "rate", rate, "burst", "1mb", "latency", "10ms"]
        subprocess.run(base + tbf, check=True, capture_output=True, timeout=20)
        return f"tbf rate {rate} (no netem in this kernel: no delay)"

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
