"""What a Communicator is besides its operations and their argument checks
(communicator.py, the one module above this): the C++ core it drives, how an
operation is issued on it (CPU or CUDA buffers, or across hosts pinned host
copies of CUDA ones: _staging.py) and its buffers kept alive while in flight,
its symmetric shared-memory windows (alloc_shared), what it reports (stats, hosts, single copy, ...) and its lifetime (close,
abort, closing every open one at exit, and recovery from a lost rank: revoke, agree, shrink)."""

from __future__ import annotations

import atexit
import collections
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import _C, _recovery_hosts
from ._recovery import Agreement, failed_ranks, verdict_names
from ._staging import Staged, Stager, TorchCudaOps, cache_bytes_from_env
from .work import CudaWork, Timeout, Work, to_seconds

Buffer = Any  # torch.Tensor | numpy.ndarray | an object with __cuda_array_interface__

_live: weakref.WeakSet = weakref.WeakSet()  # closed at exit: see _close_all_at_exit


class CommunicatorBase:
    """A Communicator's core, state, windows, reports and lifetime, and how its
    operations are issued (communicator.Communicator adds them, checking their
    arguments)."""

    def __init__(self, core: Any) -> None:
        self._c = core
        self._fast = _C.fast_path(core)  # synchronous CPU-tensor calls without pybind11
        self.rank: int = core.rank
        self.world_size: int = core.world_size
        # (core work, buffers) of asynchronous operations not known to be done:
        # the buffers stay alive until the operation completes, even if the
        # caller drops its Work (the progress thread still reads and writes them).
        self._inflight: collections.deque = collections.deque()
        self._cuda_device: int | None = None  # set by the first CUDA operation
        # Ranks on several hosts: CUDA buffers go through pinned host copies (_staging.py).
        self._across_hosts = any(core.host_of)
        self._stager: Stager | None = None  # made by the first staged operation
        # all_reduce_coalesced's window buckets, by (shapes and dtypes, cap): _fusion.py
        self._coalesced_buckets: dict = {}
        self._on_close: list[Any] = []  # run once by close() (rendezvous/: the caller's store)
        # Across hosts: agree/shrink's key and store (set by init; _recovery_hosts.py).
        self._host_recovery: _recovery_hosts.HostRecovery | None = None
        self._splits = 0  # split() calls so far: the same on every rank (each is collective)
        _live.add(self)

    def _issue_from_any_thread(self) -> None:
        """Lets any thread issue operations: the caller serializes its calls (the
        torch backend does, under its lock). By default only the first thread
        that issues one may (a second raises ValueError)."""
        self._c.set_any_thread(True)

    # -- the epilogues of the operations on buffers (their prologue: communicator.py)
    def _issue(
        self, name: str, args: tuple, keep: tuple, cuda: Any, async_op: bool, timeout: Timeout
    ) -> Work | None:
        """Runs the core's operation `name` on described buffers: core.name(*args,
        async_op, timeout) on CPU ones, _C.cuda_name(core, *args, device, stream,
        async_op, timeout) on CUDA ones. Keeps `keep` (the buffers) alive until it
        completes; returns its Work (None for a synchronous call, which on CUDA
        makes the current stream wait for it)."""
        to = to_seconds(timeout)
        if cuda is None:
            return self._ret(getattr(self._c, name)(*args, async_op, to), *keep)
        dev, stream = cuda
        work = getattr(_C, f"cuda_{name}")(self._c, *args, dev, stream(), async_op, to)
        self._keep(work, keep)
        if async_op:
            return CudaWork(work, self, stream)
        work.wait_stream(stream(), -1.0)
        return None

    def _ret(self, work: Any, *buffers: Buffer) -> Work | None:
        """The Work of the core's CPU operation `work`, keeping `buffers` alive
        until it completes; None for a synchronous call."""
        if work is None:
            return None
        self._keep(work, buffers)
        return Work(work, self)

    def _stage(self, bufs: Sequence[Staged], call: Callable[[list, bool], Any], a: bool) -> Any:
        """Across hosts: runs call(host buffers, async_op), the CPU operation, on
        pinned host copies of the CUDA buffers `bufs` (see _staging.Stager.run);
        returns its result, or a StagedWork with async_op."""
        if self._stager is None:
            self._stager = Stager(TorchCudaOps(), cache_bytes_from_env(self.rank))
        return self._stager.run(self, bufs, call, a)

    def _stage_pair(self, output: Buffer, input: Buffer, call: Callable, a: bool) -> Any:  # noqa: A002
        """_stage() for call(output, input, async_op), reading `input` and writing `output`."""
        bufs = [Staged(output, "output", False, True), Staged(input, "input", True, False)]
        return self._stage(bufs, lambda h, a: call(h[0], h[1], a), a)

    def _keep(self, work: Any, buffers: tuple) -> None:
        """Keeps `buffers` alive until the core's `work` completes."""
        self._prune()
        self._inflight.append((work, buffers))

    def _prune(self) -> None:
        """Drops the buffers of operations that completed (they complete in order)."""
        inflight = self._inflight
        while inflight and inflight[0][0].is_completed():
            inflight.popleft()

    def alloc_shared(
        self, shape: int | Sequence[int], dtype: Any = None, *, timeout: Timeout = None
    ) -> Any:
        """Collective: returns a zero-filled CPU torch tensor of `shape` and
        `dtype` (default float32) in a symmetric shared-memory window: every
        rank allocates the same size and maps every peer's buffer. An
        all_reduce of the tensor, a reduce_scatter whose input or an
        all_gather whose output it is (the same view on every rank) then runs
        in place across the ranks' buffers with no copy through the
        transport's slots (as NCCL's registered buffers). The memory lives as
        long as any tensor viewing it. Every rank must call it with the same
        size, in the same order as its other collectives.

        Raises ValueError for a negative size or an unsupported dtype, and the
        communicator's errors (e.g. /dev/shm too small) on every rank.
        """
        import torch

        dtype = torch.float32 if dtype is None else dtype
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(
                f"pycollectives: rank {self.rank}: alloc_shared: shape={shape!r} must be "
                "non-negative ints"
            )
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
            raise ValueError(
                f"pycollectives: rank {self.rank}: alloc_shared: dtype={dtype!r} is not supported"
            )
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        win = self._c.alloc_window(nbytes, to_seconds(timeout))
        flat = torch.frombuffer(win, dtype=torch.uint8, count=nbytes) if nbytes else None
        if flat is None:
            return torch.zeros(shape, dtype=dtype)
        return flat.view(dtype).view(shape)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-operation counters: calls, bytes_sent, bytes_received, time_s, paths, taken_over.

        ``paths`` counts the calls by how they moved their bytes: ``"slots"``
        (ring, chain or pairwise schedules through the shared slots),
        ``"oneshot"`` (small messages through the one-shot areas),
        ``"direct"`` (in place across symmetric windows, see `alloc_shared`, or, for
        CUDA buffers, across the peers' own buffers mapped with CUDA IPC) or
        ``"cma"`` (single copy between the peers' plain buffers, see `single_copy`).
        Across hosts: ``"hierarchical"`` (within each host, then across hosts
        by the hosts' ranks in parallel, or the reverse) or ``"flat"`` (one
        ring or chain over every rank, host by host: ``PYCOLL_ALGO=ring``).
        ``taken_over`` counts the single-copy chunks this rank did for another
        rank's part because that rank had not claimed them yet (it was
        descheduled or slower).
        """
        return self._c.stats()

    def cma_tuning(self) -> dict[str, dict[int, dict[str, Any]]]:
        """What this rank's single-copy tuner measured and decided, per operation name
        and size class (a power of two of bytes, the class ``[b, 2b)`` keyed by ``b``):
        ``{"decided": "cma" | "slots" | None (still timing), "cma_ns_per_byte",
        "slots_ns_per_byte"}``, the best time per byte of each path's timed calls
        (None before one ran). Only classes inside the single-copy bands that ran an
        operation appear; empty with ``PYCOLL_CMA_TUNE=0`` or without single copy.
        Each rank decides on its own timings (docs/api.md, "Single copy").
        """
        return self._c.cma_tuning()

    @property
    def algorithm(self) -> str:
        """The PYCOLL_ALGO setting in force (rank 0's): auto, ring, oneshot or cma."""
        return self._c.algo

    @property
    def single_copy(self) -> bool:
        """Whether ranks read and write each other's plain buffers directly (CMA).

        Decided at init, alike on every rank: true when every rank could read
        and write every peer with ``process_vm_readv``/``process_vm_writev``
        (same user, ptrace allowed, not refused by seccomp) and neither
        ``PYCOLL_CMA=0`` nor ``PYCOLL_ALGO`` ``ring``/``oneshot`` is set. Where
        it is false, the slots carry everything.
        """
        return self._c.cma

    @property
    def hosts(self) -> list[int]:
        """Every rank's host (hosts numbered in the order of their lowest
        rank): ranks of one host share memory, ranks of different hosts talk
        over TCP. All zeros on one host."""
        return list(self._c.host_of)

    def net_info(self) -> dict[str, Any]:
        """Across hosts, this rank's TCP side: ``address`` ("ip:port" it
        listens on), ``interface``, ``rejected`` (connections refused: failed
        handshakes, evicted or expired pending ones), ``listening`` (whether
        the port is still open: it closes once every expected connection is
        in), ``control_buffer_peak`` (bytes), ``bytes_sent`` /
        ``bytes_received`` (payload to and from other hosts). Empty address
        and zeros on one host."""
        return dict(self._c.net_info())

    def close(self) -> None:
        """Releases the communicator (idempotent). Pending operations run on,
        but one that a peer stays away from for a second, idle, is aborted
        (its peers raise too) rather than left to its timeout; a warning names
        each pending operation that failed (its Work raises the error)."""
        failed = self._c.close()
        self._inflight.clear()
        if self._host_recovery is not None and self._host_recovery.lost:
            self._on_close.clear()  # the store is out of reach: waiting on it would hang
        while self._on_close:
            self._on_close.pop()()
        for msg in failed:
            warnings.warn(
                f"pycollectives: rank {self.rank}: close(): a pending {msg}",
                RuntimeWarning,
                stacklevel=2,
            )

    def abort(self, reason: str) -> None:
        """Aborts the communicator on every rank, as ncclCommAbort: their
        pending and later operations raise CommunicatorAborted with
        "pycollectives: <reason>" (the first abort wins). For a rank that stops
        for a reason of its own, such as Ctrl-C in Python code, so that its
        peers say why instead of waiting for it. A no-op once closed."""
        self._c.abort(f"pycollectives: {reason}")

    @property
    def aborted(self) -> bool:
        """Whether the communicator is aborted (an error, a timeout, a dead or
        interrupted peer, abort()): every operation on it raises."""
        return bool(self._c.aborted)

    # -- recovery from a lost rank (docs/recovery.md; the core: csrc/comm/recovery.cc)

    def revoke(self, reason: str = "") -> None:
        """Revokes the communicator on every rank (MPIX_Comm_revoke): their
        pending and later operations raise CommunicatorRevoked at once, naming
        this rank and `reason`. agree() and shrink() still work on it: the
        way out is shrink() (or close()). Raises CommunicatorAborted once closed."""
        if not isinstance(reason, str):
            raise TypeError(f"pycollectives: rank {self.rank}: revoke: reason must be a str")
        why = f": {reason}" if reason else ""
        self._c.revoke(f"pycollectives: rank {self.rank} revoked the communicator{why}")

    def _across(self, store: Any, what: str) -> _recovery_hosts.HostRecovery:
        """Across hosts: the agreements' state, with `store` if given (else
        init's). Raises ValueError if there is no store to agree through."""
        rec = self._host_recovery
        if rec is None:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {what}: across hosts, recovery works on a "
                "communicator made by pycollectives.init or shrink (a split one: shrink the "
                "parent and split it again)"
            )
        if store is not None:
            rec.store = store
        if rec.store is None:
            raise ValueError(
                f"pycollectives: rank {self.rank}: {what}: across hosts the survivors agree "
                "through the job's store: pass store= (the same on every rank), or make the "
                "communicator with pycollectives.init(store=...)"
            )
        return rec

    def agree(
        self, flag: bool | int = True, *, timeout: Timeout = None, store: Any = None
    ) -> Agreement:
        """Fault-tolerant agreement (MPIX_Comm_agree), collective over the ranks
        that did not fail in an earlier one: every survivor returns the same
        Agreement, the AND of the survivors' flags (bitwise, of 32-bit
        non-negative ints) and the same failed ranks, whoever dies meanwhile.
        Works on an aborted or revoked communicator. A rank that does not enter
        within `timeout` (default: the communicator's) is declared
        unresponsive and fenced; once a rank failed, the communicator is revoked.
        Across hosts it runs through the job's store (`store`, default the one
        given to pycollectives.init; _recovery_hosts.py).

        Raises ValueError for a flag outside [0, 2**32) (or, across hosts, no
        store), CommunicatorAborted on a rank that was fenced (it must leave
        the job), and PyCollectivesError across hosts if the store fails."""
        is_bool = isinstance(flag, bool)
        if not isinstance(flag, int) or not 0 <= int(flag) < 1 << 32:
            raise ValueError(
                f"pycollectives: rank {self.rank}: agree: flag={flag!r} must be a bool or an "
                "int in [0, 2**32)"
            )
        seconds = to_seconds(timeout)
        if self._across_hosts:
            rec = self._across(store, "agree")
            t = seconds if seconds > 0 else self._c.default_timeout
            value, codes = _recovery_hosts.agree(self, rec, int(flag), t)
        else:
            value, codes = self._c.agree(int(flag), seconds)
        return Agreement(
            bool(value) if is_bool else value, failed_ranks(codes), verdict_names(codes)
        )

    def shrink(self, *, timeout: Timeout = None, store: Any = None) -> Any:
        """Collective (MPIX_Comm_shrink): returns a new Communicator of the ranks
        that did not fail, renumbered in the order of their ranks here; its
        `parent_ranks` holds each new rank's rank here, `failed` the ranks that
        failed. Works on an aborted or revoked communicator (close this one
        afterwards). A rank that dies or stops (past `timeout`) while the
        survivors build it is left out too, in another round; every round is
        bounded (about three timeouts), and each but the last loses a rank.
        Across hosts the survivors agree and meet through the job's store
        (`store`, default init's): new segments, new TCP connections.

        Raises CommunicatorAborted on a fenced rank, and on every survivor
        alike PyCollectivesError if the survivors could not build it (across
        hosts: or the store failed)."""
        seconds = to_seconds(timeout)
        if self._across_hosts:
            rec = self._across(store, "shrink")
            t = seconds if seconds > 0 else self._c.default_timeout
            comm, survivors, codes = _recovery_hosts.shrink(self, rec, t)
        else:
            child, survivors, codes = self._c.shrink(seconds)
            comm = type(self)(child)  # a Communicator, which derives from this class
        comm.parent_ranks = tuple(survivors)
        comm.failed = failed_ranks(codes)
        return comm

    def grow(
        self, store: Any, new_ranks: int, *, timeout: Timeout = None, prefix: str = "pycoll-grow"
    ) -> Any:
        """Collective over this communicator's ranks: returns a new Communicator
        of these ranks (same ranks, 0..n-1) and `new_ranks` replacement
        processes (n..), each of which calls pycollectives.join(store) with the
        same `store` and `prefix` (rendezvous/grow.py). For a communicator
        that lost ranks and shrank: the newcomers take their places. This one
        stays usable (close it when done). `timeout` (default: the
        communicator's) bounds the wait for the newcomers.

        Raises ValueError for new_ranks < 1 or an empty prefix, and init's
        errors (CollectiveTimeout if the newcomers do not come)."""
        seconds = to_seconds(timeout)
        t = seconds if seconds > 0 else self._c.default_timeout
        return _recovery_hosts.rendezvous("grow")(self, store, new_ranks, t, prefix)

    def __repr__(self) -> str:
        return f"<pycollectives.Communicator rank={self.rank} world_size={self.world_size}>"


def abort_all_interrupted() -> None:
    """Aborts every open communicator of this process saying "rank R was
    interrupted (SIGINT)", R this process's rank in each (see
    Communicator.abort): what Ctrl-C does to a rank's peers."""
    for comm in list(_live):
        comm.abort(f"rank {comm.rank} was interrupted (SIGINT)")


@atexit.register
def _close_all_at_exit() -> None:
    """Closes the communicators still open at exit, while Python still runs: a
    pending operation is then aborted (or finishes) and reported, instead of
    holding the exit until its timeout. Exiting on Ctrl-C (an uncaught
    KeyboardInterrupt), it first aborts them saying so: the peers then report
    the interrupt, not a closed communicator or a mismatch."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        abort_all_interrupted()
    for comm in list(_live):
        comm.close()
