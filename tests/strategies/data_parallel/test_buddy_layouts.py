"""BuddyCopy of state whose layout differs from rank to rank (a pipeline's
stages: strategies/data_parallel/redundancy.py, used by parallel3d's
ElasticTrainer3D): each rank's buddy holds its bytes and its layout after a
commit; a layout that changed is sent again, an unchanged one is not; a
layout from a peer is checked before use."""

from __future__ import annotations

import pytest
import torch

from pycollectives.strategies.data_parallel.redundancy import (
    BuddyCopy,
    decode_entries,
    encode_entries,
)


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
    from pycollectives.strategies.data_parallel.redundancy import _entries

    entries = _entries(_state(2, True))
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
