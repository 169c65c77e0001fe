"""monitored_barrier, as gloo runs it: every rank reports to rank 0 and waits
for its answer, so that rank 0 names the ranks that did not arrive in time
instead of everyone waiting for them (torch's debugging barrier).

torch.distributed.monitored_barrier calls only gloo's (it checks the backend's
name); this serves `group.monitored_barrier(timeout, wait_all_ranks)` called on
a pycoll group directly.
"""

from __future__ import annotations

import time

import torch

from ..communicator import Communicator
from ..errors import PyCollectivesError
from .args import Args


def monitored_barrier(c: Communicator, a: Args, timeout: float, wait_all_ranks: bool) -> None:
    """Rank 0 takes a message from every other rank (from any source, so the
    ranks are told apart as they arrive), then answers each; the others send
    and wait for the answer, all within `timeout` seconds.

    Raises RuntimeError with gloo's messages: on rank 0, "Rank 0 timed out in
    monitoredBarrier" when its time is up before it could wait at all, else
    naming the first rank that did not arrive (every such rank with
    `wait_all_ranks`); on the others, that rank 0 failed them. A timeout aborts
    the group's communicator, as the core's timeouts do."""
    ms = round(timeout * 1e3)
    if a.size == 1:
        return
    token = torch.zeros(1, dtype=torch.uint8)
    if a.rank != 0:
        try:
            c.send(token, 0, timeout=timeout)
            c.recv(token, 0, timeout=timeout)
        except PyCollectivesError as e:
            raise RuntimeError(
                f"Rank {a.rank} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. "
                f"({e})"
            ) from e
        return
    if timeout <= 0:
        raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms")
    deadline = time.monotonic() + timeout
    arrived: set[int] = set()
    error: PyCollectivesError | None = None
    while len(arrived) < a.size - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            arrived.add(c.recv(token, None, timeout=left))
        except PyCollectivesError as e:  # late ranks time the receive out
            error = e
            break
    missing = [r for r in range(1, a.size) if r not in arrived]
    if missing:
        if wait_all_ranks:
            names = ", ".join(map(str, missing))
            msg = f"Ranks {names} failed to pass monitoredBarrier in {ms} ms"
        else:
            msg = f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
        raise RuntimeError(a.err("monitored_barrier", msg)) from error
    for r in range(1, a.size):
        c.send(token, r, timeout=max(deadline - time.monotonic(), 1e-3))
