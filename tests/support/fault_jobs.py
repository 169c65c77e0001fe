"""The ranks' side of test_fault_injection.py: each function runs in every rank
(spawn.run, RankPool) and returns what the test checks, or raises."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
import types

import torch
import torch.distributed as dist

import pycollectives as pc
from pycollectives import _C, rendezvous


def caught(fn, *args, **kwargs) -> tuple[str, str, float]:
    """Runs fn; returns (exception class name or "ok", message, seconds taken)."""
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def own_segment_name() -> str:
    """The name of this process's communicator segment, from its mapping (the
    name itself is gone from /dev/shm)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/pycoll-" in line and ".w" not in line.split("/dev/shm/")[1]:
                return "/" + line.split("/dev/shm/")[1].split()[0]
    raise AssertionError("no communicator segment is mapped")


def signal_done(path: str) -> None:
    """Creates `path`: tells a peer waiting in wait_done() that this rank is past its part."""
    open(path, "w").close()


def wait_done(path: str, bound: float = 20.0) -> None:
    """Waits until `path` exists (a peer's signal_done), `bound` seconds at most: a peer
    that failed first leaves this rank to go on, as a fixed sleep did, instead of hanging."""
    deadline = time.monotonic() + bound
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def file_store(path: str, rank: int, n: int) -> pc.Communicator:
    return pc.init(rank, n, store=dist.FileStore(path, n), timeout=20)


# ---- pool jobs (the communicator stays usable) --------------------------------------------


def job_resized_storage(comm: pc.Communicator) -> list[tuple]:
    freed = torch.ones(1000)
    freed.untyped_storage().resize_(0)  # as FSDP frees a parameter
    shrunk = torch.ones(1 << 16)
    shrunk.untyped_storage().resize_(1024)
    view = torch.ones(1 << 16)[1024:]  # in bounds at an offset: accepted
    out = [caught(comm.all_reduce, freed), caught(comm.all_reduce, freed, async_op=True)]
    out.append(caught(comm.broadcast, freed, 0))
    out.append(caught(comm.broadcast, shrunk, 0, timeout=10))  # the Python path's full check
    out.append(caught(comm.all_gather, torch.empty(2 * 1000), freed))
    comm.all_reduce(view)
    t = torch.ones(4)
    comm.all_reduce(t)  # nothing was communicated: the communicator still works
    return out + [("sum", str(t[0].item()), 0.0)]


def job_timeouts(comm: pc.Communicator) -> list[tuple]:
    n, out = comm.world_size, []
    for timeout in (float("inf"), 1e300, datetime.timedelta.max, 10**400):
        if comm.rank == 1:
            time.sleep(0.2)  # the peer waits: an infinite timeout must not expire at once
        t = torch.ones(8)
        out.append(caught(comm.all_reduce, t, timeout=timeout) + (t[0].item() == n,))
    t = torch.ones(8)
    w = comm.all_reduce(t, async_op=True)
    out.append(("wait(inf)", str(w.wait(timeout=float("inf"))), 0.0, t[0].item() == n))
    out.append(caught(comm.all_reduce, t, timeout=float("nan")) + (True,))
    out.append(caught(w.wait, float("nan")) + (True,))
    return out


def job_second_thread(pool_comm: pc.Communicator) -> tuple:
    # A communicator of its own: a strategy given the pool's one lets any thread issue
    # (pycollectives.strategies.autograd_threads).
    comm = pool_comm.split(0, key=pool_comm.rank)
    comm.all_reduce(torch.ones(4))  # this thread issues first
    result: list = []
    th = threading.Thread(target=lambda: result.append(caught(comm.all_reduce, torch.ones(4))))
    th.start()
    th.join()
    t = torch.ones(4)
    comm.all_reduce(t)  # the refused call communicated nothing
    comm.close()
    return result[0], t[0].item()


def job_predictable_window_names(comm: pc.Communicator) -> tuple:
    """Another user (here: this one) creates the window names the library once
    derived from the segment's name; alloc_shared must not depend on them."""
    seg = own_segment_name()
    planted = []
    for wid in range(64):
        for r in range(comm.world_size):
            path = f"/dev/shm{seg}.w{wid}.{r}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            os.close(fd)
            planted.append(path)
    comm.barrier()
    try:
        result = caught(comm.alloc_shared, 1024)
    finally:
        comm.barrier()
        for path in planted:
            os.unlink(path)
    return result


def job_ptracer(rank: int, n: int) -> list:
    comm = pc.init(timeout=20)
    pids = torch.zeros(n, dtype=torch.int64)
    comm.all_gather(pids, torch.tensor([os.getpid()]))
    out = [comm.single_copy, _C.ptracer()[0], int(pids[1 - rank])]
    if rank == 1:
        os.environ["PYCOLL_CMA"] = "0"  # this rank will not take single copy in the child
    child = comm.split(0)
    comm.close()  # the grant of the parent goes; the child, without single copy, has none
    out += [child.single_copy, _C.ptracer()[0]]
    child.close()
    return out


