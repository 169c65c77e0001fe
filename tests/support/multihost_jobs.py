"""Running ranks on hosts made of network namespaces (netns.py): `run_on_hosts`
starts one process per rank with spawn.run, each moved into its host's
namespace before it imports anything that opens a socket, then calls
job(comm, *args) on a communicator made by pycollectives.init (the torchrun
way: MASTER_ADDR is host 0's address, where rank 0 serves the store). With
`tree`, the ranks import pycollectives from that source tree instead (an A/B
against another build: benchmarks/multihost/multihost_ab.py)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import netns
import spawn


def _on_host(
    rank: int,
    world_size: int,
    hosts: list[str],
    layout: list[int],
    env: dict[str, str],
    init_timeout: float,
    job: Callable,
    args: tuple,
) -> Any:
    netns.enter(hosts[layout[rank]])
    os.environ.update(env)
    v6 = env.get("PYCOLL_SOCKET_FAMILY") == "AF_INET6"
    os.environ["MASTER_ADDR"] = netns.addr(layout[0], v6)
    import pycollectives as pc

    comm = pc.init(timeout=init_timeout)
    try:
        return job(comm, *args)
    finally:
        comm.close()


def _on_host_from(rank: int, world_size: int, tree: str, module: str, name: str, *rest: Any) -> Any:
    """_on_host with pycollectives (and the job's module, named, not pickled:
    unpickling it would import pycollectives first) imported from `tree`."""
    sys.path.insert(0, tree)
    job = getattr(importlib.import_module(module), name)
    hosts, layout, env, init_timeout, args = rest
    return _on_host(rank, world_size, hosts, layout, env, init_timeout, job, args)


def run_on_hosts(
    fabric: netns.Fabric,
    layout: list[int],
    job: Callable,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    init_timeout: float = 30.0,
    expect_exit: dict[int, int] | None = None,
    tree: str | None = None,
) -> list[Any]:
    """Runs job(comm, *args) on len(layout) ranks, rank r on host layout[r];
    returns their results in rank order (spawn.run raises RankError if any
    rank fails, dies or hangs). `tree`: a source tree (built in place) the
    ranks import pycollectives from; the job, a module-level function, is then
    imported by name in the ranks after the tree is put first on sys.path, and
    the calling script must not import pycollectives at its top level (spawned
    ranks import the main script first)."""
    if tree:
        return spawn.run(
            _on_host_from,
            len(layout),
            tree,
            job.__module__,
            job.__name__,
            fabric.hosts,
            layout,
            dict(env or {}),
            init_timeout,
            args,
            timeout=timeout,
            expect_exit=expect_exit,
        )
    return spawn.run(
        _on_host,
        len(layout),
        fabric.hosts,
        layout,
        dict(env or {}),
        init_timeout,
        job,
        args,
        timeout=timeout,
        expect_exit=expect_exit,
    )
