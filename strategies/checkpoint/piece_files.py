"""The low-level entry points: every rank saves its pieces (save_pieces) or
loads the pieces it wants (load_pieces), whatever layout wrote them.

    from pycollectives.strategies.checkpoint import Piece, save_pieces, load_pieces
    # a column-parallel weight [out, in] split along dim 0 over tp ranks:
    rows = out // tp
    mine = Piece("fc.weight", (out, inp), w.dtype, offsets=(r * rows, 0), sizes=(rows, inp), data=w)
    save_pieces(comm, "ckpt/step-100", [mine, ...], extra={"step": 100})
    ...
    want = Piece("fc.weight", (out, inp), w.dtype, offsets=(r * rows, 0), sizes=(rows, inp), data=w)
    extra = load_pieces(comm, "ckpt/step-100", [want, ...])  # any other split works too

Save is atomic: every rank writes its file into DIR.tmp-<random>; when every
rank has written and fsynced, rank 0 writes index.json and renames the
directory to DIR (exchanging it with a previous DIR in one renameat2 call
where the kernel and filesystem allow, else two renames). A crash or a rank
killed before that leaves DIR as it was; the surviving ranks raise
CheckpointError (the collective that waits for them sees the dead peer).
Load reads index.json and, per wanted piece, only the byte ranges of the saved
pieces it overlaps (os.pread).

Bad input raises ValueError on every rank (the ranks exchange what each
found before anything is written or read), naming the operation, the path,
the rank(s) and the tensor. A checkpoint that is not well formed (validate.py:
its index, and the header of every file a rank needs, are checked before any
data is read) raises CheckpointError on every rank, naming the file, the
tensor and the field.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from pycollectives import Communicator
from pycollectives.errors import PyCollectivesError

from ..data_parallel.sharding.checks import agree
from ..data_parallel.sharding.communications import all_gather_bytes
from .format import (
    FORMAT,
    INDEX,
    _keys,
    dtype_from_name,
    dtype_name,
    file_name,
    make_index,
    read_range,
    write_safetensors,
)
from .pieces import Piece, copy_plan, overlaps, runs
from .validate import Checkpoint, CheckpointError

__all__ = ["CheckpointError", "load_pieces", "save_pieces"]


def _rank(comm: Communicator | None) -> tuple[int, int]:
    return (0, 1) if comm is None else (comm.rank, comm.world_size)


def _exchange(comm: Communicator | None, what: str, payload: Any) -> list[Any]:
    """Every rank's JSON-able `payload`; CheckpointError if a peer failed."""
    if comm is None or comm.world_size == 1:
        return [payload]
    try:
        got = all_gather_bytes(comm, json.dumps(payload).encode())
    except PyCollectivesError as e:
        raise CheckpointError(f"{what}: rank {comm.rank}: {type(e).__name__}: {e}") from e
    return [json.loads(b) for b in got]


def _agree(comm: Communicator | None, what: str, problems: list[str]) -> None:
    if comm is None or comm.world_size == 1:
        if problems:
            raise ValueError(f"{what}: rank 0: " + "; ".join(problems))
        return
    try:
        agree(comm, what, None, problems)
    except PyCollectivesError as e:
        raise CheckpointError(f"{what}: rank {comm.rank}: {type(e).__name__}: {e}") from e


def save_pieces(
    comm: Communicator | None,
    path: str | os.PathLike,
    pieces: list[Piece],
    extra: Any = None,
) -> Path:
    """Collective: writes every rank's `pieces` (with their data) as the
    checkpoint directory `path`, atomically; returns its Path.

    `extra` is JSON-able data stored in the index (rank 0's is kept). Pieces
    of one tensor must agree on its shape and dtype and must not overlap
    (a replicated tensor is saved by one rank). An existing `path` is
    replaced only if it is a checkpoint or an empty directory.

    Raises ValueError on every rank for bad pieces or a bad path, and
    CheckpointError on every surviving rank if a rank fails or dies while
    writing (`path` then still holds the previous checkpoint, if any).
    """
    rank, world = _rank(comm)
    path = Path(path)
    what = f"save_pieces(path={str(path)!r})"
    problems = [m for p in pieces for m in p.problems()]
    problems += [f"'{p.tensor}': no data" for p in pieces if p.data is None]
    problems += [
        f"'{p.tensor}': dtype {p.dtype} not storable" for p in pieces if dtype_name(p.dtype) is None
    ]
    tmp = None
    if rank == 0:
        try:
            problems += _prepare(path)
            if not problems:
                tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
                tmp.mkdir()
        except OSError as e:
            problems.append(f"cannot create a directory beside {str(path)!r}: {e}")
    ok = not problems
    report = {
        "problems": problems,
        "tmp": str(tmp),
        "rank": rank,
        "file": file_name(rank, world),
        "tensors": {
            p.tensor: {"shape": list(p.shape), "dtype": dtype_name(p.dtype)} for p in pieces
        },
        "pieces": [dict(p.describe(), key=k) for p, k in zip(pieces, _keys(pieces), strict=True)]
        if ok
        else [],
    }
    every = _exchange(comm, what, report)
    problems = [f"on rank {r['rank']}: {m}" for r in every for m in r["problems"]]
    if not problems:
        problems = _global_problems(every)
    if problems:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{what}: rank {rank}: " + "; ".join(problems))
    tmp = Path(every[0]["tmp"])
    mine = tmp / report["file"]
    error = None
    try:
        meta = {"format": FORMAT, "rank": str(rank), "world_size": str(world)}
        meta["pieces"] = json.dumps(report["pieces"])
        write_safetensors(mine, pieces, meta)
        size = mine.stat().st_size
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error, size = f"{type(e).__name__}: {e}", 0
    try:
        done = _exchange(comm, what, {"error": error, "bytes": size})
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"{e}; the checkpoint was not written: {str(path)!r} is unchanged"
        ) from e.__cause__
    failed = [f"rank {r}: {d['error']}" for r, d in enumerate(done) if d["error"]]
    if not failed and rank == 0:
        try:
            files = {r["file"]: d["bytes"] for r, d in zip(every, done, strict=True)}
            index = make_index(world, every, files, extra)
            _write_json(tmp / INDEX, index)
            _publish(tmp, path)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            failed.append(f"rank 0 (publishing): {type(e).__name__}: {e}")
    if rank == 0 and failed:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = sorted({f for d in _exchange(comm, what, failed) for f in d})
    if failed:
        raise CheckpointError(
            f"{what}: rank {rank}: writing failed on {'; '.join(failed)}; "
            f"{str(path)!r} is unchanged"
        )
    return path


