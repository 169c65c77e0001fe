"""The one gate between a checkpoint directory and the readers (load,
load_pieces, consolidate, read_index): everything in index.json and in each
file's header is checked before a byte of tensor data is read, and no file
outside the directory is ever opened.

- Files: only index.json and the names the index lists, each exactly the
  writer's own `shard-RRRRR-of-WWWWW.safetensors` for its rank, opened with
  O_NOFOLLOW relative to a descriptor of the directory (a name with a slash,
  "..", an absolute path or a symbolic link is refused), regular files only
  (a FIFO cannot block the reader: O_NONBLOCK), of the size the index says.
- index.json: every field of its type (ints are ints, never bools or floats),
  dtype names known, shapes of non-negative ints (at most 64 dimensions,
  2**62 bytes), each piece's box inside its tensor and its flat range inside
  its box, the writer's keys (a tensor's k-th piece in a file is "name" then
  "name#k"), no two pieces of a tensor sharing an element, and every tensor
  covered whole (elements counted once): so no tensor is larger than the data
  on disk, whatever shape the index claims.
- Each file's header (checked when a reader first needs the file): the
  8-byte length bounded by the file's size (and 100 MiB) before anything is
  allocated; JSON without duplicate keys or NaN; entries of known dtypes,
  `0 <= start <= end <= data size`, size = prod(shape) x itemsize, laid out
  one after the other in the index's order from byte 0 to the end of the file
  (disjoint, nothing between or after); its metadata (rank, world size, the
  pieces it holds) the same as the index's.

Anything else raises CheckpointError naming the file, the tensor and the
field. Not checked: the tensor values themselves (no checksums): a
checkpoint can hold wrong but well-formed values.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .format import _STATS, FORMAT, INDEX, ITEMSIZE, VERSION, file_name
from .pieces import Run, overlaps, runs

__all__ = ["Checkpoint", "CheckpointError", "open_dir"]

MAX_INDEX = 256 << 20  # bytes of index.json
MAX_HEADER = 100 << 20  # bytes of a file's JSON header (the safetensors package's bound)
MAX_NDIM, MAX_BYTES, MAX_WORLD = 64, 1 << 62, 1 << 24
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded: a rank failed or died while
    writing or reading, or the files are not a well-formed checkpoint (the
    message names the file, the tensor and the field). The previous
    checkpoint at the path is untouched."""