# ---- spawned jobs -------------------------------------------------------------------------


def job_store_listener(rank: int, n: int, listeners) -> tuple[set[str], int]:
    """Rank 0 of 2 whose peer never comes: init serves the bootstrap store, then
    times out. A thread meanwhile reads which local addresses listen on
    MASTER_PORT (`listeners(port)`). Returns (those addresses, this pid)."""
    port = int(os.environ["MASTER_PORT"])
    os.environ["WORLD_SIZE"] = "2"
    found: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 20
        while not found and not stop.is_set() and time.monotonic() < deadline:
            found.update(listeners(port))
            time.sleep(0.05)

    th = threading.Thread(target=watch)
    th.start()
    kind, msg, _ = caught(pc.init, timeout=1.5)  # removes its segment when it times out
    stop.set()
    th.join()
    assert kind != "ok", "init of 2 ranks succeeded alone"
    return found, os.getpid()


def job_init_failures(rank: int, n: int, tmp: str) -> list[tuple]:
    """Init fails on rank 0, then rank 1 (a bad setting), then /dev/shm is too
    small for rank 0; then a split leader cannot create the child."""
    out = []
    bad = {"PYCOLL_SLOT_BYTES": "12 parsecs"}
    for step, (who, env) in enumerate(
        [(0, bad), (1, bad), (0, {"PYCOLL_SLOT_BYTES": "1G", "PYCOLL_NSLOTS": "1024"})]
    ):
        saved = dict(os.environ)
        if rank == who:
            os.environ.update(env)
        try:  # the first init serves its own TCPStore (rank 0), as under torchrun
            if step == 0:
                out.append(caught(pc.init, timeout=20))
            else:
                out.append(caught(file_store, f"{tmp}/store{step}", rank, n))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    comm = file_store(f"{tmp}/store-split", rank, n)
    if rank == 0:
        os.environ["PYCOLL_SLOT_BYTES"] = "-1"
    out.append(caught(comm.split, 0))
    return out