def _prepare(path: Path) -> list[str]:
    """Rank 0, before a save: what forbids replacing `path`; removes the
    unfinished saves (DIR.tmp-*) a crash left beside it."""
    if path.exists() and not (
        path.is_dir() and ((path / INDEX).is_file() or not any(path.iterdir()))
    ):
        return [f"path {str(path)!r} exists and is not a checkpoint: refusing to replace it"]
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(path.name + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return []


def _global_problems(every: list[dict[str, Any]]) -> list[str]:
    """Tensors whose ranks disagree on shape or dtype, or whose pieces overlap."""
    out = []
    seen: dict[str, tuple[Any, int]] = {}
    found: dict[str, list[tuple[int, dict]]] = {}
    for rep in every:
        for name, meta in rep["tensors"].items():
            if name in seen and seen[name][0] != meta:
                out.append(
                    f"'{name}' is {seen[name][0]} on rank {seen[name][1]} but {meta} "
                    f"on rank {rep['rank']}"
                )
            seen.setdefault(name, (meta, rep["rank"]))
        for p in rep["pieces"]:
            found.setdefault(p["tensor"], []).append((rep["rank"], p))
    for name, ps in found.items():
        shape = seen[name][0]["shape"]
        rs = [runs(shape, p["offsets"], p["sizes"], p["flat"]) for _, p in ps]
        for a, b in overlaps(rs)[:1]:
            out.append(
                f"'{name}': pieces of ranks {ps[a][0]} and {ps[b][0]} overlap "
                "(save a replicated tensor from one rank)"
            )
        held, numel = sum(n for r in rs for _, _, n in r), math.prod(shape)
        if held != numel and not out:
            out.append(f"'{name}': the pieces hold {held} of its {numel} elements (save all of it)")
    return out


def _write_json(f: Path, data: Any) -> None:
    with open(f, "w") as out:
        json.dump(data, out, indent=1)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False if unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, path: Path) -> None:
    """Makes the finished `tmp` the checkpoint at `path` (replacing one there)."""
    _fsync_dir(tmp)
    if path.exists():
        if not _rename_exchange(tmp, path):  # not atomic: a crash between leaves only tmp
            old = path.with_name(f"{path.name}.tmp-old-{uuid.uuid4().hex[:12]}")
            os.rename(path, old)
            os.rename(tmp, path)
            tmp = old
        shutil.rmtree(tmp)  # now the previous checkpoint
    else:
        os.rename(tmp, path)
    _fsync_dir(path.parent)


def load_pieces(
    comm: Communicator | None,
    path: str | os.PathLike,
    pieces: list[Piece],
    problems: list[str] | None = None,
    *,
    what: str | None = None,
) -> Any:
    """Collective: fills every wanted piece's data from the checkpoint at
    `path` (saved in any layout); returns the `extra` it was saved with.

    Each rank reads only the byte ranges of the saved pieces its own pieces
    overlap. Data is cast to the wanted piece's dtype. `problems` are the
    caller's own findings, raised together with these; `what` names the
    operation in errors (default: load_pieces(path)).

    Raises ValueError on every rank if any rank finds a problem: no
    checkpoint at `path`, a tensor it lacks, another shape, elements the
    checkpoint does not hold; CheckpointError on every rank if the
    checkpoint is not well formed (its index, or the header of a file some
    rank reads: validate.py) or if reading fails on some rank.
    """
    what = what or f"load_pieces(path={str(path)!r})"
    return load_from(comm, path, None, pieces, problems, what)


