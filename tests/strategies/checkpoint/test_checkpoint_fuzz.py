"""Random mutations of real checkpoints (issue 30, point 5): index.json and
the safetensors headers of checkpoints written by save_pieces from one
process and from 2 ranks and by save(), mutated (numbers changed, fields
removed, retyped or renamed, values swapped or duplicated, duplicate keys,
bytes flipped, files truncated or extended), seeded. load_pieces and
consolidate must each raise CheckpointError or give exactly the saved
values (a tensor without elements may come back with another shape: only
the index records it), never another exception, a crash or a hang, and
agree with each other; a header the `safetensors` package rejects is rejected too. On 2
ranks, every rank comes to the same verdict."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pycollectives as pc
from pycollectives.strategies.checkpoint import (
    CheckpointError,
    Piece,
    consolidate,
    load_pieces,
    read_index,
    save,
    save_pieces,
)

CASES, SEED = 600, 30
G = torch.arange(60, dtype=torch.float32).view(6, 10) / 7
H = (torch.arange(7, dtype=torch.float32) - 3).to(torch.bfloat16)
I64 = torch.arange(12, dtype=torch.int64).view(3, 4) * -5


def _one_process(d: Path) -> None:
    right = G[:, 4:].reshape(-1)
    save_pieces(
        None,
        d,
        [
            Piece("w", (6, 10), torch.float32, (0, 0), (6, 4), data=G[:, :4].contiguous()),
            Piece(
                "w", (6, 10), torch.float32, (0, 4), (6, 6), flat=(0, 13), data=right[:13].clone()
            ),
            Piece(
                "w", (6, 10), torch.float32, (0, 4), (6, 6), flat=(13, 36), data=right[13:].clone()
            ),
            Piece.whole("h", H.clone()),
            Piece.whole("i", I64.clone()),
            Piece.whole("optim/step/w", torch.tensor(5.0)),
            Piece.whole("empty", torch.zeros(0, 3)),
        ],
        extra={"step": 5},
    )


def job_save_two(comm: pc.Communicator, path: str) -> None:
    """w split along dim 1, i as flat halves, h by rank 0."""
    r = comm.rank
    pieces = [
        Piece(
            "w",
            (6, 10),
            torch.float32,
            (0, 5 * r),
            (6, 5),
            data=G[:, 5 * r : 5 * r + 5].contiguous(),
        ),
        Piece(
            "i",
            (3, 4),
            torch.int64,
            flat=(6 * r, 6 * r + 6),
            data=I64.view(-1)[6 * r : 6 * r + 6].clone(),
        ),
    ]
    if r == 0:
        pieces.append(Piece.whole("h", H.clone()))
    save_pieces(comm, path, pieces, extra={"ranks": 2})


def _with_save(d: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save(d, None, model, opt, extra={"step": 1})


def _saved(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the (intact) checkpoint, whole."""
    from pycollectives.strategies.checkpoint.format import dtype_from_name

    out = {}
    for n, m in read_index(d)["tensors"].items():
        out[n] = torch.zeros(m["shape"], dtype=dtype_from_name(m["dtype"], n))
    load_pieces(None, d, [Piece.whole(n, t) for n, t in out.items()])
    return out


# --- mutations ---------------------------------------------------------------------------

ODD = ["a", None, [], {}, 1.5, True, [None], {"x": 1}, -1, "0", 2**64, [0, "a"], float("nan")]


def _slots(obj: Any, top: bool = True) -> list[tuple[Any, Any]]:
    """Every (container, key) in a JSON value (the index's user "extra" left out)."""
    out: list[tuple[Any, Any]] = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    for k, v in items:
        if top and k == "extra":
            continue
        out.append((obj, k))
        out += _slots(v, False)
    return out


def _dump(obj: Any, dup: int | None) -> str:
    """JSON text; the dict with id `dup` gets its first key a second time."""
    if isinstance(obj, dict):
        items = [f"{json.dumps(k)}:{_dump(v, dup)}" for k, v in obj.items()]
        if id(obj) == dup and items:
            items.append(items[0].split(":", 1)[0] + ":" + json.dumps(ODD[len(items) % len(ODD)]))
        return "{" + ",".join(items) + "}"
    if isinstance(obj, list):
        return "[" + ",".join(_dump(v, dup) for v in obj) + "]"
    return json.dumps(obj)


