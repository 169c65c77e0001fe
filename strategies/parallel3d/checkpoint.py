"""Checkpoints of a Trainer3D: saved in one dp x tp x pp layout (all-reduce
or ZeRO-1/2/3 on dp), resumed in any other, through strategies.checkpoint's
layout-free `save_pieces` / `load_pieces`.

Tensors, under global names and shapes (as strategies.checkpoint.save names
them, so `python -m pycollectives.strategies.checkpoint consolidate` reads them too):

    <parameter name>                       the GPT's names (the tied weight once,
                                           as embed.tok.weight)
    optim/exp_avg/<name>, optim/exp_avg_sq/<name>   AdamW's moments, shaped as the parameter
    optim/step/<name>                      AdamW's step count, a scalar

extra: {"step": the next step, "config": repr(GPTConfig)}.

A rank's part of a tensor is a Piece: the tensor-parallel box of its shard
(the whole tensor where tp does not split it), narrowed under ZeRO to the
flat range its dp shard covers. Replicated copies are written once: by dp
rank 0 (under ZeRO each dp rank writes its shard), tp rank 0 for what tp does
not split, the first stage for the tied weight. Every holder reads.
FSDP's optimizer state is per parameter piece: --fsdp is refused here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, Piece, load_pieces, read_index, save_pieces
from ..pipeline.communications import agree
from ..pipeline.gpt_stage import TIED
from .trainer import Trainer3D, full_shapes

__all__ = ["load_trainer", "save_trainer"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Held:
    """What this rank holds of one parameter: where, its values, its AdamW state."""

    name: str
    shape: tuple[int, ...]  # global
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int] | None
    value: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    write: bool = False  # this rank writes the piece
    write_step: bool = False  # ... and the step scalar

    def pieces(self) -> list[Piece]:
        """The parameter's and its moments' pieces, their data this rank's views."""
        out = []
        for key, t in [("", self.value)] + [(k, self.state[k]) for k in MOMENTS]:
            name = f"optim/{key}/{self.name}" if key else self.name
            out.append(Piece(name, self.shape, t.dtype, self.offsets, self.sizes, self.flat, t))
        return out


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """optimizer.state[p], created as AdamW creates it when missing (a run that has not stepped)."""
    st = optimizer.state[p]
    if not st:
        st["step"] = torch.tensor(0.0)
        for k in MOMENTS:
            st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _holdings(trainer: Trainer3D) -> list[_Held]:
    """This rank's parts of every parameter (see the module docstring)."""
    dims, shapes = trainer.dims, full_shapes(trainer.config)
    first = any(st.is_first for st in trainer.stages)

    def box(name: str, local: tuple[int, ...]) -> tuple[tuple, tuple, bool]:
        full = shapes[name]
        split = [d for d in range(len(full)) if full[d] != local[d]]
        offsets = tuple(dims.tp_rank * local[d] if d in split else 0 for d in range(len(full)))
        owner = bool(split) or dims.tp_rank == 0
        return offsets, local, owner and (name != TIED or first)

    out, t0 = [], dims.tp_rank == 0  # the step scalar: one writer, whatever tp splits
    if trainer.zero is None:
        for name, p in trainer.named_params:
            offsets, sizes, owner = box(name, tuple(p.shape))
            st = _adam_state(trainer.optimizer, p)
            w = owner and dims.dp_rank == 0
            out.append(_Held(name, shapes[name], offsets, sizes, None, p.data, st, w, w and t0))
        return out
    engine, r = trainer.zero.engine, dims.dp_rank
    for u in engine.units:
        prefix = "" if u is engine.root else u.name + "."
        for f in u.trainable:
            c = f.layout.shard_numel
            lo, hi = r * c, (r + 1) * c
            st = _adam_state(trainer.optimizer, f.opt_param)
            for s in f.layout.slots:
                a, b = max(lo, s.offset), min(hi, s.end)
                if a >= b:
                    continue
                name = prefix + s.name
                if not trainer.sharded:  # ZeRO-1 over nn.ModuleList(stages): "0.blocks.1..."
                    name = re.sub(r"^\d+\.", "", name)
                name = TIED if name == "head.weight" else name
                offsets, sizes, owner = box(name, s.shape)
                views = {k: st[k][a - lo : b - lo] for k in MOMENTS}
                views["step"] = st["step"]
                flat = (a - s.offset, b - s.offset)
                value = f.shard[a - lo : b - lo]
                step_writer = owner and t0 and a == s.offset
                held = _Held(name, shapes[name], offsets, sizes, flat, value, views, owner)
                held.write_step = step_writer
                out.append(held)
    return out


def _check(trainer: Trainer3D, what: str) -> None:
    """ValueError on every rank for a layout this module cannot save (FSDP)."""
    error = None
    if trainer.opts.fsdp:
        error = ValueError("--fsdp: not supported (optimizer state per parameter piece)")
    agree(trainer.dims.world, what, error, 0, "", trainer.opts.timeout)


def save_trainer(trainer: Trainer3D, directory: str | os.PathLike) -> Path:
    """Collective over trainer.dims.world: writes the parameters, AdamW's
    state and the next step into the checkpoint directory (atomically,
    replacing an older checkpoint there). Raises ValueError on every rank
    for --fsdp or a bad directory, CheckpointError if writing fails."""
    _check(trainer, f"save_trainer({str(directory)!r})")
    pieces = []
    for h in _holdings(trainer):
        if h.write:
            pieces += h.pieces()
        if h.write_step:
            step = h.state["step"].detach().reshape(())
            pieces.append(Piece(f"optim/step/{h.name}", (), step.dtype, data=step))
    extra = {"step": trainer.step_index, "config": repr(trainer.config)}
    return save_pieces(trainer.dims.world, directory, pieces, extra)


@torch.no_grad()
def load_trainer(trainer: Trainer3D, directory: str | os.PathLike) -> int:
    """Collective over trainer.dims.world: loads a checkpoint saved by
    save_trainer in any layout into `trainer` (parameters, AdamW's state,
    the next step); returns that step. Raises ValueError on every rank for
    --fsdp, a missing checkpoint or tensor, or one saved for another GPT."""
    what = f"load_trainer({str(directory)!r})"
    _check(trainer, what)
    held = _holdings(trainer)
    pieces, steps = [], []
    for h in held:
        pieces += h.pieces()
        step = torch.zeros((), dtype=h.state["step"].dtype)
        steps.append(step)
        pieces.append(Piece(f"optim/step/{h.name}", (), step.dtype, data=step))
    problems = []
    try:
        saved = read_index(directory).get("extra")
        if not isinstance(saved, dict) or saved.get("config") != repr(trainer.config):
            was = saved.get("config") if isinstance(saved, dict) else saved
            problems.append(f"the checkpoint is of {was}, this run trains {trainer.config}")
    except (OSError, ValueError, CheckpointError):
        pass  # load_pieces says what is wrong
    extra = load_pieces(trainer.dims.world, directory, pieces, problems, what=what)
    for h, step in zip(held, steps, strict=True):
        h.state["step"].copy_(step)
    if trainer.zero is not None:
        trainer.zero.engine.shards_written()  # the new shards into the full parameters
    trainer.step_index = int(extra["step"])
    return trainer.step_index
