"""Runs the ranks of a program on this host, as the examples do when they are
not started by torchrun, and ends a rank's run the way a user expects.

`run_rank(main, prog)` runs one rank: Ctrl-C prints one line and exits 130
(its communicators aborted, so the peers say that this rank was interrupted);
a pycollectives or strategies error prints one line naming the rank and
exits 1. `spawn(target, n, prog=...)` starts n ranks (as `torchrun
--nproc-per-node n` does), forked from a server that imported torch once
(_context), and, once a rank has failed, ends the
others after a grace period, so that a stopped or hung rank cannot hold the
launcher; it returns the first failure's exit status and prints its message.
With `survive`, a rank killed by a signal is left behind (the others go on
without it) or, with `replace=N`, replaced by a new process (at most N): the
launcher then serves the job's store itself, so that it outlives every rank
(`launcher_store()` in the ranks), and a replacement finds the rank it
replaces in `replacing()` and tells the launcher the place it took in
`took_place()` (ParallelDims.join does: with several lost at once the first
to join takes the lowest, not necessarily the one it was started for).
"""

from .rank import (
    INTERRUPTED,
    REPLACES_ENV,
    STORE_ENV,
    launcher_store,
    replacing,
    run_rank,
    took_place,
)
from .run import FENCED, PRELOAD, spawn

__all__ = [
    "FENCED",
    "INTERRUPTED",
    "PRELOAD",
    "REPLACES_ENV",
    "STORE_ENV",
    "launcher_store",
    "replacing",
    "run_rank",
    "spawn",
    "took_place",
]