def _mutate_json(rng: random.Random, obj: Any) -> str:
    """One random structural mutation of `obj` (in place), as JSON text."""
    slots = _slots(obj)
    c, k = rng.choice(slots)
    v = c[k]
    op = rng.choice(["number", "retype", "remove", "rename", "swap", "dup_list", "dup_key"])
    dup = None
    if op == "number" or (op == "retype" and isinstance(v, int) and rng.random() < 0.5):
        base = v if type(v) is int else rng.randrange(100)
        c[k] = rng.choice([base + 1, base - 1, -base - 1, base * 2, 0, 2**63, base + 2**40, 7])
    elif op == "retype":
        c[k] = rng.choice(ODD)
    elif op == "remove":
        c.pop(k)
    elif op == "rename" and isinstance(c, dict):
        new = rng.choice([f"{k}x", f"../{k}", "/etc/passwd", k[:-1], "w#1", "h"])
        c[new] = c.pop(k)
    elif op == "swap":
        others = list(c.keys() if isinstance(c, dict) else range(len(c)))
        j = rng.choice(others)
        c[k], c[j] = c[j], c[k]
    elif op == "dup_list" and isinstance(c, list):
        c.insert(k, json.loads(json.dumps(v)))
    else:
        dicts = [s[0] for s in slots if isinstance(s[0], dict)]
        dup = id(rng.choice(dicts)) if dicts else None
    return _dump(obj, dup)


def _header(raw: bytes) -> tuple[int, dict]:
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


def mutate(rng: random.Random, d: Path) -> str:
    """Mutates the checkpoint at `d` once; returns what was done."""
    shards = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")
    target = rng.choice([d / "index.json"] + shards)
    raw = target.read_bytes()
    kind = rng.choice(["json", "json", "json", "meta", "flip", "truncate", "extend", "length"])
    if target.name == "index.json":
        kind = {"meta": "json", "length": "flip"}.get(kind, kind)
        head_end = len(raw)
    else:
        n, head = _header(raw)
        head_end = 8 + n
    if kind == "json" and target.name == "index.json":
        target.write_text(_mutate_json(rng, json.loads(raw)))
    elif kind in ("json", "meta"):
        if kind == "meta":  # inside the header's own JSON copy of the pieces
            pieces = json.loads(head["__metadata__"]["pieces"]) or [{}]
            head["__metadata__"]["pieces"] = _mutate_json(rng, pieces)
            text = json.dumps(head, separators=(",", ":"))
        else:
            text = _mutate_json(rng, head)
        body = text.encode() + b" " * (-len(text.encode()) % 8)
        target.write_bytes(len(body).to_bytes(8, "little") + body + raw[head_end:])
        if rng.random() < 0.7:  # the index's size follows: only the header is wrong
            index = json.loads((d / "index.json").read_text())
            if target.name in index["files"]:
                index["files"][target.name]["bytes"] = target.stat().st_size
                (d / "index.json").write_text(json.dumps(index))
    elif kind == "flip":
        at = rng.randrange(head_end)
        target.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :])
    elif kind == "truncate":
        target.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind == "extend":
        target.write_bytes(raw + bytes(rng.randrange(1, 64)))
    else:
        n = int.from_bytes(raw[:8], "little")
        new = rng.choice([0, n - 8, n + 8, n + 1, 2**63, 2**64 - 1, len(raw)])
        target.write_bytes(new.to_bytes(8, "little") + raw[8:])
    return f"{kind} {target.name}"


# --- the properties ----------------------------------------------------------------------


def _load_outcome(d: Path, saved: dict[str, torch.Tensor], comm: Any = None) -> str:
    """'ok' (exactly the saved values) or 'CheckpointError'; anything else raises."""
    got = {n: torch.zeros_like(t) for n, t in saved.items()}
    try:
        load_pieces(comm, d, [Piece.whole(n, t) for n, t in got.items()])
    except CheckpointError:
        return "CheckpointError"
    except ValueError as e:
        # the one well-formed change a single mutation can make: the shape of a tensor
        # without elements, which only the index records (no values differ)
        m = re.search(r"'([^']+)' has shape \[[\d, ]*\] here but \[[\d, ]*\] saved", str(e))
        assert m and saved[m.group(1)].numel() == 0, f"ValueError: {e}"
        return "ok"
    for n, t in saved.items():
        assert torch.equal(got[n], t), f"load_pieces returned other values for {n!r}"
    return "ok"