def load_from(
    comm: Communicator | None,
    path: str | os.PathLike,
    opened: Checkpoint | None,
    pieces: list[Piece],
    problems: list[str] | None,
    what: str,
) -> Any:
    """load_pieces, from the checkpoint `opened` at `path` if not None (its
    index already checked: load() reads it first; the caller closes it)."""
    rank, _ = _rank(comm)
    local, corrupt = list(problems or []), []
    plan: list[tuple[Piece, dict[str, Any], list[tuple[int, int, int]]]] = []
    ck = opened
    try:
        try:
            ck = ck or Checkpoint(path)
            local += _plan(ck, pieces, plan)
            for f in dict.fromkeys(s["file"] for _, s, _ in plan):
                ck.file(f)  # every header this rank reads from, checked before any data
        except CheckpointError as e:
            corrupt.append(str(e))
        except OSError as e:
            local.append(str(e))
        _verdict(comm, what, local, corrupt)
        assert ck is not None
        error = None
        try:
            _execute(ck, plan)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            error = f"{type(e).__name__}: {e}"
        failed = [f"rank {r}: {e}" for r, e in enumerate(_exchange(comm, what, error)) if e]
        if failed:
            raise CheckpointError(f"{what}: rank {rank}: reading failed on " + "; ".join(failed))
        return ck.index.get("extra")
    finally:
        if ck is not None and opened is None:
            ck.close()


def _verdict(comm: Communicator | None, what: str, local: list[str], corrupt: list[str]) -> None:
    """Collective: every rank raises CheckpointError if any rank found the
    checkpoint malformed, else ValueError if any rank found a problem."""
    rank = 0 if comm is None else comm.rank
    every = _exchange(comm, what, {"p": local, "c": corrupt})
    for key, error in (("c", CheckpointError), ("p", ValueError)):
        found: dict[str, list[int]] = {}
        for r, e in enumerate(every):
            for m in e[key]:
                found.setdefault(m, []).append(r)
        if found:
            if comm is None or comm.world_size == 1:
                raise error(f"{what}: rank 0: " + "; ".join(found))
            msgs = [
                f"on {'rank ' + str(rs[0]) if len(rs) == 1 else f'ranks {rs}'}: {m}"
                for m, rs in found.items()
            ]
            raise error(f"{what}: rank {rank}: " + "; ".join(msgs))


def _plan(ck: Checkpoint, pieces: list[Piece], plan: list) -> list[str]:
    """Appends (wanted piece, saved piece, copies) to `plan`; returns the problems."""
    out = []
    index = ck.index
    saved: dict[str, list[tuple[dict[str, Any], list]]] = {}
    for p, rs in zip(index["pieces"], ck.runs, strict=True):
        saved.setdefault(p["tensor"], []).append((p, rs))
    missing = []
    for p in pieces:
        bad = p.problems() + ([f"'{p.tensor}': no data to load into"] if p.data is None else [])
        if p.data is not None and not p.data.is_contiguous():
            bad.append(f"'{p.tensor}': data is not contiguous")
        meta = index["tensors"].get(p.tensor)
        if meta is None:
            missing.append(p.tensor)
            continue
        if list(p.shape) != meta["shape"]:
            bad.append(f"'{p.tensor}' has shape {list(p.shape)} here but {meta['shape']} saved")
        if bad:
            out += bad
            continue
        want = runs(p.shape, p.offsets or (), p.sizes or (), p.flat)
        covered = 0  # saved pieces never overlap (validate.py): no element counts twice
        for s, rs in saved.get(p.tensor, []):
            ops = copy_plan(want, rs)
            if ops:
                plan.append((p, s, ops))
                covered += sum(n for _, _, n in ops)
        if covered != p.numel:
            out.append(
                f"'{p.tensor}': the checkpoint holds {covered} of the {p.numel} elements wanted"
            )
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        out.append(f"tensors {missing[:8]}{more} are not in the checkpoint")
    return out


def _execute(ck: Checkpoint, plan: list) -> None:
    """Reads, per (wanted, saved) pair, the saved piece's byte span the copies
    touch (inside its entry: checked by validate.py)."""
    for p, s, ops in plan:
        fd, start, header = ck.file(s["file"])
        where = str(ck.path / s["file"])
        entry = header[s["key"]]
        dtype = dtype_from_name(ck.index["tensors"][p.tensor]["dtype"], where)
        lo = min(o[1] for o in ops)
        hi = max(o[1] + o[2] for o in ops)
        size = dtype.itemsize
        begin = start + entry["data_offsets"][0] + lo * size
        src = torch.frombuffer(read_range(fd, begin, (hi - lo) * size, where), dtype=dtype)
        dst = p.data.view(-1)
        with torch.no_grad():
            for d, sp, n in ops:
                dst[d : d + n].copy_(src[sp - lo : sp - lo + n])
