"""Single-copy collectives on plain buffers (CMA, csrc/algo/cma.cc): every
collective, op, dtype, size and root exact when forced (PYCOLL_ALGO=cma), chunks taken over from
ranks that do not run, the size bands, the tuner that keeps the faster path
inside them, the slots when PYCOLL_CMA=0, mismatched calls at CMA sizes, and a
peer that dies while the others copy into and out of its process."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch
from spawn import run
from test_windows import _path, _reference, _vals

import pycollectives as pc


def _forced(pool, world_size: int, job: Callable[[pc.Communicator], object]) -> list:
    """Runs job on world_size ranks under PYCOLL_ALGO=cma (one pool per world size, shared
    by this module's forced tests: the `pool` fixture); skips where the job returned None
    (CMA is not allowed between the ranks here)."""
    results = pool(world_size, {"PYCOLL_ALGO": "cma"}).run(job, timeout=240)
    if results[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here")
    return results


def job_cma_forced(comm: pc.Communicator) -> list[str] | None:
    """PYCOLL_ALGO=cma: all-reduce, reduce-scatter and all-gather of every size
    take the single-copy path, exact for every op and dtype, in place and not."""
    n, r, bad = comm.world_size, comm.rank, []
    if not comm.single_copy:
        return None
    for count in (0, 1, 7, 1000, (1 << 18) + 3):
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64):
            want_path = "cma" if count > 0 else "slots"
            vals = [v.to(dt) for v in _vals(n, n * count)]
            stacked = torch.stack([v.to(torch.float64) for v in vals])
            for op in pc.ReduceOp:
                full = _reference(stacked, op, dt).to(dt)
                x = vals[r].clone()
                if (p := _path(comm, "all_reduce", x, op)) != want_path:
                    bad.append(f"all_reduce {count} {dt}: took the {p} path")
                if not torch.equal(x, full):
                    bad.append(f"all_reduce {count} {dt} {op.name}: wrong")
                for in_place in (False, True):
                    inp = vals[r].clone()
                    mine = slice(r * count, (r + 1) * count)
                    out = inp[mine] if in_place else torch.empty(count, dtype=dt)
                    if (p := _path(comm, "reduce_scatter", out, inp, op)) != want_path:
                        bad.append(f"reduce_scatter {count} {dt}: took the {p} path")
                    if not torch.equal(out, full[mine]):
                        bad.append(f"reduce_scatter {count} {dt} {op.name} {in_place}: wrong")
            for in_place in (False, True):
                out = torch.zeros(n * count, dtype=dt)
                src = vals[r][:count]
                if in_place:
                    out[r * count : (r + 1) * count].copy_(src)
                    src = out[r * count : (r + 1) * count]
                if (p := _path(comm, "all_gather", out, src)) != want_path:
                    bad.append(f"all_gather {count} {dt}: took the {p} path")
                if not torch.equal(out, torch.cat([vals[q][:count] for q in range(n)])):
                    bad.append(f"all_gather {count} {dt} in_place={in_place}: wrong")
    return bad


def job_cma_forced_rooted_all_to_all(comm: pc.Communicator) -> list[str] | None:
    """PYCOLL_ALGO=cma: broadcast and reduce from every root, and all-to-all, of
    every size take the single-copy path, exact for every op and dtype; reduce
    leaves the other ranks' buffers as they were."""
    n, r, bad = comm.world_size, comm.rank, []
    if not comm.single_copy:
        return None
    for count in (0, 1, 7, 1000, (1 << 18) + 3):
        want_path = "cma" if count > 0 else "slots"
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64):
            vals = [v.to(dt) for v in _vals(n, n * count)]
            stacked = torch.stack([v.to(torch.float64) for v in vals])
            for root in range(n):
                x = vals[r].clone() if r == root else torch.zeros(n * count, dtype=dt)
                if (p := _path(comm, "broadcast", x, root)) != want_path:
                    bad.append(f"broadcast {count} {dt}: took the {p} path")
                if not torch.equal(x, vals[root]):
                    bad.append(f"broadcast {count} {dt} root {root}: wrong")
            for op in pc.ReduceOp:
                root = (count + op.value) % n
                x = vals[r].clone()
                if (p := _path(comm, "reduce", x, root, op)) != want_path:
                    bad.append(f"reduce {count} {dt}: took the {p} path")
                want = _reference(stacked, op, dt).to(dt) if r == root else vals[r]
                if not torch.equal(x, want):
                    bad.append(f"reduce {count} {dt} {op.name} root {root}: wrong")
            out = torch.zeros(n * count, dtype=dt)
            if (p := _path(comm, "all_to_all", out, vals[r])) != want_path:
                bad.append(f"all_to_all {count} {dt}: took the {p} path")
            want = torch.cat([vals[q][r * count : (r + 1) * count] for q in range(n)])
            if not torch.equal(out, want):
                bad.append(f"all_to_all {count} {dt}: wrong")
    return bad


