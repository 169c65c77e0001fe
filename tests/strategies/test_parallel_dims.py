"""strategies.parallel_dims.ParallelDims: the dp x tp x pp grid, its sub-communicators,
and clear errors on every rank for grids that do not fit."""

from __future__ import annotations

import pytest
import torch

import pycollectives as pc
from pycollectives.strategies.parallel_dims import AXES, ParallelDims

# Every factorization of 1..4 ranks into (dp, tp, pp).
LAYOUTS = {
    n: [
        (dp, tp, n // (dp * tp))
        for dp in range(1, n + 1)
        for tp in range(1, n + 1)
        if n % (dp * tp) == 0
    ]
    for n in (1, 2, 3, 4)
}


def members(comm: pc.Communicator, world_rank: int) -> list[int]:
    """The world ranks of `comm`'s members, in its rank order."""
    out = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(out, torch.tensor([world_rank]))
    return out.tolist()


def job_layouts(comm: pc.Communicator, layouts: list[tuple[int, int, int]]) -> list:
    out = []
    for dp, tp, pp in layouts:
        with ParallelDims(comm, dp=dp, tp=tp, pp=pp) as dims:
            groups = {a: members(dims.comm(a), comm.rank) for a in AXES}
            # Each sub-communicator sums over exactly its members.
            for a in AXES:
                t = torch.tensor([float(comm.rank)])
                dims.comm(a).all_reduce(t)
                assert t.item() == sum(groups[a]), (a, t, groups)
            out.append((dims.sizes, dims.coords, groups, dims.rank_of(**dims.coords), repr(dims)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_grid_and_sub_communicators(pool, world_size):
    layouts = LAYOUTS[world_size]
    results = pool(world_size).run(job_layouts, layouts, timeout=60)
    for k, (dp, tp, pp) in enumerate(layouts):
        for rank, per_layout in enumerate(results):
            sizes, coords, groups, rank_of, text = per_layout[k]
            assert sizes == {"pp": pp, "dp": dp, "tp": tp}
            # TP innermost: rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
            assert rank == (coords["pp"] * dp + coords["dp"]) * tp + coords["tp"] == rank_of
            assert groups["tp"] == list(range(rank - coords["tp"], rank - coords["tp"] + tp))
            for axis in AXES:  # members differ only along `axis`, ordered by it
                group = groups[axis]
                assert len(group) == sizes[axis] and group[coords[axis]] == rank
                for other in group:
                    other_coords = results[other][k][1]
                    assert {a: c for a, c in other_coords.items() if a != axis} == {
                        a: c for a, c in coords.items() if a != axis
                    }
            assert f"dp={dp}, tp={tp}, pp={pp}" in text and f"rank {rank}" in text


def job_bad_dims(comm: pc.Communicator) -> dict[str, str]:
    n, r = comm.world_size, comm.rank
    cases = {
        "product": {"dp": 2, "tp": 3, "pp": 1},
        "disagree": {"dp": 1, "tp": n} if r % 2 == 0 else {"dp": n, "tp": 1},
        "zero": {"tp": 0},
        "float": {"tp": 2.0},
        "two_inferred": {"dp": -1, "tp": -1},
        "not_divisible": {"dp": -1, "tp": 3},
    }
    out = {}
    for name, kw in cases.items():
        try:
            ParallelDims(comm, **kw).close()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    # The communicator is still in step after the errors.
    t = torch.ones(1)
    comm.all_reduce(t)
    assert t.item() == n
    with ParallelDims(comm, dp=-1, tp=2) as dims:
        out["inferred"] = repr(dims)
    return out


def test_bad_dims_raise_on_every_rank(pool):
    results = pool(4).run(job_bad_dims, timeout=60)
    for r, out in enumerate(results):
        assert "dp=2 x tp=3 x pp=1 = 6, but the world size is 4" in out["product"], out
        assert "the ranks ask for different grids" in out["disagree"], out
        assert "rank 0: dp=1, tp=4, pp=1; rank 1: dp=4, tp=1, pp=1" in out["disagree"], out
        assert "tp=0: each size must be a positive int" in out["zero"], out
        assert "tp=2.0: each size must be a positive int" in out["float"], out
        assert "at most one size may be -1" in out["two_inferred"], out
        assert (
            "dp=-1: the world size 4 is not divisible by tp=3 x pp=1 = 3" in out["not_divisible"]
        ), out
        assert f"ParallelDims(dp=2, tp=2, pp=1; rank {r}" in out["inferred"], out
        assert all(f"rank {r}" in msg for msg in out.values()), out


def job_rank_of_errors(comm: pc.Communicator) -> str:
    with ParallelDims(comm, tp=comm.world_size) as dims:
        try:
            dims.rank_of(dp=0, tp=comm.world_size, pp=0)
        except ValueError as e:
            return str(e)
    return "no error"


def test_rank_of_out_of_range(pool):
    assert all("is not a point of" in msg for msg in pool(2).run(job_rank_of_errors))


class _Grown:
    """A grown communicator as a newcomer's pycollectives.join returns it (2
    survivors and this newcomer), whose broadcast delivers `places`: what the
    survivors' rank 0 sent, untrusted."""

    parent_ranks, world_size, rank = (0, 1, -1), 3, 2

    def __init__(self, places: list[float]) -> None:
        self.places, self.closed = places, False

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        t.copy_(torch.tensor(self.places, dtype=t.dtype))

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    "place", [float("nan"), float("inf"), float("-inf"), 1.5, -1.0, 3.0, 1e300]
)
def test_join_refuses_a_place_that_is_no_rank_of_the_grid(monkeypatch, place):
    """The survivors' places arrive as float64 (with their timeout): NaN, an
    infinity or a fraction raises join's PyCollectivesError, as a rank out of
    range does, never int()'s ValueError or OverflowError; the communicator
    is closed."""
    import pycollectives.strategies.parallel_dims as parallel_dims

    grown = _Grown([20.0, place])
    monkeypatch.setattr(parallel_dims, "join", lambda store, timeout, prefix: grown)
    with pytest.raises(pc.PyCollectivesError, match=r"ParallelDims.join: rank 2: the survivors"):
        ParallelDims.join(None, tp=3)
    assert grown.closed
