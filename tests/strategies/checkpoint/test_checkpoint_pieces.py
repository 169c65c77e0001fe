"""strategies.checkpoint's low-level layer: the piece arithmetic against
brute-force indexing, save_pieces / load_pieces between layouts (tensor
parallel boxes, flat shards, one process), the files read by the
`safetensors` package and by plain json + numpy, bad input on every rank."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import pycollectives as pc
from pycollectives.strategies.checkpoint import (
    Piece,
    load_pieces,
    read_index,
    read_stats,
    save_pieces,
)
from pycollectives.strategies.checkpoint.pieces import copy_plan, runs


def _random_piece(rng: random.Random, shape: tuple[int, ...]) -> tuple:
    offs, sizes = [], []
    for d in shape:
        o = rng.randrange(d)
        offs.append(o)
        sizes.append(rng.randrange(1, d - o + 1))
    n = int(np.prod(sizes))
    flat = None if rng.random() < 0.3 else tuple(sorted(rng.sample(range(n + 1), 2)))
    return tuple(offs), tuple(sizes), flat


def _elements(shape, offs, sizes, flat) -> torch.Tensor:
    """The global flat indices of a piece's elements, in piece order (brute force)."""
    idx = torch.arange(int(np.prod(shape))).view(shape)
    box = idx[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))].reshape(-1)
    return box if flat is None else box[flat[0] : flat[1]]


def test_runs_and_copy_plan_match_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        shape = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(1, 4)))
        a, b = _random_piece(rng, shape), _random_piece(rng, shape)
        ea, eb = _elements(shape, *a), _elements(shape, *b)
        ra = runs(shape, *a)
        got = torch.cat([torch.arange(g, g + n) for g, _, n in ra]) if ra else torch.zeros(0)
        assert torch.equal(got.long(), ea), (trial, shape, a)
        assert [p for _, p, _ in ra] == sorted(p for _, p, _ in ra)
        # copy_plan moves exactly the shared elements to the right places
        dst = torch.full((len(ea),), -1)
        for d, s, n in copy_plan(ra, runs(shape, *b)):
            dst[d : d + n] = eb[s : s + n]
        shared = torch.isin(ea, eb)
        assert torch.equal(dst[shared], ea[shared]) and bool((dst[~shared] == -1).all())


def test_round_trip_one_process_and_foreign_readers(tmp_path):
    g = torch.randn(6, 10)
    h = torch.randn(7).to(torch.bfloat16)
    step = torch.tensor(5.0)
    # saved as a dim-1 split whose second half is cut into two flat ranges
    right = g[:, 4:].reshape(-1)
    pieces = [
        Piece("w", (6, 10), torch.float32, (0, 0), (6, 4), data=g[:, :4].contiguous()),
        Piece("w", (6, 10), torch.float32, (0, 4), (6, 6), flat=(0, 13), data=right[:13].clone()),
        Piece("w", (6, 10), torch.float32, (0, 4), (6, 6), flat=(13, 36), data=right[13:].clone()),
        Piece.whole("h", h),
        Piece.whole("optim/step/w", step),
    ]
    save_pieces(None, tmp_path / "ck", pieces, extra={"note": [1, 2]})
    rows, flat, hh, st = (
        torch.zeros(3, 10),
        torch.zeros(17),
        torch.zeros(7, dtype=torch.bfloat16),
        torch.zeros(()),
    )
    read_stats(reset=True)
    extra = load_pieces(
        None,
        tmp_path / "ck",
        [
            Piece("w", (6, 10), torch.float32, (2, 0), (3, 10), data=rows),
            Piece("w", (6, 10), torch.float32, flat=(30, 47), data=flat),
            Piece.whole("h", hh),
            Piece.whole("optim/step/w", st),
        ],
    )
    assert extra == {"note": [1, 2]}
    assert torch.equal(rows, g[2:5]) and torch.equal(flat, g.reshape(-1)[30:47])
    assert torch.equal(hh, h) and torch.equal(st, step)
    # read only what it needs: the spans of the saved pieces touched
    assert read_stats()["bytes_read"] == 4 * (30 + 17) + 14 + 4  # exactly the elements wanted
    # the safetensors package reads every piece with its metadata
    from safetensors import safe_open

    f = tmp_path / "ck" / "shard-00000-of-00001.safetensors"
    with safe_open(str(f), "pt") as st_file:
        assert set(st_file.keys()) == {"w", "w#1", "w#2", "h", "optim/step/w"}
        assert torch.equal(st_file.get_tensor("w#2"), right[13:])
        assert torch.equal(st_file.get_tensor("h"), h)
        described = json.loads(st_file.metadata()["pieces"])
        assert described[1]["flat"] == [0, 13] and described[1]["offsets"] == [0, 4]
    # plain json + numpy, from the index alone
    index = json.loads((tmp_path / "ck" / "index.json").read_text())
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    full = np.zeros(60, dtype=np.float32)
    for p in index["pieces"]:
        if p["tensor"] != "w":
            continue
        a, b = head[p["key"]]["data_offsets"]
        vals = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4")
        box = (
            np.arange(60)
            .reshape(6, 10)[
                tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["sizes"], strict=True))
            ]
            .reshape(-1)
        )
        lo, hi = p["flat"] or (0, box.size)
        full[box[lo:hi]] = vals
    assert np.array_equal(full.reshape(6, 10), g.numpy())
    assert index["tensors"]["h"] == {"shape": [7], "dtype": "BF16"}