@pytest.mark.parametrize("job", [job_cma_forced, job_cma_forced_rooted_all_to_all])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cma_forced_every_collective_op_dtype_size(pool, world_size, job):
    for r, bad in enumerate(_forced(pool, world_size, job)):
        assert not bad, f"rank {r}: {bad}"


_SHARED = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all")


def job_cma_taken_over(
    comm: pc.Communicator,
) -> tuple[list[str], dict[str, int], dict[str, int]] | None:
    """All ranks on one CPU: whichever rank runs claims the chunks of the ranks that
    are descheduled. Exact results, how many chunks each rank took over, and the
    bytes each rank moved of broadcast and all-to-all."""
    if not comm.single_copy:
        return None
    cpus = os.sched_getaffinity(0)
    before = comm.stats()  # the pool's ranks ran other jobs: this job's counts are the growth
    os.sched_setaffinity(0, {min(cpus)})
    try:
        bad = _taken_over_calls(comm)
    finally:
        os.sched_setaffinity(0, cpus)  # the pool's ranks run later jobs
    stats = comm.stats()

    def grown(c: str, key: str) -> int:
        return stats[c][key] - before.get(c, {}).get(key, 0)

    moved = {c: grown(c, "bytes_out") + grown(c, "bytes_in") for c in _COPIES}
    return bad, {c: grown(c, "taken_over") for c in _SHARED}, moved


def _taken_over_calls(comm: pc.Communicator) -> list[str]:
    """job_cma_taken_over's calls: four of each collective, checked exactly."""
    n, r, bad = comm.world_size, comm.rank, []
    count = (1 << 20) + 5  # 4 MiB of int32 per block: 17 chunks of 256 KiB
    vals = [torch.arange(n * count, dtype=torch.int32) % 97 + q for q in range(n)]
    full = torch.stack(vals).sum(0)
    for it in range(4):
        x = vals[r].clone()
        comm.all_reduce(x)
        if not torch.equal(x, full):
            bad.append(f"all_reduce {it}: wrong")
        out = torch.empty(count, dtype=torch.int32)
        comm.reduce_scatter(out, vals[r])
        if not torch.equal(out, full[r * count : (r + 1) * count]):
            bad.append(f"reduce_scatter {it}: wrong")
        out = torch.empty(n * count, dtype=torch.int32)
        comm.all_gather(out, vals[r][:count])
        if not torch.equal(out, torch.cat([v[:count] for v in vals])):
            bad.append(f"all_gather {it}: wrong")
        root = it % n
        x = vals[r].clone()
        comm.reduce(x, root)
        if not torch.equal(x, full if r == root else vals[r]):
            bad.append(f"reduce {it}: wrong")
        x = vals[r].clone()
        comm.broadcast(x, root)
        if not torch.equal(x, vals[root]):
            bad.append(f"broadcast {it}: wrong")
        out = torch.empty(n * count, dtype=torch.int32)
        comm.all_to_all(out, vals[r])
        if not torch.equal(out, torch.cat([v[r * count : (r + 1) * count] for v in vals])):
            bad.append(f"all_to_all {it}: wrong")
    return bad