def _consolidate_outcome(d: Path, saved: dict[str, torch.Tensor], out: Path) -> str:
    try:
        consolidate(d, out)
    except CheckpointError:
        assert not out.exists()
        return "CheckpointError"
    from safetensors.torch import load_file

    got = load_file(str(out))
    assert sorted(got) == sorted(saved), "consolidate wrote other tensors"
    for n, t in saved.items():
        same = got[n].numel() == 0 if t.numel() == 0 else torch.equal(got[n], t)
        assert same, f"consolidate wrote other values for {n!r}"
    out.unlink()
    return "ok"


def _safetensors_rejects(f: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no iteration
                st.get_tensor(k)
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


@pytest.fixture(scope="module")
def bases(tmp_path_factory, pool) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("bases")
    _one_process(root / "one")
    pool(2).run(job_save_two, str(root / "two"), timeout=60)
    _with_save(root / "save")
    return {k: (root / k, _saved(root / k)) for k in ("one", "two", "save")}


def test_intact_bases_load_their_values(bases):
    one = bases["one"][1]
    assert torch.equal(one["w"], G) and torch.equal(one["h"], H) and torch.equal(one["i"], I64)
    two = bases["two"][1]
    assert torch.equal(two["w"], G) and torch.equal(two["i"], I64)


def test_fuzz_index_and_headers(bases, tmp_path):
    rng = random.Random(SEED)
    start, seen = time.monotonic(), {"ok": 0, "CheckpointError": 0}

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("the fuzz ran past 120 s: a mutation hangs a reader")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        _fuzz(bases, tmp_path, rng, seen)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - start
    print(f"{CASES} mutations in {elapsed:.1f} s: {seen}")
    assert seen["CheckpointError"] > CASES // 2 and seen["ok"] > 0, seen


def _fuzz(bases: dict, tmp_path: Path, rng: random.Random, seen: dict[str, int]) -> None:
    names = sorted(bases)
    for case in range(CASES):
        base, saved = bases[names[case % len(names)]]
        d = tmp_path / f"c{case}"
        shutil.copytree(base, d)
        what = f"case {case} ({base.name}): " + mutate(rng, d)
        try:
            loaded = _load_outcome(d, saved)
            merged = _consolidate_outcome(d, saved, tmp_path / "out.safetensors")
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        assert loaded == merged, f"{what}: load_pieces {loaded}, consolidate {merged}"
        if loaded == "ok":  # a header the safetensors package rejects is rejected here too
            for f in d.glob("*.safetensors"):
                assert not _safetensors_rejects(f), f"{what}: safetensors rejects {f.name}"
        seen[loaded] += 1
        shutil.rmtree(d)


def job_fuzz_two_ranks(comm: pc.Communicator, dirs: list[str]) -> list[str]:
    """Rank r loads what rank r saved (so reads file r only): 'ok' (the saved
    values), 'CheckpointError' or what else happened, per checkpoint."""
    r, out = comm.rank, []
    for d in dirs:
        w, i = torch.zeros(6, 5), torch.zeros(6, dtype=torch.int64)
        pieces = [
            Piece("w", (6, 10), torch.float32, (0, 5 * r), (6, 5), data=w),
            Piece("i", (3, 4), torch.int64, flat=(6 * r, 6 * r + 6), data=i),
        ]
        try:
            load_pieces(comm, d, pieces)
            same = torch.equal(w, G[:, 5 * r : 5 * r + 5]) and torch.equal(
                i, I64.view(-1)[6 * r : 6 * r + 6]
            )
            out.append("ok" if same else "wrong values")
        except CheckpointError:
            out.append("CheckpointError")
        except Exception as e:  # noqa: BLE001 - the test reports it
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_fuzz_two_ranks_agree(bases, pool, tmp_path):
    """Each rank reads only its own file: every rank comes to the same
    verdict, CheckpointError or the saved values, whichever file is corrupt."""
    rng = random.Random(SEED + 1)
    base = bases["two"][0]
    dirs, what = [], []
    for case in range(30):
        d = tmp_path / f"c{case}"
        shutil.copytree(base, d)
        what.append(mutate(rng, d))
        dirs.append(str(d))
    r0, r1 = pool(2).run(job_fuzz_two_ranks, dirs, timeout=120)
    for case, (a, b) in enumerate(zip(r0, r1, strict=True)):
        assert a in ("ok", "CheckpointError") and a == b, (case, what[case], a, b)
    assert "CheckpointError" in r0
