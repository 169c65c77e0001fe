"""BuddyCopy of state whose layout differs from rank to rank (a pipeline's
stages: strategies/data_parallel/redundancy.py, used by parallel3d's
ElasticTrainer3D): each rank's buddy holds its bytes and its layout after a
commit; a layout that changed is sent again, an unchanged one is not; a
layout from a peer is checked before use, and bounded by the capacity the
peer declared at setup (a forged one is refused, naming the peer, and the
communicator revoked: the forger does not wait out its timeout). Where the
buddies go (buddies.py): a permutation, on another host wherever that can
be; the ranks' placements are compared at setup."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import pycollectives as pc
from pycollectives.strategies.data_parallel.buddies import (
    buddy_ranks,
    check_placement,
    survives_host_loss,
)
from pycollectives.strategies.data_parallel.redundancy import (
    BuddyCopy,
    decode_entries,
    encode_entries,
)
from pycollectives.strategies.data_parallel.state_layout import Entry, layout_of


def _state(rank: int, extra: bool) -> list[tuple[int, str, torch.Tensor, bool]]:
    """Rank r holds r + 1 float64 tensors of r + 2 values (small integers),
    and, with `extra`, a float32 scalar (AdamW's step: unaligned offsets)."""
    out = [(i, "param", torch.arange(rank + 2, dtype=torch.float64) + 10 * i, False)
           for i in range(rank + 1)]  # fmt: skip
    if extra:
        out.append((0, "step", torch.tensor(float(rank + 1)), False))
    return out


def job_heterogeneous(comm) -> list:
    n, r = comm.world_size, comm.rank
    extra = [False]
    copy = BuddyCopy(comm=comm, tensors=lambda: _state(r, extra[0]))
    out, calls, batch_p2p = [], [0], comm.batch_p2p

    def counted(ops, **kwargs):
        calls[0] += 1
        return batch_p2p(ops, **kwargs)

    comm.batch_p2p = counted  # this instance only (the pool's: restored below)
    try:
        for step, with_extra in ((1, False), (2, True), (3, True)):
            extra[0] = with_extra
            calls[0] = 0
            copy.refresh()
            copy.commit(step)
            out.append((step, _holds(copy, (r - 1) % n, with_extra), calls[0], copy.local.numel()))
    finally:
        del comm.batch_p2p
    return out


def _holds(copy: BuddyCopy, prev: int, extra: bool) -> bool:
    """Whether `copy` holds rank `prev`'s state: its bytes and its layout."""
    want = _state(prev, extra)
    got = [
        copy.remote[e.offset : e.offset + e.nbytes].clone().view(e.dtype).view(e.shape)
        for e in copy.remote_entries
    ]
    return len(got) == len(want) and all(
        torch.equal(g, t) and e.key == k and e.flat == i
        for g, (i, k, t, _), e in zip(got, want, copy.remote_entries, strict=True)
    )


def test_each_buddy_holds_its_predecessors_bytes_and_layout(pool):
    for r, rows in enumerate(pool(3).run(job_heterogeneous, timeout=120)):
        for step, same, calls, local in rows:
            assert same, (r, step)
            # the size header, the layout where it changed (steps 1 and 2), the bytes
            assert calls == (3 if step < 3 else 2), (r, step, calls)
            assert local == (r + 1) * (r + 2) * 8 + (4 if step > 1 else 0), (r, step)


def test_a_layout_round_trips_and_a_malformed_one_raises():
    entries, _ = layout_of(_state(2, True))
    assert decode_entries(encode_entries(entries), "x") == entries
    for bad in (
        b"not json",
        b'[[0, "param", "complex64", [2], 0, 16, false, "cpu"]]',  # unknown dtype
        b'[[0, "param", "float64", [2], 0, 8, false, "cpu"]]',  # bytes not its shape's
        b'[[0, "param", "float64", [2], 8, 16, false, "cpu"]]',  # not packed from 0
        b'[[-1, "param", "float64", [2], 0, 16, false, "cpu"]]',  # negative index
        b'[[0, "param", "float64", [2], 0, 16, false]]',  # a field missing
    ):
        with pytest.raises(RuntimeError, match="rank 7's layout is malformed"):
            decode_entries(bad, "rank 7's")


def test_buddy_copy_needs_a_zero_optimizer_or_comm_and_tensors():
    with pytest.raises(ValueError, match="comm= and tensors="):
        BuddyCopy()
    with pytest.raises(ValueError, match="comm= and tensors="):
        BuddyCopy(tensors=list)


def job_forged(comm, forge: str) -> list[str]:
    """After a setup refresh and commit (the layouts and capacities declared:
    80 bytes for rank 0's 16 by default), rank 0 forges the next refresh:
    "size", a layout of 8 GiB (under decode_entries' bound), spoken by hand
    (its header, then the layout; then it waits for rank 1's state);
    "capacity", a header with another capacity than at setup; "grown", its
    own state grown past the capacity it declared (capacity= its setup
    size). What each rank raised, on a communicator of their own (revoked)."""
    sub = comm.split(0, key=comm.rank)
    r = sub.rank
    grown = [False]
    copy = BuddyCopy(
        comm=sub,
        tensors=lambda: _state(r, grown[0]),
        capacity=(r + 1) * (r + 2) * 8 if forge == "grown" else None,
    )
    copy.refresh()
    copy.commit(1)
    cap = copy._layouts.capacity  # noqa: SLF001 - what the forger declared
    try:
        if r == 0 and forge != "grown":
            cpu = torch.device("cpu")
            huge = [Entry(0, "param", torch.float64, (1 << 30,), 0, 8 << 30, False, cpu)]
            meta = encode_entries(huge) if forge == "size" else b""
            header = torch.tensor([len(meta), cap + (forge == "capacity")])
            sub.batch_p2p([("send", header, 1), ("recv", torch.empty(2, dtype=torch.int64), 1)])
            if meta:
                sub.batch_p2p([("send", torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1)])
            sub.batch_p2p([("recv", torch.empty(8, dtype=torch.uint8), 1)])  # never sent
        else:  # rank 1's layout unchanged (rank 0 by hand receives no layout)
            grown[0] = r == 0
            copy.refresh()
        return ["no error"]
    except (RuntimeError, ValueError, pc.PyCollectivesError) as e:
        return [type(e).__name__, str(e)]
    finally:
        with warnings.catch_warnings():  # the revoked operations
            warnings.simplefilter("ignore", RuntimeWarning)
            sub.close()


@pytest.mark.parametrize("forge", ["size", "capacity", "grown"])
def test_a_layout_past_the_senders_capacity_is_refused_naming_it(pool, forge):
    (kind0, *said0), (kind1, *said1) = pool(2).run(job_forged, forge, timeout=60)
    if forge == "grown":  # the sender refuses its own state; its buddy is woken
        assert kind0 == "ValueError", said0
        assert "BuddyCopy.refresh: rank 0: this rank's state is 20 bytes, more than " in said0[0]
        assert "capacity of 16 it declared at setup" in said0[0], said0
        assert kind1 == "CommunicatorRevoked", (kind1, said1)
        return
    assert kind1 == "RuntimeError", (kind1, said1)
    want = {
        "size": f"rank 0 announced a layout of {8 << 30} bytes, more than the 80 its place",
        "capacity": "rank 0 announced a capacity of ",
    }[forge]
    assert said1[0].startswith(f"BuddyCopy.refresh: rank 1: {want}"), said1
    assert kind0 == "CommunicatorRevoked" and "BuddyCopy.refresh: rank 1" in said0[0], said0


def job_placements_differ(comm) -> str:
    try:  # rank 1 says its copy goes to itself: not what rank 0's placement says
        check_placement(comm, [1, 0] if comm.rank == 0 else [1, 1], "test")
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_given_other_placements_are_refused(pool):
    said = pool(2).run(job_placements_differ, timeout=60)
    assert said[0].startswith("test: rank 0: ranks [1] placed their copies on [1], not on [0]")
    assert said[1] == "no error"


def test_buddies_go_to_another_host_wherever_that_can_be():
    assert buddy_ranks([0, 0, 0, 0], "auto", "x") == [1, 2, 3, 0]  # one host: rank + 1
    assert buddy_ranks([0, 0, 1, 1], "ring", "x") == [1, 2, 3, 0]
    assert buddy_ranks([0, 0, 1, 1], "auto", "x") == [2, 3, 0, 1]
    assert buddy_ranks([0, 0, 1, 1], "hosts", "x") == [2, 3, 0, 1]
    assert buddy_ranks([0, 1, 0, 1], "auto", "x") == [1, 0, 3, 2]  # hosts interleaved
    assert buddy_ranks([0], "auto", "x") == [0]
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(2, 12)
        hosts = sorted(rng.randrange(rng.randint(1, 4)) for _ in range(n))
        if rng.random() < 0.5:
            rng.shuffle(hosts)
        buddies = buddy_ranks(hosts, "auto", "x")
        assert sorted(buddies) == list(range(n)), (hosts, buddies)  # each holds one copy
        assert all(b != r for r, b in enumerate(buddies)), (hosts, buddies)
        m = max(hosts.count(h) for h in set(hosts))
        same = sum(hosts[b] == hosts[r] for r, b in enumerate(buddies))
        if len(set(hosts)) == 1:
            assert buddies == [(r + 1) % n for r in range(n)]
            with pytest.raises(ValueError, match=r"^x: placement='hosts': .* on 1 host\(s\)"):
                buddy_ranks(hosts, "hosts", "x")
        elif 2 * m <= n:  # every buddy on another host
            assert same == 0 and survives_host_loss(hosts, buddies), (hosts, buddies)
            assert buddy_ranks(hosts, "hosts", "x") == buddies
        else:  # the fewest on their own host that any placement allows
            assert same == 2 * m - n, (hosts, buddies)
            with pytest.raises(ValueError, match="no placement survives the loss"):
                buddy_ranks(hosts, "hosts", "x")
    with pytest.raises(ValueError, match=r"^BuddyCopy: rank 3: placement='far' must be one of"):
        buddy_ranks([0, 1], "far", "BuddyCopy: rank 3")