# Collectives that only copy: each block crosses once, by its sender writing or
# its receiver reading, never read into a third rank and written on from there.
_COPIES = ("broadcast", "all_to_all")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cma_chunks_of_descheduled_ranks_are_taken_over(pool, world_size):
    results = _forced(pool, world_size, job_cma_taken_over)
    for r, (bad, _, _) in enumerate(results):
        assert not bad, f"rank {r}: {bad}"
    for coll in _SHARED:
        assert sum(taken[coll] for _, taken, _ in results) > 0, (coll, results)
    # Four calls of each, n blocks of count int32 per buffer: broadcast fills n - 1
    # buffers, all-to-all moves n * (n - 1) blocks; as many bytes either way.
    n, block = world_size, ((1 << 20) + 5) * 4
    for coll in _COPIES:
        assert sum(moved[coll] for _, _, moved in results) == 4 * (n - 1) * n * block, coll


def job_cma_auto(comm: pc.Communicator) -> list[str]:
    """PYCOLL_CMA_TUNE=0: sizes inside the bands take CMA, sizes outside them
    take the slots or the one-shot areas; random floats against float64."""
    n, r, bad = comm.world_size, comm.rank, []
    cma = "cma" if comm.single_copy else "slots"
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(1 << 20, generator=g, dtype=torch.float64) for _ in range(n)]
    total = torch.stack(data).sum(0)
    cases = [  # (collective, elements of float32 per rank's buffer, expected path)
        ("all_reduce", 1 << 20, cma),  # 4 MiB
        # 32 MiB: with 4 ranks the ring's streaming stores win there
        ("all_reduce", 1 << 23, cma if n < 4 else "slots"),
        ("all_reduce", 1 << 16, "slots"),  # 256 KiB
        ("all_reduce", 1000, "oneshot"),
        ("all_gather", 1 << 17, cma),  # 512 KiB per rank
        # 32 KiB per rank: single copy beats the one-shot areas with 2 ranks only
        ("all_gather", 1 << 13, cma if n == 2 else "oneshot"),
        ("reduce_scatter", 1 << 20, cma),  # 4 MiB of input
        ("broadcast", 1 << 20, cma),
        ("broadcast", 1 << 16, cma),  # 256 KiB
        ("broadcast", 1000, "oneshot"),
        ("reduce", 1 << 20, cma if n == 2 else "slots"),
        ("all_to_all", 1 << 18, cma),  # 1 MiB blocks
        ("all_to_all", 1 << 16, cma),  # 256 KiB blocks
        ("all_to_all", 1 << 12, "slots"),
    ]
    for coll, count, want in cases:
        x = data[r][:count].float()
        if coll == "broadcast":
            path = _path(comm, coll, x, n - 1)
            ok = torch.equal(x, data[n - 1][:count].float())
        elif coll == "reduce":
            path = _path(comm, coll, x, 0)
            ref = total[:count] if r == 0 else data[r][:count]
            ok = torch.allclose(x.double(), ref, rtol=1e-5, atol=1e-5)
        elif coll == "all_to_all":
            out = torch.empty(n * count)
            xs = data[r][: n * count].float()
            path = _path(comm, coll, out, xs)
            want_out = [d[r * count : (r + 1) * count].float() for d in data]
            ok = torch.equal(out, torch.cat(want_out))
        elif coll == "all_reduce" and count > total.numel():  # small integers: exact
            x = torch.full((count,), float(r + 1))
            path = _path(comm, coll, x)
            ok = bool((x == n * (n + 1) / 2).all())
        elif coll == "all_reduce":
            path = _path(comm, coll, x)
            ok = torch.allclose(x.double(), total[:count], rtol=1e-5, atol=1e-5)
        elif coll == "all_gather":
            out = torch.empty(n * count)
            path = _path(comm, coll, out, x)
            ok = torch.equal(out, torch.cat([d[:count].float() for d in data]))
        else:
            blk = count // n
            out = torch.empty(blk)
            path = _path(comm, coll, out, x[: n * blk])
            ref = total[r * blk : (r + 1) * blk]
            ok = torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
        if path != want:
            bad.append(f"{coll} {count}: took the {path} path, not {want}")
        if not ok:
            bad.append(f"{coll} {count}: wrong")
    return bad


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cma_chosen_by_size(pool, world_size):
    # Untuned: with the tuner, where single copy runs inside the bands depends
    # on this machine (the test below).
    for r, bad in enumerate(pool(world_size, {"PYCOLL_CMA_TUNE": "0"}).run(job_cma_auto)):
        assert not bad, f"rank {r}: {bad}"


