"""Start-up: `init` makes a communicator the torchrun way. A torch.distributed
Store carries every rank's host id, the name of each host's shared-memory
segment, across hosts the ranks' TCP addresses, the communicator's id and
(unless PYCOLL_AUTH_KEY is set: ../auth.py) the job's secret for the TCP
handshakes until every rank has read it, and (bootstrap.py, below this) who
the ranks are and the error that stopped one of them during set-up; no data
goes through it."""

from __future__ import annotations

import datetime
import functools
import os
import socket
from typing import Any

from .. import _C, _recovery_hosts
from .._recovery_hosts import HostRecovery
from ..auth import ENV_FILE, ENV_KEY, STORE_BYTES, job_secret
from ..communicator import Communicator, Timeout, to_seconds
from .bootstrap import Bootstrap
from .grow import grow as _grow

_inits: dict[str, int] = {}
_STORE_MAX_TIMEOUT_S = 365 * 86400.0  # a TCPStore's timeout (an infinite one waits this long)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"pycollectives: init: {name} is not set (run under torchrun or pass rank=, world_size=, store=)"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"pycollectives: init: {name}={value!r} is not an integer") from None


def _listen(addr: str, port: int) -> int:
    """A socket listening on MASTER_ADDR only, for the TCPStore server to take
    over: on its own it would listen on every interface, where anyone on the
    network could read and write the bootstrap's keys. The ranks all run on
    this host and connect to MASTER_ADDR, so nothing else is needed."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s.detach()  # the store owns it from now on


def _bind(rank: int, world_size: int) -> None:
    """PYCOLL_BIND=core: pins the calling thread (and the threads it starts from now on: the
    communicator's progress thread, torch's pools if not started yet) to one of the CPUs it may
    run on, the local rank's (LOCAL_RANK, else `rank`), when the local ranks (LOCAL_WORLD_SIZE,
    else `world_size`) fit one per CPU; otherwise leaves it unpinned, as mpirun's --bind-to core
    does for more ranks than cores. Unset or `none`: nothing. Raises ValueError for another value."""
    mode = os.environ.get("PYCOLL_BIND", "none") or "none"
    if mode == "none":
        return
    if mode != "core":
        raise ValueError(
            f"pycollectives: rank {rank}: init: PYCOLL_BIND must be none or core, not {mode!r}"
        )
    local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    nlocal = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else world_size
    cpus = sorted(os.sched_getaffinity(0))
    if nlocal <= len(cpus):
        os.sched_setaffinity(0, {cpus[local % len(cpus)]})


def init(
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
    timeout: Timeout = 600.0,
    prefix: str = "pycoll",
    *,
    keep_store: bool = False,
) -> Communicator:
    """Creates the communicator of all ranks of this host.

    Without `store`, reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and
    creates a torch.distributed.TCPStore (rank 0 serves it) just for the
    bootstrap; with `keep_store`, the communicator keeps it for agree and
    shrink across hosts (rank 0 serves it as long as it runs: the survivors
    of a lost rank on another host agree through it). With `store` (any
    torch.distributed.Store), rank and world_size are required. `timeout` (seconds or timedelta) bounds the bootstrap and is
    the default timeout of every operation. Every rank must call init the same
    number of times with the same prefix.

    With PYCOLL_BIND=core in the environment, first pins this rank to one CPU
    (see _bind: one rank per core, as mpirun binds).

    Raises ValueError for missing or inconsistent arguments (or PYCOLL_BIND),
    and CollectiveTimeout if the other ranks do not arrive within `timeout`.
    """
    seconds = to_seconds(timeout)
    if seconds < 0:
        seconds = 600.0
    own_store = store is None
    agent_store = False
    if own_store:
        import torch.distributed as dist

        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT")
        # Under torchrun the agent already serves a store on MASTER_PORT: connect to it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        serve = rank == 0 and not agent_store
        listen = {"master_listen_fd": _listen(addr, port)} if serve else {}
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            serve,
            datetime.timedelta(seconds=min(seconds, _STORE_MAX_TIMEOUT_S)),
            wait_for_workers=False,
            **listen,
        )
    if rank is None or world_size is None:
        raise ValueError("pycollectives: init: rank and world_size are required with store=")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"pycollectives: init: world_size must be a positive int, not {world_size!r}"
        )
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"pycollectives: init: rank={rank!r} is out of range [0, {world_size})")

    generation = _inits.get(prefix, 0)
    _inits[prefix] = generation + 1
    serving = own_store and not agent_store
    if agent_store:
        # torchrun's store outlives a restart (--max-restarts): the keys of each
        # attempt apart, as torch.distributed's own "/worker/attempt_N" prefix.
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        prefix = f"{prefix}/attempt{_env_int('TORCHELASTIC_RESTART_COUNT') if restarts else 0}"
    boot = Bootstrap(store, f"{prefix}/{generation}", rank, world_size, 0 if serving else None)
    try:
        _bind(rank, world_size)
        secret = job_secret(rank)  # checked on every rank, even on one host
        core = _connect(boot, rank, world_size, seconds, secret)
        boot.finish(seconds)
    except BaseException as e:
        boot.fail(e, seconds)
        raise
    comm = Communicator(core)
    # Across hosts agree/shrink go through the store: the caller's (pc.init's
    # own goes once every rank is done with it; they are then given one).
    kept = store if keep_store or not own_store else None
    comm._host_recovery = HostRecovery(f"{prefix}/{generation}", kept)
    if not own_store:
        # The caller's store may be served by this process and held nowhere
        # else (passed inline): it stays alive until every rank is done with
        # it, at close() (pc.init's own store: finish() waited already).
        comm._on_close.append(functools.partial(boot.release, min(seconds, 60.0)))
    # Every rank is done with pc.init's own store (finish): its server, if
    # this process's, can go, freeing MASTER_PORT for the caller (unless kept).
    del boot, store, kept
    return comm


def _hint() -> str:
    """The bootstrap store's address: the interface that reaches it is the
    default one for the TCP connections between hosts (PYCOLL_SOCKET_IFNAME
    overrides it)."""
    return os.environ.get("MASTER_ADDR", "")


def _connect(
    boot: Bootstrap, rank: int, world_size: int, seconds: float, secret: bytes | None
) -> Any:
    """Creates (rank 0) or opens the segment and connects the core communicator.

    Every rank first publishes its host id: ranks with equal ids share a host
    (and a segment), others talk over TCP (_connect_hosts). On one host, rank
    0 publishes the segment's name before it creates the segment: every peer
    then knows the name as soon as it exists, and removes it if rank 0 dies
    or fails before the ranks have all attached (see Bootstrap.fail). Every
    wait runs boot.check: another rank's published error, or its death,
    raises at once."""
    boot.set(f"host/{rank}", _C.host_id())
    ids = [
        boot.wait_for(f"host/{r}", seconds, f"rank {r} did not publish its host id")
        for r in range(world_size)
    ]
    if len(set(ids)) > 1:
        return _connect_hosts(boot, rank, world_size, seconds, ids, secret)
    if rank == 0:
        name = _C.unique_segment_name()
        boot.segment = name
        boot.set("segment", name)
        core = _C.Communicator(0, world_size, name, True, seconds, boot.check)
    else:
        name = boot.segment = boot.wait_for("segment", seconds)
        core = _C.Communicator(rank, world_size, name, False, seconds, boot.check)
    core.connect(boot.check)
    return core


def _hex(boot: Bootstrap, name: str, nbytes: int, take: bool) -> bytes:
    """The `nbytes` bytes that store key `name` holds in hexadecimal (taken:
    deleted once every rank read it); raises ValueError naming the key."""
    text = boot.take(name) if take else boot.get(name)
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != nbytes:
        raise ValueError(
            f"pycollectives: rank {boot.rank}: init: the store's {boot._key}/{name} is not "
            f"{nbytes} bytes in hexadecimal"
        )
    return value


def _connect_hosts(
    boot: Bootstrap,
    rank: int,
    world_size: int,
    seconds: float,
    ids: list[str],
    secret: bytes | None,
) -> Any:
    """The ranks span hosts: each host's first rank makes its segment (its
    name published as that rank 0 does on one host); rank 0 publishes its
    settings (PYCOLL_SLOT_BYTES, PYCOLL_NSLOTS, PYCOLL_ONESHOT_BYTES,
    PYCOLL_ALGO, resolved), which bind every host, the communicator's 128-bit
    random id, which every TCP handshake carries, whether the job's secret is
    PYCOLL_AUTH_KEY's and, if not, 32 random bytes for it (deleted once every
    rank read them); every rank listens, publishes its address and connects
    to the other hosts, each connection proving the secret (tcp_auth.h).
    Raises ValueError where rank 0 and this rank disagree on PYCOLL_AUTH_KEY."""
    first: dict[str, int] = {}
    for i in ids:
        first.setdefault(i, len(first))
    hosts = [first[i] for i in ids]
    me = hosts[rank]
    creator = hosts.index(me) == rank
    if rank == 0:  # "config" last: the others read the rest once it is there
        if secret is None:
            boot.set("authkey", os.urandom(STORE_BYTES).hex())
        boot.set("commid", os.urandom(16).hex())
        values = ",".join(str(v) for v in _C.resolved_config(world_size))
        boot.set("config", f"{values};{'env' if secret is not None else 'store'}")
    values, _, mode = boot.wait_for("config", seconds, "rank 0's settings").partition(";")
    try:
        config = tuple(int(v) for v in values.split(","))
    except ValueError:
        config = ()
    if len(config) != 4 or mode not in ("env", "store"):
        raise ValueError(
            f"pycollectives: rank {rank}: init: the store's {boot._key}/config is malformed"
        )
    if (mode == "env") != (secret is not None):
        raise ValueError(
            f"pycollectives: rank {rank}: init: {ENV_KEY} (or {ENV_FILE}) is set on "
            f"{'rank 0 but not on this rank' if mode == 'env' else 'this rank but not on rank 0'}:"
            " set it on every rank or on none"
        )
    if secret is None:
        secret = _hex(boot, "authkey", STORE_BYTES, take=True)
    comm_id = _hex(boot, "commid", 16, take=False)
    if creator:
        name = boot.segment = _C.unique_segment_name()
        boot.set(f"segment/{me}", name)
    else:
        what = f"the first rank of host {me} did not publish its segment's name"
        name = boot.segment = boot.wait_for(f"segment/{me}", seconds, what)
    args = (hosts, comm_id, _hint(), config, secret)
    core = _C.Communicator(rank, world_size, name, creator, seconds, boot.check, *args)
    boot.set(f"addr/{rank}", core.net_address)
    addrs = [
        boot.wait_for(f"addr/{r}", seconds, f"rank {r} did not publish its address")
        for r in range(world_size)
    ]
    core.connect(boot.check, addrs)
    return core


# Recovery (shrink across hosts, grow) makes communicators with these.
_recovery_hosts._RENDEZVOUS.update(init=init, grow=_grow)