def job_mismatches(rank: int, n: int) -> list[tuple]:
    """Each on its own sub-communicator (a mismatch aborts one)."""
    comm = pc.init(timeout=20)
    out = []
    for nbytes in (16 << 10, 1 << 20):  # one-shot, then the chain (or single copy)
        c = comm.split(0)
        t = torch.full((nbytes // 4,), float(rank))
        out.append(caught(c.broadcast, t, rank, timeout=10))  # every rank says it is the root
    c = comm.split(0)
    out.append(caught(c.alloc_shared, 1024 * (rank + 1), timeout=10))
    return out


def job_yield(rank: int, n: int, tmp: str) -> tuple:
    comm = pc.init(timeout=20)
    comm.barrier()
    if rank == 1:  # comes once rank 0 has timed out
        wait_done(f"{tmp}/timed_out")
        return caught(comm.all_reduce, torch.ones(1000))
    try:
        return caught(comm.all_reduce, torch.ones(1000), timeout=0.5)
    finally:
        signal_done(f"{tmp}/timed_out")


def job_yield_budget(rank: int, n: int) -> list[float]:
    """Rank 0 waits ~0.3 s for rank 1 in an all-reduce on two communicators: one made with
    PYCOLL_YIELD_US=0 (it sleeps once its spin is over), one split from it after the setting
    became 10 s (it yields throughout). Returns this rank's CPU seconds in each call."""
    os.environ["PYCOLL_YIELD_US"] = "0"
    comm = pc.init(timeout=20)
    os.environ["PYCOLL_YIELD_US"] = "10000000"
    yielding = comm.split(0)  # the setting is read per communicator
    cpu = []
    for c in (comm, yielding):
        c.barrier()
        if rank == 1:
            time.sleep(0.3)
        t0 = time.process_time()
        c.all_reduce(torch.ones(1000))
        cpu.append(time.process_time() - t0)
    yielding.close()
    comm.close()
    return cpu


def job_close_pending(rank: int, n: int, tmp: str) -> tuple:
    """close() with work pending: work its peers come to finishes (a peer
    0.3 s late), work a peer stays away from is aborted after a second."""
    comm = pc.init(timeout=20)
    both = comm.split(0)
    if rank == 1:
        time.sleep(0.3)
    ts = [torch.ones(1 << 16) for _ in range(3)]
    works = [both.all_reduce(t, async_op=True) for t in ts]
    both.close()
    finished = [w.exception() is None and t[0].item() == n for w, t in zip(works, ts, strict=True)]
    comm.barrier()
    if rank == 1:
        wait_done(f"{tmp}/closed")  # alive, and not in the operation, until rank 0 closed
        return caught(comm.all_reduce, torch.ones(8))
    w = comm.all_reduce(torch.ones(8), async_op=True)
    t0 = time.monotonic()
    try:
        comm.close()
    finally:
        signal_done(f"{tmp}/closed")
    return time.monotonic() - t0, type(w.exception()).__name__, str(w.exception()), finished


def job_interrupted(rank: int, n: int, tmp: str) -> list[tuple]:
    """Ctrl-C in Work.wait(), then in a synchronous call queued behind async work."""
    comm = pc.init(timeout=20)
    other = comm.split(0)
    comm.barrier()
    if rank == 1:
        wait_done(f"{tmp}/interrupted")  # late for both: comes once rank 0 is done
        return [caught(comm.all_reduce, torch.ones(8)), caught(other.all_reduce, torch.ones(8))]
    try:
        return _interrupt_twice(comm, other)
    finally:
        signal_done(f"{tmp}/interrupted")


def _interrupt_twice(comm: pc.Communicator, other: pc.Communicator) -> list[tuple]:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    out = []
    for c, sync_behind in ((comm, False), (other, True)):
        w = c.all_reduce(torch.ones(8), async_op=True)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        if sync_behind:
            out.append(caught(c.all_reduce, torch.ones(8)))
        else:
            out.append(caught(w.wait))
    return out


def job_stopped(rank: int, n: int, victim: int, in_op: bool) -> str | None:
    """Rank 0 stops `victim` (SIGSTOP), before it reaches the operation or in
    it; the timeout must name the victim, not a neighbour waiting for it."""
    comm = pc.init(timeout=20)
    pids = torch.zeros(n, dtype=torch.int64)
    comm.all_gather(pids, torch.tensor([os.getpid()]))
    t = torch.ones((512 << 10) // 4)
    if rank == victim:
        if in_op:
            comm.all_reduce(t)  # stopped inside it
        time.sleep(60)
        return None
    if rank == 0:
        time.sleep(0.3 if in_op else 0.0)
        os.kill(int(pids[victim]), signal.SIGSTOP)
    else:
        time.sleep(0.6)  # rank 0 starts first, and times out first
    try:
        comm.all_reduce(t, timeout=1.5)
    except pc.CollectiveTimeout as e:
        return str(e)
    finally:
        if rank == 0:
            os.kill(int(pids[victim]), signal.SIGKILL)
    return "no timeout"


def job_killed_at(rank: int, n: int, victim: int, step: str, tmp: str) -> tuple:
    """`victim` dies at set-up step `step`; the others must say so at once.
    Steps: "create" (rank 0, as it is about to create the segment), "connect"
    (after constructing, before connecting), "window.timer" (30 ms into a
    512 MiB alloc_shared, wherever that is), else one of the core's fault
    points (PYCOLL_TEST_KILL_AT: segment.created, window.created, window.mapped)."""
    with open(f"{tmp}/pid{rank}", "w") as f:
        f.write(str(os.getpid()))

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if step == "create":
            names = _C.unique_segment_name
            rendezvous._C = types.SimpleNamespace(
                Communicator=die, unique_segment_name=names, host_id=_C.host_id
            )
        elif step == "connect":
            _C.Communicator.connect = die
        elif not step.startswith("window.timer"):
            os.environ["PYCOLL_TEST_KILL_AT"] = step
    init = lambda: file_store(f"{tmp}/store", rank, n)  # noqa: E731
    if not step.startswith("window."):
        return caught(init)
    comm = init()
    if rank == victim and step == "window.timer":
        threading.Timer(0.03, die).start()
    return caught(comm.alloc_shared, 1 << 27)  # 512 MiB of float32


def job_other_user(rank: int, n: int) -> tuple:
    """Rank 1 runs as another user: it must refuse rank 0's segment, naming its
    owner, and rank 0 must hear why at once."""
    if rank == 1:
        os.setuid(65534)
    return caught(pc.init, timeout=20)


def job_yama(rank: int, n: int) -> tuple:
    """Under Yama (ptrace_scope 1), as an unprivileged user: a process that is
    not a rank (here a child of rank 0) must not be able to read rank 0's
    memory, whether single copy is on (the grant names the peer only) or off
    (no grant at all). Returns (single copy on, errno of each read)."""
    import ctypes

    os.setgid(65534)
    os.setuid(65534)
    if rank == 1:
        os.environ["PYCOLL_CMA"] = "0"
    comm = pc.init(timeout=20)  # single copy off: no grant at all
    os.environ.pop("PYCOLL_CMA", None)
    child = comm.split(0)  # single copy on: a grant to the peer only
    word = ctypes.c_uint64(42)
    out = [child.single_copy, comm.single_copy]
    for c in (comm, child):
        c.barrier()
        if rank == 0:
            out.append(_read_from_child(os.getpid(), ctypes.addressof(word)))
        c.barrier()
    return tuple(out)


def _read_from_child(pid: int, addr: int) -> int:
    """errno of process_vm_readv(pid, addr) done by a fresh child (0: it read)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        buf = ctypes.c_uint64(0)
        local, remote = Iovec(ctypes.addressof(buf), 8), Iovec(addr, 8)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        os.write(w, str(0 if got == 8 else ctypes.get_errno()).encode())
        os._exit(0)
    os.waitpid(child, 0)
    return int(os.read(r, 16))
