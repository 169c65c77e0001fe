"""Checkpoints from untrusted files (issue 30, points 4 and 5): reads never
leave the checkpoint directory (a shard name such as ../x, an absolute path,
a name with a slash, a symbolic link), and the corruptions found in review
(a negative byte range, overlapping byte ranges, pieces past their tensor or
overlapping, a malformed field) raise CheckpointError naming the file, the
tensor and the field from load_pieces, load and consolidate alike, on every
rank. test_checkpoint_fuzz.py mutates checkpoints at random."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import pycollectives as pc
from pycollectives.strategies.checkpoint import (
    CheckpointError,
    Piece,
    consolidate,
    load,
    load_pieces,
    read_index,
    save,
    save_pieces,
)
from pycollectives.strategies.checkpoint.format import file_name

SHARD = file_name(0, 1)
W = torch.arange(24, dtype=torch.float32).view(4, 6)
B = torch.arange(5, dtype=torch.float32) + 100


def _save(path: Path) -> Path:
    """One process: w as two boxes (rows 0-1, rows 2-3), b whole."""
    pieces = [
        Piece("w", (4, 6), torch.float32, (0, 0), (2, 6), data=W[:2].clone()),
        Piece("w", (4, 6), torch.float32, (2, 0), (2, 6), data=W[2:].clone()),
        Piece.whole("b", B.clone()),
    ]
    return save_pieces(None, path, pieces, extra={"step": 3})


def _index(d: Path) -> dict:
    return json.loads((d / "index.json").read_text())


def _write_index(d: Path, index: dict) -> None:
    (d / "index.json").write_text(json.dumps(index))


def _rewrite_header(d: Path, name: str, entry: str, offsets: list[int]) -> None:
    """Sets the data_offsets of `entry` in file `name` (the index's size of
    the file follows: only the header is wrong)."""
    raw = (d / name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head[entry]["data_offsets"] = offsets
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    (d / name).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    index = _index(d)
    index["files"][name]["bytes"] = (d / name).stat().st_size
    _write_index(d, index)


def _load_all(d: Path) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = torch.zeros(4, 6), torch.zeros(5)
    load_pieces(None, d, [Piece.whole("w", w), Piece.whole("b", b)])
    return w, b


def _refused(d: Path, tmp: Path, *words: str, index: bool = True) -> None:
    """load_pieces, consolidate and (`index`: the fault is in the index or the
    file names) read_index raise CheckpointError naming `words`."""
    calls = {
        "load_pieces": lambda: _load_all(d),
        "consolidate": lambda: consolidate(d, tmp / "out.safetensors"),
    }
    if index:
        calls["read_index"] = lambda: read_index(d)
    for name, call in calls.items():
        with pytest.raises(CheckpointError) as e:
            call()
        assert all(w in str(e.value) for w in words), (name, str(e.value))
    assert not list(tmp.glob("out.safetensors*")), "consolidate left an output"


def _renamed(d: Path, tmp: Path, new: str) -> None:
    """The index names the shard `new`; the bytes sit at `new` resolved from d."""
    index = _index(d)
    meta = index["files"].pop(SHARD)
    index["files"][new] = meta
    for p in index["pieces"]:
        p["file"] = new
    _write_index(d, index)


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/x.safetensors"])
def test_shard_names_outside_the_directory_are_refused(tmp_path, name):
    d = _save(tmp_path / "ck")
    if name == "ABSOLUTE":
        name = str(tmp_path / "outside.safetensors")
    target = (d / name) if not os.path.isabs(name) else Path(name)
    target.parent.mkdir(exist_ok=True)
    os.rename(d / SHARD, target)  # the data is really there: only the name is wrong
    _renamed(d, tmp_path, name)
    _refused(d, tmp_path, "not the writer's name", name)


def test_symbolic_links_inside_the_directory_are_refused(tmp_path):
    d = _save(tmp_path / "ck")
    os.rename(d / SHARD, tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", d / SHARD)
    _refused(d, tmp_path, SHARD, "symbolic link")
    # index.json itself a link
    e = _save(tmp_path / "ck2")
    os.rename(e / "index.json", tmp_path / "index.json")
    os.symlink(tmp_path / "index.json", e / "index.json")
    _refused(e, tmp_path, "index.json", "symbolic link")


def test_a_fifo_named_as_a_shard_does_not_block(tmp_path):
    d = _save(tmp_path / "ck")
    (d / SHARD).unlink()
    os.mkfifo(d / SHARD)
    _refused(d, tmp_path, SHARD, "not a regular file")


def test_negative_and_overlapping_byte_ranges(tmp_path):
    # a negative start: today's load read the JSON header as floats
    d = _save(tmp_path / "ck")
    _rewrite_header(d, SHARD, "b", [-40, -20])
    _refused(d, tmp_path, SHARD, "'b'", "data_offsets", index=False)
    # w#1's range overlapping w's (both 48 bytes, shifted by 16)
    e = _save(tmp_path / "ck2")
    _rewrite_header(e, SHARD, "w#1", [32, 80])
    _refused(e, tmp_path, SHARD, "'w'", "data_offsets", index=False)


def test_pieces_past_their_tensor_or_overlapping(tmp_path):
    d = _save(tmp_path / "ck")
    index = _index(d)
    index["pieces"][1]["offsets"] = [3, 0]  # rows 3-4 of a 4-row tensor
    _write_index(d, index)
    _refused(d, tmp_path, "pieces[1]", "'w'", "outside shape")
    # both pieces claim rows 0-1: rows 2-3 held by none, rows 0-1 twice
    e = _save(tmp_path / "ck2")
    index = _index(e)
    index["pieces"][1]["offsets"] = [0, 0]
    _write_index(e, index)
    _refused(e, tmp_path, "'w'", "overlap")


def test_malformed_fields_raise_checkpoint_error(tmp_path):
    cases = {
        "flat": (lambda ix: ix["pieces"][0].__setitem__("flat", ["a", None]), "'flat'"),
        "shape": (lambda ix: ix["tensors"]["b"].__setitem__("shape", [5.0]), "'shape'"),
        "dtype": (lambda ix: ix["tensors"]["b"].__setitem__("dtype", ["F32"]), "'dtype'"),
        "tensor": (lambda ix: ix["pieces"][2].__setitem__("tensor", ["b"]), "'tensor'"),
        "pieces": (lambda ix: ix.__setitem__("pieces", {"a": 1}), "'pieces'"),
        "bool": (lambda ix: ix["pieces"][0].__setitem__("offsets", [False, 0]), "'offsets'"),
    }
    for name, (mutate, field) in cases.items():
        d = _save(tmp_path / name)
        index = _index(d)
        mutate(index)
        _write_index(d, index)
        _refused(d, tmp_path, "index.json", field)
    d = _save(tmp_path / "dup")
    text = (d / "index.json").read_text()
    assert text.startswith("{") and '"world_size": 1' in text
    (d / "index.json").write_text('{"world_size": 1, ' + text[1:])  # a second world_size
    _refused(d, tmp_path, "index.json", "duplicate key")
    d = _save(tmp_path / "deep")  # nesting past the recursion limit: refused, no RecursionError
    text = (d / "index.json").read_text()
    deep = '{"extra": ' + "[" * 100_000 + "]" * 100_000 + ", "
    (d / "index.json").write_text(deep + text.lstrip()[1:].replace('"extra"', '"extra0"'))
    _refused(d, tmp_path, "index.json", "not valid JSON")


def test_huge_claims_allocate_nothing(tmp_path):
    """A header length or a tensor shape far past the files is refused before
    anything of that size is allocated (the test would run out of memory)."""
    d = _save(tmp_path / "ck")
    raw = (d / SHARD).read_bytes()
    (d / SHARD).write_bytes((1 << 62).to_bytes(8, "little") + raw[8:])
    _refused(d, tmp_path, SHARD, "header length", index=False)
    e = _save(tmp_path / "ck2")
    index = _index(e)
    index["tensors"]["b"]["shape"] = [1 << 40]
    index["pieces"][2]["sizes"] = [1 << 40]
    _write_index(e, index)
    _refused(e, tmp_path, "need more than")


def test_a_well_formed_checkpoint_still_loads_and_consolidates(tmp_path):
    d = _save(tmp_path / "ck")
    w, b = _load_all(d)
    assert torch.equal(w, W) and torch.equal(b, B)
    consolidate(d, tmp_path / "out.safetensors")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(got["w"], W) and torch.equal(got["b"], B)


def test_load_and_the_cli_refuse_too(tmp_path):
    model = nn.Linear(3, 2)
    save(tmp_path / "ck", None, model)
    index = _index(tmp_path / "ck")
    index["pieces"][0]["flat"] = ["a", None]
    _write_index(tmp_path / "ck", index)
    with pytest.raises(CheckpointError, match=r"pieces\[0\].*'flat'"):
        load(tmp_path / "ck", None, nn.Linear(3, 2))
    from pycollectives.strategies.checkpoint.__main__ import main

    assert main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.safetensors")]) == 1


def job_load_two_files(comm: pc.Communicator, path: str, mode: str) -> str:
    """Two ranks: rank r loads only the rows rank r saved (so only file r)."""
    r = comm.rank
    if mode == "save":
        save_pieces(
            comm,
            path,
            [
                Piece(
                    "w",
                    (4, 6),
                    torch.float32,
                    (2 * r, 0),
                    (2, 6),
                    data=W[2 * r : 2 * r + 2].clone(),
                )
            ],
        )
        return "saved"
    got = torch.zeros(2, 6)
    try:
        load_pieces(comm, path, [Piece("w", (4, 6), torch.float32, (2 * r, 0), (2, 6), data=got)])
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    except Exception as e:  # noqa: BLE001 - the test reports it
        return f"{type(e).__name__}: {e}"
    return "ok" if torch.equal(got, W[2 * r : 2 * r + 2]) else "wrong values"


def test_every_rank_raises(pool, tmp_path):
    # a malformed field in the index: today a TypeError on one rank, PeerFailure on the other
    path = str(tmp_path / "ck")
    pool(2).run(job_load_two_files, path, "save", timeout=60)
    index = _index(Path(path))
    index["pieces"][1]["flat"] = ["a", None]
    _write_index(Path(path), index)
    for r, got in enumerate(pool(2).run(job_load_two_files, path, "load", timeout=60)):
        assert got.startswith("CheckpointError") and f"rank {r}:" in got, (r, got)
        assert "pieces[1]" in got and "'flat'" in got, (r, got)
    # a header only rank 1 reads: rank 0 raises too, naming rank 1 and the file
    path2 = str(tmp_path / "ck2")
    pool(2).run(job_load_two_files, path2, "save", timeout=60)
    _rewrite_header(Path(path2), file_name(1, 2), "w", [-48, 0])
    for r, got in enumerate(pool(2).run(job_load_two_files, path2, "load", timeout=60)):
        assert got.startswith("CheckpointError") and "on rank 1" in got, (r, got)
        assert file_name(1, 2) in got and "data_offsets" in got, (r, got)
