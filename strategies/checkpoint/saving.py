"""save(): a model and its optimizer, in whatever layout they are, as a
sharded checkpoint that loads into any other layout (loading.py).

    from pycollectives.strategies.checkpoint import save, load
    save("ckpt/step-100", comm, model, zero, extra={"step": 100})   # ZeRO-3 on 4 ranks
    ...
    extra = load("ckpt/step-100", comm, model, opt)                 # FSDP on 2 ranks

Tensors in the checkpoint (global names, global shapes):

    <parameter or buffer name>           the model's state_dict names (tied parameters once)
    optim/<state key>/<parameter name>   e.g. optim/exp_avg/blocks.0.mlp.fc.weight, shaped as
                                         the parameter; optim/step/<name> a scalar

The index's "extra" holds {"user": extra, "layout": ..., "optimizer": {"class",
"param_groups" (hyperparameters), "group_of" (parameter name -> group)}}.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from pycollectives import Communicator

from .piece_files import _agree, save_pieces
from .pieces import Piece
from .state import Layout, collect, jsonable, state_of

__all__ = ["OPTIM", "save"]

OPTIM = "optim/"


def save(
    path: str | os.PathLike,
    comm: Communicator | None,
    model: nn.Module,
    optimizer: Any = None,
    extra: Any = None,
) -> Path:
    """Collective: writes `model`'s parameters and buffers and `optimizer`'s
    state (a ZeroOptimizer, or a torch optimizer over a fully_shard or plain
    model; None: the model alone) to the checkpoint directory `path`,
    atomically (see save_pieces). Each rank writes the elements it holds,
    padding never; `extra` (JSON-able, rank 0's) comes back from load().

    Raises ValueError on every rank for bad input (optimizer state that is
    not tensors, a path that is not a checkpoint), CheckpointError on every
    surviving rank if a rank fails or dies while writing.
    """
    what = f"save(path={str(path)!r})"
    lay = collect(model, optimizer, comm, what)
    pieces, problems = [], []
    for e in lay.entries:
        if e.write and e.value.numel():
            pieces.append(Piece(e.name, e.shape, e.dtype, flat=e.flat, data=e.value))
    if lay.optimizer is not None:
        for e in lay.entries:
            try:
                state = state_of(lay.optimizer, e)
            except ValueError as err:
                problems.append(str(err))
                continue
            for k, v in state.items():
                name = f"{OPTIM}{k}/{e.name}"
                if v.dim() == 0:
                    if e.write_scalars:
                        pieces.append(Piece.whole(name, v.detach()))
                elif e.write and v.numel():
                    pieces.append(Piece(name, e.shape, v.dtype, flat=e.flat, data=v.detach()))
    _agree(comm, what, problems)  # every rank raises if any rank found a problem
    meta = {"user": extra, "layout": {"kind": lay.kind, "world_size": _world(comm)}}
    if lay.optimizer is not None:
        meta["optimizer"] = _optimizer_meta(lay)
    return save_pieces(comm, path, pieces, meta)


def _world(comm: Communicator | None) -> int:
    return 1 if comm is None else comm.world_size


def _optimizer_meta(lay: Layout) -> dict[str, Any]:
    """The optimizer's class, its groups' hyperparameters and which group each parameter is in."""
    opt = lay.optimizer
    assert opt is not None
    group = {id(p): g for g, grp in enumerate(opt.param_groups) for p in grp["params"]}
    return {
        "class": type(opt).__name__,
        "param_groups": [
            {k: v for k, v in grp.items() if k != "params" and jsonable(v)}
            for grp in opt.param_groups
        ],
        "group_of": {
            e.name: group[id(e.opt_param)]
            for e in lay.entries
            if e.opt_param is not None and id(e.opt_param) in group
        },
    }