def _fail(where: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{where}: {msg}")


def _is_int(x: Any, lo: int = 0, hi: int = MAX_BYTES) -> bool:
    return type(x) is int and lo <= x <= hi


def _ints(x: Any, n: int | None = None) -> bool:
    return isinstance(x, list) and (n is None or len(x) == n) and all(_is_int(v) for v in x)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        k = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {k!r}")
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes, where: str) -> Any:
    """JSON from untrusted bytes: CheckpointError for bad UTF-8, bad syntax,
    duplicate keys, NaN/Infinity or nesting past the interpreter's recursion limit."""
    try:
        return json.loads(raw.decode(), object_pairs_hook=_unique, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise _fail(where, f"not valid JSON ({type(e).__name__}: {e})") from None


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor of the checkpoint directory `path` (the caller's path,
    followed as given). FileNotFoundError naming an unfinished save beside it."""
    d = Path(path)
    try:
        return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        hint = ""
        siblings = sorted(d.parent.glob(d.name + ".tmp-*")) if d.parent.is_dir() else []
        if siblings:
            hint = f" ({siblings[0].name} beside it is an unfinished save, never a checkpoint)"
        raise FileNotFoundError(f"checkpoint directory {str(d)!r} does not exist{hint}") from None


def open_member(dfd: int, name: str, where: str) -> tuple[int, int]:
    """(fd, size) of the regular file `name` inside the directory `dfd`,
    never following a link; CheckpointError naming `where` otherwise."""
    try:
        fd = os.open(name, _FLAGS, dir_fd=dfd)
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno.ELOOP else os.strerror(e.errno or 0)
        raise _fail(where, f"cannot open it: {why}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _fail(where, "is not a regular file")
    return fd, st.st_size


def pread(fd: int, offset: int, n: int, where: str) -> bytes:
    out = b""
    while len(out) < n:
        got = os.pread(fd, n - len(out), offset + len(out))
        if not got:
            raise _fail(where, f"ends at byte {offset + len(out)}, expected {offset + n}")
        out += got
    return out


def _shape(x: Any) -> bool:
    return _ints(x) and len(x) <= MAX_NDIM and all(v <= MAX_BYTES for v in x)


def check_index(index: Any, size_of: Callable[[str], int], where: str) -> list[list[Run]]:
    """Checks an index (see the module's docstring) against the sizes of its
    files (`size_of(name)`, asked only for the writer's names); returns each
    piece's runs. Raises CheckpointError."""
    if not isinstance(index, dict):
        raise _fail(where, "is not a JSON object")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise _fail(
            where,
            f"format {index.get('format')!r} version {index.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}",
        )
    world = index.get("world_size")
    if not _is_int(world, 1, MAX_WORLD):
        raise _fail(where, f"field 'world_size' must be an int in [1, {MAX_WORLD}], got {world!r}")
    files, tensors, pieces = index.get("files"), index.get("tensors"), index.get("pieces")
    for field, v, t in (
        ("files", files, dict),
        ("tensors", tensors, dict),
        ("pieces", pieces, list),
    ):
        if not isinstance(v, t):
            raise _fail(where, f"field {field!r} must be a JSON {t.__name__}, got {v!r:.80}")
    files_size: dict[str, int] = {}
    for name, f in files.items():
        w = f"{where}: files[{name!r}]"
        if not isinstance(f, dict) or not _is_int(f.get("rank"), 0, world - 1):
            raise _fail(w, f"field 'rank' must be an int in [0, {world}), got {f!r:.80}")
        if name != file_name(f["rank"], world):
            raise _fail(w, f"not the writer's name for rank {f['rank']} of {world}: refused")
        if not _is_int(f.get("bytes")):
            raise _fail(w, f"field 'bytes' must be an int >= 0, got {f.get('bytes')!r:.80}")
        files_size[name] = size_of(name)
        if f["bytes"] != files_size[name]:
            raise _fail(w, f"the file has {files_size[name]} bytes, the index says {f['bytes']}")
    for name, m in tensors.items():
        w = f"{where}: tensor {name!r}"
        if not name or name == "__metadata__" or not isinstance(m, dict):
            raise _fail(w, "must be a non-empty name with {'shape', 'dtype'}")
        if not isinstance(m.get("dtype"), str) or m["dtype"] not in ITEMSIZE:
            raise _fail(
                w, f"field 'dtype': {m.get('dtype')!r:.40} is not one of {sorted(ITEMSIZE)}"
            )
        if not _shape(m.get("shape")) or math.prod(m["shape"]) * ITEMSIZE[m["dtype"]] > MAX_BYTES:
            raise _fail(w, f"field 'shape' must be a list of ints >= 0, got {m.get('shape')!r:.80}")
    keys: dict[tuple[str, str], int] = {}
    stored = dict.fromkeys(files, 0)
    out: list[list[Run]] = []
    for i, p in enumerate(pieces):
        w = f"{where}: pieces[{i}]"
        if not (
            isinstance(p, dict)
            and isinstance(p.get("tensor"), str)
            and p["tensor"] in tensors
            and isinstance(p.get("file"), str)
            and p["file"] in files
        ):
            raise _fail(w, f"fields 'tensor' and 'file' must name a tensor and a file: {p!r:.120}")
        t, f = p["tensor"], p["file"]
        w += f" (tensor {t!r}, file {f})"
        shape = tensors[t]["shape"]
        off, size, flat = p.get("offsets"), p.get("sizes"), p.get("flat")
        if not _ints(off, len(shape)) or not _ints(size, len(shape)):
            raise _fail(
                w, f"fields 'offsets' {off!r:.60}, 'sizes' {size!r:.60}: one int >= 0 per dim"
            )
        if any(o + s > d for o, s, d in zip(off, size, shape, strict=True)):
            raise _fail(w, f"box offsets {off} sizes {size} outside shape {shape}")
        box = math.prod(size)
        if flat is not None and not (_ints(flat, 2) and flat[0] <= flat[1] <= box):
            raise _fail(
                w,
                f"field 'flat' must be null or [start, end], 0 <= start <= end <= {box}, got {flat!r:.60}",
            )
        k = keys.get((f, t), 0)
        keys[(f, t)] = k + 1
        if p.get("key") != (t if k == 0 else f"{t}#{k}"):
            raise _fail(w, f"field 'key' {p.get('key')!r:.80} is not the writer's key for it")
        numel = box if flat is None else flat[1] - flat[0]
        stored[f] += numel * ITEMSIZE[tensors[t]["dtype"]]
        if stored[f] > files_size[f]:
            raise _fail(w, f"the pieces of {f} need more than its {files_size[f]} bytes")
        out.append(runs(shape, off, size, None if flat is None else tuple(flat)))
    by_tensor: dict[str, list[int]] = {t: [] for t in tensors}
    for i, p in enumerate(pieces):
        by_tensor[p["tensor"]].append(i)
    for t, ids in by_tensor.items():
        rs = [out[i] for i in ids]
        for a, b in overlaps(rs)[:1]:
            raise _fail(where, f"tensor {t!r}: pieces[{ids[a]}] and pieces[{ids[b]}] overlap")
        covered, numel = sum(n for r in rs for _, _, n in r), math.prod(tensors[t]["shape"])
        if covered != numel:
            raise _fail(where, f"tensor {t!r}: its pieces hold {covered} of its {numel} elements")
    return out


def check_header(
    head: Any, data: int, index: dict[str, Any], name: str, mine: list[dict], where: str
) -> None:
    """Checks a file's header (`data` bytes after it) against `mine`, the
    index's pieces of file `name` in index order. Raises CheckpointError."""
    if not isinstance(head, dict):
        raise _fail(where, "header is not a JSON object")
    meta = head.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(where, "field '__metadata__' must map strings to strings")
    f = index["files"][name]
    said = parse_json(meta.get("pieces", "null").encode(), f"{where}: field '__metadata__.pieces'")
    want = [{k: v for k, v in p.items() if k != "file"} for p in mine]
    if meta.get("rank") != str(f["rank"]) or meta.get("world_size") != str(index["world_size"]):
        raise _fail(where, "field '__metadata__': rank or world_size differ from the index")
    if said != want:
        raise _fail(where, "field '__metadata__.pieces' differs from the index's pieces")
    entries = {k: v for k, v in head.items() if k != "__metadata__"}
    pos = 0
    for p in mine:
        k, t = p["key"], index["tensors"][p["tensor"]]
        e, w = entries.pop(k, None), f"{where}: tensor {p['tensor']!r} (key {k!r})"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _fail(w, f"entry must hold dtype, shape and data_offsets, got {e!r:.120}")
        if e["dtype"] != t["dtype"]:
            raise _fail(w, f"field 'dtype' is {e['dtype']!r:.40}, the index says {t['dtype']!r}")
        if not _shape(e["shape"]):
            raise _fail(w, f"field 'shape' must be a list of ints >= 0, got {e['shape']!r:.80}")
        numel = math.prod(p["sizes"]) if p["flat"] is None else p["flat"][1] - p["flat"][0]
        if math.prod(e["shape"]) != numel:
            raise _fail(
                w,
                f"field 'shape' {e['shape']} holds {math.prod(e['shape'])} elements, the piece {numel}",
            )
        a = e["data_offsets"]
        if not _ints(a, 2) or not a[0] <= a[1] <= data:
            raise _fail(
                w,
                f"field 'data_offsets' must be [start, end], 0 <= start <= end <= {data}, got {a!r:.80}",
            )
        if a[1] - a[0] != numel * ITEMSIZE[t["dtype"]]:
            raise _fail(
                w,
                f"field 'data_offsets' {a} spans {a[1] - a[0]} bytes, the shape needs {numel * ITEMSIZE[t['dtype']]}",
            )
        if a[0] != pos:
            raise _fail(
                w,
                f"field 'data_offsets' {a} does not follow the previous entry (ends at {pos}): overlapping or out of order",
            )
        pos = a[1]
    if entries:
        raise _fail(where, f"entries {sorted(entries)[:4]} are not in the index")
    if pos != data:
        raise _fail(where, f"its entries end at data byte {pos}, the file at {data}")


class Checkpoint:
    """An open checkpoint directory: `index` (checked), `runs` (each piece's
    runs, in index order) and `file(name)`, a file's (fd, data start,
    header), checked when first asked for. Close it (or use `with`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.dfd = open_dir(path)
        self._files: dict[str, tuple[int, int, dict[str, Any]]] = {}
        self._by_file: dict[str, list[dict[str, Any]]] | None = None
        try:
            self.index, self.runs = self._read_index()
        except BaseException:
            os.close(self.dfd)
            raise

    def _read_index(self) -> tuple[dict[str, Any], list[list[Run]]]:
        where = str(self.path / INDEX)
        try:
            fd = os.open(INDEX, _FLAGS, dir_fd=self.dfd)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{str(self.path)!r} has no {INDEX}: not a checkpoint (or not a complete one)"
            ) from None
        except OSError as e:
            raise _fail(where, f"cannot open it: {os.strerror(e.errno or 0)}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_INDEX:
                raise _fail(where, f"not a regular file of at most {MAX_INDEX} bytes")
            index = parse_json(pread(fd, 0, st.st_size, where), where)
        finally:
            os.close(fd)
        return index, check_index(index, self._size, where)

    def _size(self, name: str) -> int:
        """The size of the regular file `name` (a writer's name: no slash) in the directory."""
        where = str(self.path / name)
        try:
            st = os.stat(name, dir_fd=self.dfd, follow_symlinks=False)
        except OSError as e:
            raise _fail(where, f"listed in the index: {os.strerror(e.errno or 0)}") from None
        if not stat.S_ISREG(st.st_mode):
            raise _fail(where, "is not a regular file (a symbolic link?): refused")
        return st.st_size

    def file(self, name: str) -> tuple[int, int, dict[str, Any]]:
        """(fd, offset of the data, header) of the index's file `name`, checked."""
        if name not in self._files:
            where = str(self.path / name)
            fd, size = open_member(self.dfd, name, where)
            try:
                if size != self.index["files"][name]["bytes"]:
                    raise _fail(
                        where,
                        f"has {size} bytes, the index says {self.index['files'][name]['bytes']}",
                    )
                n = int.from_bytes(pread(fd, 0, 8, where), "little")
                if n > min(size - 8, MAX_HEADER):
                    raise _fail(
                        where, f"header length {n} exceeds the file ({size} bytes) or {MAX_HEADER}"
                    )
                head = parse_json(pread(fd, 8, n, where), f"{where}: header")
                if self._by_file is None:
                    self._by_file = {}
                    for p in self.index["pieces"]:
                        self._by_file.setdefault(p["file"], []).append(p)
                mine = self._by_file.get(name, [])
                check_header(head, size - 8 - n, self.index, name, mine, where)
            except BaseException:
                os.close(fd)
                raise
            _STATS["header_bytes"] += 8 + n
            self._files[name] = (fd, 8 + n, head)
        return self._files[name]

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