def test_bad_input_one_process(tmp_path):
    w = torch.zeros(4)
    with pytest.raises(ValueError, match="does not exist"):
        load_pieces(None, tmp_path / "nothing", [Piece.whole("w", w)])
    save_pieces(None, tmp_path / "ck", [Piece.whole("w", w)])
    with pytest.raises(ValueError, match=r"'v'.*not in the checkpoint"):
        load_pieces(None, tmp_path / "ck", [Piece.whole("v", w)])
    with pytest.raises(ValueError, match="shape"):
        load_pieces(None, tmp_path / "ck", [Piece.whole("w", torch.zeros(5))])
    with pytest.raises(ValueError, match="overlap"):
        save_pieces(None, tmp_path / "ck2", [Piece.whole("w", w), Piece.whole("w", w)])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a checkpoint"):
        save_pieces(None, tmp_path / "mine", [Piece.whole("w", w)])
    assert (tmp_path / "mine" / "notes.txt").exists()


def _split(t: torch.Tensor, dim: int, r: int, n: int) -> tuple[tuple, tuple, torch.Tensor]:
    size = t.shape[dim] // n
    offs = [0] * t.dim()
    offs[dim] = r * size
    sizes = list(t.shape)
    sizes[dim] = size
    return tuple(offs), tuple(sizes), t.narrow(dim, r * size, size).contiguous()


def job_tp_save(comm: pc.Communicator, path: str) -> None:
    """Three ranks: w split along dim 1 (tensor parallel), b saved by rank 0."""
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(0)
    w, b = torch.randn(4, 6), torch.randn(5)
    offs, sizes, mine = _split(w, 1, rank, world)
    pieces = [Piece("w", (4, 6), torch.float32, offs, sizes, data=mine)]
    if rank == 0:
        pieces.append(Piece.whole("b", b))
    save_pieces(comm, path, pieces, extra={"world": world})


def job_tp_load(comm: pc.Communicator, path: str) -> list[str]:
    """Two ranks: w as flat shards of 12 elements, b whole on every rank."""
    rank = comm.rank
    torch.manual_seed(0)
    w, b = torch.randn(4, 6), torch.randn(5)
    got, gb = torch.zeros(12), torch.zeros(5)
    extra = load_pieces(
        comm,
        path,
        [
            Piece("w", (4, 6), torch.float32, flat=(12 * rank, 12 * rank + 12), data=got),
            Piece.whole("b", gb),
        ],
    )
    bad = []
    if extra != {"world": 3}:
        bad.append(f"extra {extra}")
    if not torch.equal(got, w.reshape(-1)[12 * rank : 12 * rank + 12]) or not torch.equal(gb, b):
        bad.append("values differ")
    try:  # a tensor missing on rank 1 only: every rank raises
        load_pieces(
            comm, path, [Piece.whole("b", gb)] + ([Piece.whole("zz", gb)] if rank == 1 else [])
        )
        bad.append("no error for a missing tensor")
    except ValueError as e:
        if not all(w in str(e) for w in (f"rank {rank}", "on rank 1", "'zz'", "load_pieces")):
            bad.append(f"message: {e}")
    try:  # overlapping pieces (both ranks save all of b): every rank raises, nothing written
        save_pieces(comm, path + "-overlap", [Piece.whole("b", b)])
        bad.append("no error for overlapping pieces")
    except ValueError as e:
        if "overlap" not in str(e) or f"rank {rank}" not in str(e):
            bad.append(f"message: {e}")
    return bad


def test_tensor_parallel_boxes_load_as_flat_shards(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool(3).run(job_tp_save, path, timeout=60)
    index = read_index(path)
    assert len(index["files"]) == 3 and index["world_size"] == 3
    for r, bad in enumerate(pool(2).run(job_tp_load, path, timeout=60)):
        assert not bad, f"rank {r}: {bad}"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no unfinished save left beside it


@pytest.mark.parametrize("exchange", [True, False])
def test_save_replaces_a_checkpoint(tmp_path, monkeypatch, exchange):
    """A second save to the same path replaces the first (renameat2 exchange,
    or the two renames where it is unavailable) and leaves nothing beside it."""
    from pycollectives.strategies.checkpoint import piece_files

    if not exchange:
        monkeypatch.setattr(piece_files, "_rename_exchange", lambda a, b: False)
    else:
        assert (
            piece_files._rename_exchange(tmp_path / "x", tmp_path / "y") is False
        )  # no such paths
    save_pieces(None, tmp_path / "ck", [Piece.whole("w", torch.zeros(3))], extra=1)
    save_pieces(None, tmp_path / "ck", [Piece.whole("w", torch.ones(3))], extra=2)
    w = torch.zeros(3)
    assert load_pieces(None, tmp_path / "ck", [Piece.whole("w", w)]) == 2
    assert torch.equal(w, torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
