"""load(): a checkpoint saved by save() in any layout, into a model and
optimizer in this one (ZeroOptimizer of any stage and world size,
fully_shard with a torch optimizer, a plain model with a torch optimizer).

Each rank asks for its own parts (pieces) of every parameter and of its
optimizer state, by name, so the layout that wrote them does not matter; it
reads only the byte ranges that hold them. A fresh optimizer gets its state
created (the checkpoint's state keys, dtypes and values); the hyperparameters
of each optimizer group whose parameters all came from one saved group are
restored (a learning-rate schedule continues). After the load, unsharded
parameters (ZeRO-1/2) are all-gathered from the shards, and gathered ones
are freed, so the next forward uses the loaded values.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator

from .format import dtype_from_name
from .piece_files import load_from, load_pieces
from .pieces import Piece
from .saving import OPTIM
from .state import Entry, Layout, collect
from .validate import Checkpoint, CheckpointError

__all__ = ["load"]


def load(
    path: str | os.PathLike,
    comm: Communicator | None,
    model: nn.Module,
    optimizer: Any = None,
    *,
    strict: bool = True,
) -> Any:
    """Collective: loads the checkpoint at `path` into `model` and
    `optimizer` (as save() takes them; None: the model alone); returns the
    `extra` given to save().

    strict: the checkpoint's parameters and buffers must be exactly the
    model's (names and shapes); False loads the ones both have.

    Raises ValueError on every rank when any rank finds a problem: no
    checkpoint at `path`, another model (the missing, unexpected and
    differently shaped names listed), another optimizer class; the model and
    optimizer are then unchanged. CheckpointError on every rank if the
    checkpoint is not well formed (validate.py) or reading fails on a rank.
    """
    what = f"load(path={str(path)!r})"
    lay = collect(model, optimizer, comm, what)
    try:
        ck = Checkpoint(path)  # checked once, read by every load_from below
    except (OSError, CheckpointError):
        return load_pieces(comm, path, [], what=what)  # raises the same error on every rank
    with ck:
        return _load(comm, path, ck, lay, strict, what)


def _load(
    comm: Communicator | None,
    path: str | os.PathLike,
    ck: Checkpoint,
    lay: Layout,
    strict: bool,
    what: str,
) -> Any:
    """load(), from the opened checkpoint `ck`."""
    index = ck.index
    saved = index["tensors"]
    problems = _model_problems(lay.entries, saved, strict)
    pieces = [
        Piece(e.name, e.shape, e.dtype, flat=e.flat, data=e.value)
        for e in lay.entries
        if e.value.numel() and (strict or e.name in saved) and not problems
    ]
    meta = index.get("extra") or {}
    created: list[tuple[Any, str]] = []
    if lay.optimizer is not None and "optimizer" in meta:
        cls = type(lay.optimizer).__name__
        if problems:
            pass  # another model: its optimizer state is not looked at
        elif meta["optimizer"]["class"] != cls:
            problems.append(
                f"optimizer is a {cls}, the checkpoint's a {meta['optimizer']['class']}"
            )
        else:
            problems += _flat_scalar_problems(comm, path, ck, lay, saved, what)
            pieces += [] if problems else _state_pieces(lay, saved, created)
    try:
        load_from(comm, path, ck, pieces, problems, what)
    except BaseException:
        for p, k in created:  # leave the optimizer as it was
            st = lay.optimizer.state[p]  # type: ignore[union-attr]
            st.pop(k, None)
            if not st:
                del lay.optimizer.state[p]  # type: ignore[union-attr]
        raise
    if lay.optimizer is not None and "optimizer" in meta:
        _restore_groups(lay, meta["optimizer"])
    if lay.engine is not None:
        lay.engine.shards_written()
    return meta.get("user")


def _model_problems(entries: list[Entry], saved: dict[str, Any], strict: bool) -> list[str]:
    """Missing, unexpected and differently shaped names, as one message."""
    here = {e.name: list(e.shape) for e in entries}
    ours = {n: m["shape"] for n, m in saved.items() if not n.startswith(OPTIM)}
    missing = sorted(set(here) - set(ours))
    unexpected = sorted(set(ours) - set(here))
    shapes = [
        f"{n} {ours[n]} saved, {here[n]} here" for n in here if n in ours and ours[n] != here[n]
    ]
    parts = []
    if strict and missing:
        parts.append(f"missing {_some(missing)}")
    if strict and unexpected:
        parts.append(f"unexpected {_some(unexpected)}")
    if shapes:
        parts.append(f"shapes differ: {_some(shapes)}")
    if not parts:
        return []
    return ["the checkpoint is of another model (model=" + "; ".join(parts) + ")"]


def _some(names: list[str], n: int = 8) -> str:
    return str(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _saved_state(saved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer state entries: parameter name -> state key -> metadata."""
    keys: dict[str, dict[str, Any]] = {}
    for name, m in saved.items():
        if name.startswith(OPTIM):
            k, _, param = name[len(OPTIM) :].partition("/")
            keys.setdefault(param, {})[k] = m
    return keys


