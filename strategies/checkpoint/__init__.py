"""Sharded checkpoints that load into another layout (ZeRO-1/2/3, FSDP,
tensor parallel, one process), on pycollectives.

    save("ckpt/step-100", comm, model, optimizer, extra={"step": 100})
    extra = load("ckpt/step-100", comm, model, optimizer)     # any other layout
    python -m pycollectives.strategies.checkpoint consolidate ckpt/step-100 model.safetensors

    format.py       the on-disk format: one safetensors file per rank + index.json (why: there)
    pieces.py       Piece: a box of a global tensor, optionally narrowed to a flat range
    piece_files.py  save_pieces / load_pieces: the low-level, layout-free entry points
    state.py        a model and optimizer (ZeRO, FSDP, plain) as named entries on this rank
    saving.py       save(): a model and optimizer in any layout -> pieces
    loading.py      load(): pieces -> a model and optimizer in any layout
    validate.py     every check on a checkpoint's files before a byte of data is read
    consolidation.py  one safetensors file from a checkpoint, streaming, tensor by tensor
    __main__.py     python -m pycollectives.strategies.checkpoint consolidate DIR OUT
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .consolidation import consolidate
    from .format import read_index, read_stats
    from .loading import load
    from .piece_files import load_pieces, save_pieces
    from .pieces import Piece
    from .saving import save
    from .validate import CheckpointError

# Imported on first use (PEP 562): `python -m pycollectives.strategies.checkpoint consolidate`
# loads consolidation.py and format.py alone, not the save and load machinery.
_WHERE = {
    "CheckpointError": "validate",
    "Piece": "pieces",
    "consolidate": "consolidation",
    "load": "loading",
    "load_pieces": "piece_files",
    "read_index": "format",
    "read_stats": "format",
    "save": "saving",
    "save_pieces": "piece_files",
}
__all__ = [
    "CheckpointError",
    "Piece",
    "consolidate",
    "load",
    "load_pieces",
    "read_index",
    "read_stats",
    "save",
    "save_pieces",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(
            f"module 'pycollectives.strategies.checkpoint' has no attribute {name!r}"
        )
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
