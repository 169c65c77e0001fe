"""Sharded checkpoints that load into another layout (ZeRO-1/2/3, FSDP,
tensor parallel, one process), on pycollectives.

    format.py       the on-disk format: one safetensors file per rank + index.json (why: there)
    pieces.py       Piece: a box of a global tensor, optionally narrowed to a flat range
    sharded.py      save_pieces / load_pieces: the low-level, layout-free entry points
"""

from .format import read_index, read_stats
from .pieces import Piece
from .sharded import CheckpointError, load_pieces, save_pieces

__all__ = [
    "CheckpointError",
    "Piece",
    "load_pieces",
    "read_index",
    "read_stats",
    "save_pieces",
]