def _flat_scalar_problems(
    comm: Communicator | None,
    path: str | os.PathLike,
    ck: Checkpoint,
    lay: Layout,
    saved: dict[str, Any],
    what: str,
) -> list[str]:
    """Collective (ZeroOptimizer layouts): a ZeroOptimizer keeps one scalar
    state (AdamW's `step`) per flat parameter, where the checkpoint keeps one
    per parameter. Reads the saved scalars of the parameters that share a flat
    (every rank reads them all, so every rank finds the same) and reports the
    flats whose parameters saved different values: a per-parameter optimizer
    (fully_shard, a plain model) that gave some parameter no gradient in some
    steps. Loading one value for all would change those parameters' updates."""
    if not lay.kind.startswith("zero"):
        return []
    keys = _saved_state(saved)
    groups: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
    for e in lay.entries:
        if e.opt_param is None or e.shape == ():
            continue
        for k, m in keys.get(e.name, {}).items():
            if m["shape"] == []:
                t = torch.zeros((), dtype=dtype_from_name(m["dtype"], f"'{OPTIM}{k}/{e.name}'"))
                groups.setdefault((id(e.opt_param), k), []).append((e.name, t))
    shared = [(k, g) for (_, k), g in groups.items() if len(g) > 1]
    pieces = [Piece.whole(f"{OPTIM}{k}/{n}", t) for k, g in shared for n, t in g]
    if not pieces:
        return []
    load_from(comm, path, ck, pieces, None, what)
    out = []
    for k, g in shared:
        values: dict[float, list[str]] = {}
        for n, t in g:
            values.setdefault(t.item(), []).append(n)
        if len(values) > 1:
            found = "; ".join(f"{v:g} for {_some(ns, 3)}" for v, ns in sorted(values.items()))
            out.append(
                f"the checkpoint's optimizer state '{k}' differs between parameters that share "
                f"one ZeroOptimizer flat parameter ({found}): a ZeroOptimizer keeps one '{k}' "
                "per unit and dtype; load this checkpoint into fully_shard or a plain model "
                "with a torch optimizer, which keep one per parameter"
            )
    return out


def _state_pieces(
    lay: Layout, saved: dict[str, Any], created: list[tuple[Any, str]]
) -> list[Piece]:
    """Pieces that fill each entry's optimizer state (created where the
    optimizer has none yet); one scalar per optimizer parameter (ZeroOptimizer:
    per flat parameter, whose parameters _flat_scalar_problems found equal)."""
    opt = lay.optimizer
    assert opt is not None
    keys = _saved_state(saved)
    device = {
        id(p): (p.device if g.get("capturable") or g.get("fused") else torch.device("cpu"))
        for g in opt.param_groups
        for p in g["params"]
    }
    pieces, scalars = [], set()
    for e in lay.entries:
        if e.opt_param is None or e.name not in keys:
            continue
        p = e.opt_param
        st = opt.state[p]
        for k, m in keys[e.name].items():
            dtype = dtype_from_name(m["dtype"], f"tensor '{OPTIM}{k}/{e.name}'")
            name = f"{OPTIM}{k}/{e.name}"
            scalar = m["shape"] == [] and e.shape != ()
            if k not in st:
                shape: tuple[int, ...] = () if scalar else tuple(p.shape)
                dev = device.get(id(p), p.device) if scalar else p.device
                st[k] = torch.zeros(shape, dtype=dtype, device=dev)
                created.append((p, k))
            t = st[k]
            if scalar:
                if (id(p), k) not in scalars:  # a ZeRO flat: its first parameter's
                    scalars.add((id(p), k))
                    pieces.append(Piece.whole(name, t))
                continue
            part = t if e.span is None else t[e.span[0] : e.span[1]]
            if part.numel():
                pieces.append(Piece(name, e.shape, t.dtype, flat=e.flat, data=part))
    return pieces


def _restore_groups(lay: Layout, meta: dict[str, Any]) -> None:
    """Hyperparameters of each group whose parameters all came from one saved group."""
    opt = lay.optimizer
    assert opt is not None
    names: dict[int, list[str]] = {}
    for e in lay.entries:
        if e.opt_param is not None:
            names.setdefault(id(e.opt_param), []).append(e.name)
    for grp in opt.param_groups:
        src = {meta["group_of"].get(n) for p in grp["params"] for n in names.get(id(p), [])}
        if len(src) != 1 or None in src:
            continue
        for k, v in meta["param_groups"][src.pop()].items():
            if k in grp and _number(grp[k]) and _number(v):  # lr, betas, eps, weight_decay...
                grp[k] = tuple(v) if isinstance(grp[k], tuple) else v


def _number(v: Any) -> bool:
    """A numeric hyperparameter (flags such as foreach or fused stay as they are)."""
    if isinstance(v, (list, tuple)):
        return bool(v) and all(_number(x) for x in v)
    return isinstance(v, (int, float)) and not isinstance(v, bool)