# The tuner's schedule in a size class: one untimed call on single copy, then
# CmaTuner.kTrials (2) timed calls of each path alternately, single copy first.
_TRIALS = [(True, False), (True, True), (False, True), (True, True), (False, True)]


def _tune(tuner, kind: str, total: int, ns: Callable[[bool], int], calls: int) -> list:
    """Runs `calls` operations of (kind, total) through `tuner`, each taking
    ns(ran_cma) nanoseconds on the path it preferred, recorded when timed;
    returns the choices (prefers single copy, timed)."""
    seq = []
    for _ in range(calls):
        cma, timed = tuner.choose(kind, total)
        seq.append((cma, timed))
        if timed:
            tuner.record(kind, total, cma, ns(cma))
    return seq


def test_cma_tuner_keeps_the_faster_path():
    from pycollectives import _C

    mib = 1 << 20
    kept_cma, kept_slots = [(True, False)] * 3, [(False, False)] * 3
    t = _C.CmaTuner()
    assert _tune(t, "all_gather", mib, lambda cma: 900 if cma else 1000, 8) == _TRIALS + kept_cma
    assert t.decided("all_gather", mib) == 1
    assert _tune(t, "all_reduce", mib, lambda cma: 900 if cma else 800, 8) == _TRIALS + kept_slots
    assert t.decided("all_reduce", mib) == 0
    # Per byte, per power of two: 1.5 MiB shares 1 MiB's class and decision, 2 MiB does not.
    assert t.choose("all_reduce", mib * 3 // 2) == (False, False)
    assert t.decided("all_reduce", 2 * mib) == -1 and t.decided("reduce_scatter", mib) == -1
    # Times compare per byte: 3 MiB in 2100 ns (700 a MiB) beats 2 MiB in 1600.
    t.record("all_reduce", 3 * mib, True, 2100)
    two = _tune(t, "all_reduce", 2 * mib, lambda cma: 1800 if cma else 1600, 6)
    assert two == _TRIALS + [(True, False)]
    # The best of each path's trials: one slow single-copy call does not decide.
    times = iter([5000, 1000, 900, 1000])
    assert _tune(t, "broadcast", mib, lambda cma: next(times), 6) == _TRIALS + [(True, False)]
    # A path that never ran in the trials (a peer preferred the other): the slots.
    u = _C.CmaTuner()
    for _ in range(5):
        if u.choose("reduce", mib)[1]:
            u.record("reduce", mib, False, 100)
    assert u.choose("reduce", mib) == (False, False) and u.decided("reduce", mib) == 0
    # PYCOLL_CMA_TUNE=0: single copy throughout the bands, never timed.
    off = _C.CmaTuner(False)
    assert _tune(off, "all_gather", mib, lambda cma: 1000 if cma else 1, 8) == [(True, False)] * 8
    assert off.decided("all_gather", mib) == 1
    with pytest.raises(ValueError, match="no operation named 'allreduce'"):
        t.choose("allreduce", mib)


def tuned_choice(tuning: dict[int, dict], total: int) -> str:
    """The path a rank's tuner kept for the size class of `total` bytes (one
    operation kind's entry of comm.cma_tuning()), checked against its timings:
    both paths timed, and the one with the lower best time per byte kept."""
    cls = tuning[1 << (total.bit_length() - 1)]
    slots, cma = cls["slots_ns_per_byte"], cls["cma_ns_per_byte"]
    assert slots is not None and cma is not None and slots > 0 and cma > 0, cls
    assert cls["decided"] == ("cma" if cma < slots else "slots"), cls
    return cls["decided"]


def job_cma_tuned_paths(comm: pc.Communicator, count: int) -> tuple[list[str], str] | None:
    """Eight all-gathers of `count` int32 per rank, exact: the paths they took,
    and the path this rank's tuner kept (None without CMA)."""
    n, r = comm.world_size, comm.rank
    if not comm.single_copy:
        return None
    x = torch.arange(count, dtype=torch.int32) + r
    want = torch.cat([torch.arange(count, dtype=torch.int32) + q for q in range(n)])
    paths = []
    for _ in range(8):
        out = torch.zeros(n * count, dtype=torch.int32)
        paths.append(_path(comm, "all_gather", out, x))
        assert torch.equal(out, want)
    return paths, tuned_choice(comm.cma_tuning()["all_gather"], n * count * 4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_cma_tuner_times_both_paths_and_keeps_the_faster(pool, world_size):
    # 256-byte slots: 4096 hand-offs a MiB, many times single copy's time, though under load
    # a descheduled peer can make either path's trials slow: which path wins is timing, so the
    # test holds each rank's decision to its own timings (test_cma_tuner_keeps_the_faster_path
    # checks the rule on given ones). Every rank runs the same trials; afterwards a collective
    # takes single copy only where every rank kept it.
    p = pool(world_size, {"PYCOLL_SLOT_BYTES": "256"})
    out = p.run(job_cma_tuned_paths, 1 << 18)
    if out[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here")
    tried = ["cma" if c else "slots" for c, _ in _TRIALS]
    kept = "cma" if all(choice == "cma" for _, choice in out) else "slots"
    assert [paths for paths, _ in out] == [tried + [kept] * 3] * world_size, out


def _disabled(rank: int, world_size: int) -> tuple[bool, str]:
    comm = pc.init()
    x = torch.full((1 << 20,), rank + 1.0)
    path = _path(comm, "all_reduce", x)
    assert torch.all(x == world_size * (world_size + 1) / 2)
    return comm.single_copy, path


def test_pycoll_cma_0_on_one_rank_turns_it_off_for_all():
    # Only rank 0 sets it: every rank must still agree, or they would deadlock.
    out = run(_disabled_rank0, 2, {"PYCOLL_CMA": "0"}, timeout=60)
    assert out == [(False, "slots"), (False, "slots")]


def _disabled_rank0(rank: int, world_size: int, env: dict[str, str]) -> tuple[bool, str]:
    import os

    if rank == 0:
        os.environ.update(env)
    return _disabled(rank, world_size)


def _mismatch(rank: int, world_size: int) -> str:
    comm = pc.init(timeout=60)
    count = 100_000 if rank == 0 else 100_008  # both in the all-gather's CMA band
    out = torch.empty(world_size * count)
    try:
        comm.all_gather(out, torch.ones(count))
    except pc.CollectiveMismatch as e:
        return str(e)
    raise AssertionError("no CollectiveMismatch")


def test_mismatched_counts_at_cma_sizes_raise_on_every_rank():
    for msg in run(_mismatch, 2, timeout=60):
        assert "count=100000" in msg and "count=100008" in msg, msg


def _dies_mid_copy(rank: int, world_size: int) -> tuple[str, float] | None:
    comm = pc.init(timeout=60)
    x = torch.ones(1 << 21)  # 8 MiB: single copy, ~30 chunks of copies per call
    comm.all_reduce(x)  # every rank leaves it at about the same time
    start = time.monotonic()
    if rank == world_size - 1:  # dies while its peers read and write its buffer
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            comm.all_reduce(x)
    try:
        while True:
            comm.all_reduce(x)
    except pc.PeerFailure as e:
        return (str(e), time.monotonic() - start) if comm.single_copy else None
    # Any other error (the kernel refusing a copy into a process that is gone)
    # fails the test with its traceback.


@pytest.mark.parametrize("world_size", [2, 3])
def test_peer_dying_mid_copy_raises_peer_failure(world_size):
    last = world_size - 1
    msgs = run(
        _dies_mid_copy,
        world_size,
        timeout=60,
        env={"PYCOLL_CMA_TUNE": "0"},  # single copy on every call, whatever is faster here
        expect_exit={last: -signal.SIGKILL},
    )
    if msgs[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here")
    for msg, seconds in msgs[:last]:
        assert f"rank {last} died" in msg, msg
        assert seconds < 0.3 + 2.0, (seconds, msg)  # within 2 s of the death
