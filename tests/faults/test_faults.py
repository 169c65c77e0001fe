"""Bad input, mismatched collectives, dead and late peers, a full /dev/shm:
each raises a clear error on every rank, never a hang or a wrong result."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch
from fault_jobs import signal_done, wait_done
from spawn import run

import pycollectives as pc


class FakeCuda(torch.Tensor):
    """A CPU tensor that claims to live on a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_cpu(self) -> bool:
        return False


def expect(exc: type, fn, *words: str) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        assert not missing, f"message {msg!r} lacks {missing}"
        return msg
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def job_bad_input(comm: pc.Communicator) -> bool:
    r, n = comm.rank, comm.world_size
    f32, i32 = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    rk = f"rank {r}"
    expect(
        ValueError,
        lambda: comm.all_gather(torch.zeros(7), torch.zeros(4)),
        rk,
        "all_gather",
        "output",
    )
    expect(
        ValueError,
        lambda: comm.reduce_scatter(torch.zeros(3), torch.zeros(3 * n + 1)),
        rk,
        "reduce_scatter",
        "input",
    )
    expect(
        ValueError,
        lambda: comm.all_gather(i32, torch.zeros(8 // n if 8 % n == 0 else 1)),
        rk,
        "dtype",
    )
    expect(
        ValueError,
        lambda: comm.all_reduce(torch.zeros(4, 4).t()),
        rk,
        "all_reduce",
        "tensor",
        "contiguous",
    )
    expect(
        TypeError,
        lambda: comm.all_reduce(torch.zeros(3, dtype=torch.complex64)),
        rk,
        "tensor",
        "complex64",
    )
    expect(
        TypeError,
        lambda: comm.all_reduce(torch.zeros(3, dtype=torch.bool)),
        rk,
        "unsupported dtype",
    )
    expect(TypeError, lambda: comm.all_reduce([1, 2, 3]), rk, "tensor", "list")
    expect(ValueError, lambda: comm.all_reduce(f32, op=7), rk, "all_reduce", "op")
    expect(ValueError, lambda: comm.all_reduce(f32, op="sum"), rk, "op")
    # Without CUDA (or a device) the claim is refused as such; with them, the
    # address is found to be host memory.
    gpu = pc._buffers.cuda_built() and torch.cuda.is_available()
    expect(
        ValueError,
        lambda: comm.all_reduce(torch.zeros(3).as_subclass(FakeCuda)),
        rk,
        *(("tensor", "host memory") if gpu else ("CUDA", "without CUDA")),
    )
    expect(ValueError, lambda: comm.all_reduce(torch.zeros(3, device="meta")), rk, "meta")
    expect(ValueError, lambda: comm.broadcast(f32, n), rk, "broadcast", "src")
    expect(ValueError, lambda: comm.reduce(f32, -1), rk, "reduce", "dst")
    expect(ValueError, lambda: comm.send(f32, n + 3), rk, "send", "dst")
    expect(ValueError, lambda: comm.send(f32, r), rk, "send", "this rank")
    expect(ValueError, lambda: comm.recv(f32, r), rk, "recv", "this rank")
    expect(ValueError, lambda: comm.all_reduce(f32, timeout=-1), "timeout")
    big = torch.zeros(8 * n)
    expect(ValueError, lambda: comm.all_to_all(big, big), rk, "all_to_all", "overlap")
    expect(ValueError, lambda: comm.all_gather(big, big[1:9]), rk, "all_gather")
    # Nothing was communicated: the communicator still works.
    t = torch.ones(5)
    comm.all_reduce(t)
    return bool(torch.all(t == n))


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input_raises_before_communicating(pool, world_size):
    assert all(pool(world_size).run(job_bad_input))


def _mismatch(comm: pc.Communicator, rank: int, world_size: int, kind: str) -> str:
    comm.all_reduce(torch.ones(3))  # a matching op first
    if kind == "count":
        t = torch.ones(10 if rank == 0 else 20)
        call = lambda: comm.all_reduce(t)  # noqa: E731
    elif kind == "collective":
        t = torch.ones(100_000)
        call = (lambda: comm.all_reduce(t)) if rank == 0 else (lambda: comm.broadcast(t, 0))
    elif kind == "dtype":
        t = torch.ones(50_000, dtype=torch.float32 if rank == 0 else torch.float64)
        call = lambda: comm.all_reduce(t)  # noqa: E731
    else:  # barrier against a collective, on the last rank only
        t = torch.ones(1_000)
        call = (lambda: comm.barrier()) if rank == world_size - 1 else (lambda: comm.all_reduce(t))
    start = time.monotonic()
    msg = expect(pc.CollectiveMismatch, call, "#2")
    assert time.monotonic() - start < 5
    # The communicator is aborted: later calls raise too.
    expect(pc.PyCollectivesError, lambda: comm.all_reduce(torch.ones(1)))
    return msg


def _mismatches(rank: int, world_size: int, kinds: list[str]) -> dict[str, str]:
    """Each kind on a communicator of its own (a split of init's: a mismatch aborts it);
    {kind: the message, or the failure of that kind's checks}."""
    parent = pc.init(timeout=30)
    out = {}
    for kind in kinds:
        comm = parent.split(0)
        try:
            out[kind] = _mismatch(comm, rank, world_size, kind)
        except AssertionError as e:
            out[kind] = f"FAILED: {e!r}"
        comm.close()
    return out


MISMATCHES = {"count": 2, "collective": 2, "dtype": 3, "barrier": 3}  # kind: world size


@functools.cache
def _mismatch_messages(world_size: int) -> list[dict[str, str]]:
    """Every kind of MISMATCHES for this world size, in one set of ranks."""
    kinds = [k for k, n in MISMATCHES.items() if n == world_size]
    return run(_mismatches, world_size, kinds, timeout=60)


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatched_collectives_raise_on_every_rank(kind):
    msgs = [m[kind] for m in _mismatch_messages(MISMATCHES[kind])]
    want = {
        "count": ["count=10", "count=20"],
        "collective": ["all_reduce", "broadcast"],
        "dtype": ["float32", "float64"],
        "barrier": ["barrier", "all_reduce"],
    }[kind]
    for m in msgs:
        assert all(w in m for w in want), m


def _dies(rank: int, world_size: int, how: str) -> float:
    comm = pc.init(timeout=60)
    comm.barrier()
    if rank == world_size - 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    expect(
        pc.PeerFailure,
        lambda: comm.all_reduce(torch.ones(1 << 18)),
        f"rank {world_size - 1}",
        "died",
    )
    return time.monotonic() - start


@pytest.mark.parametrize("how,world_size", [("exit", 2), ("kill", 3)])
def test_dead_peer_detected_within_two_seconds(how, world_size):
    code = 3 if how == "exit" else -signal.SIGKILL
    times = run(_dies, world_size, how, timeout=60, expect_exit={world_size - 1: code})
    assert all(t < 2.0 for t in times[:-1]), times


def _late(rank: int, world_size: int, tmp: str) -> str:
    comm = pc.init(timeout=30)
    t = torch.ones(1000)
    if rank == 1:  # comes once rank 0 has timed out
        wait_done(f"{tmp}/timed_out")
        return expect(pc.CollectiveTimeout, lambda: comm.all_reduce(t), "Timed out")
    try:
        return expect(
            pc.CollectiveTimeout,
            lambda: comm.all_reduce(t, timeout=0.5),
            "all_reduce",
            "#1",
            "Timed out waiting 500ms for rank 1",
            "have not reached this operation: [1]",
        )
    finally:
        signal_done(f"{tmp}/timed_out")


def test_late_peer_times_out_naming_it(tmp_path):
    msgs = run(_late, 2, str(tmp_path), timeout=60)
    assert "reported by rank 0" in msgs[1]


def _no_leftovers(rank: int, world_size: int) -> list[str]:
    comm = pc.init(timeout=30)
    comm.barrier()
    pid0 = comm.split(0)  # a sub-communicator's segment is unlinked too
    comm.all_reduce(torch.ones(3))
    return [f for f in os.listdir("/dev/shm") if f.startswith("pycoll-")] if pid0 else []


def test_shared_memory_is_unlinked_after_init():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("pycoll-")}
    for left in run(_no_leftovers, 3, timeout=60):
        assert not set(left) - before


def test_dev_shm_too_small_says_how_to_fix(monkeypatch):
    from pycollectives import _C

    monkeypatch.setenv("PYCOLL_SLOT_BYTES", "1G")  # the largest slots, and the most of them
    monkeypatch.setenv("PYCOLL_NSLOTS", "1024")
    expect(
        pc.PyCollectivesError,
        lambda: _C.Communicator(0, 2, _C.unique_segment_name(), True, 5.0),
        "/dev/shm is too small",
        "--shm-size",
        "PYCOLL_SLOT_BYTES",
    )


def test_one_slot_per_connection_is_refused(monkeypatch):
    # The ring posts its next send before its last receive: with one slot every
    # rank waited for its successor to free it (an all-gather of 1 MiB per rank hung).
    from pycollectives import _C

    monkeypatch.setenv("PYCOLL_NSLOTS", "1")
    expect(
        ValueError,
        lambda: _C.Communicator(0, 2, _C.unique_segment_name(), True, 5.0),
        "PYCOLL_NSLOTS must be in [2, 1024], not 1",
    )


def _interrupted(rank: int, world_size: int, tmp: str) -> tuple:
    comm = pc.init(timeout=60)
    comm.barrier()
    t = torch.ones(1000)
    if rank == 0:
        try:
            return _interrupt(comm, t)
        finally:
            signal_done(f"{tmp}/interrupted")
    wait_done(f"{tmp}/interrupted")  # comes once rank 0 was interrupted (its test: within 2 s)
    try:
        comm.all_reduce(t)
    except pc.PyCollectivesError as e:
        return "peer", 0.0, str(e)
    return "peer", 0.0, "no error"  # rank 0's outcome says why (asserted first)


def _interrupt(comm: pc.Communicator, t: torch.Tensor) -> tuple:
    """Rank 0 waits for the late rank 1; Ctrl-C arrives meanwhile."""
    # Python's own handler, as in a terminal: a process started with SIGINT
    # ignored (a background job of a non-interactive shell) would keep it so.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        comm.all_reduce(t)
    except KeyboardInterrupt as e:
        return "KeyboardInterrupt", time.monotonic() - start, str(e)
    return "returned", time.monotonic() - start, ""


def test_ctrl_c_interrupts_a_blocking_call_and_aborts_the_peers(tmp_path):
    (what, waited, msg), (_, _, peer_msg) = run(_interrupted, 2, str(tmp_path), timeout=60)
    assert what == "KeyboardInterrupt" and waited < 2.0, (what, waited, msg, peer_msg)
    assert "rank 0 was interrupted" in msg and "all_reduce" in msg
    assert "rank 0 was interrupted" in peer_msg
