"""3D parallelism: data x tensor x pipeline parallel training of the GPT on
one ParallelDims (trainer.py), and its checkpoints, resumable in any other
layout (checkpoint.py), and its recovery when a rank dies: a replacement
process takes the lost place (replacement.py, docs/recovery.md). See
docs/parallel3d.md."""

from .checkpoint import load_trainer, save_trainer
from .replacement import ElasticTrainer3D, ReplacementFailed
from .trainer import SCHEDULES, StepStats, Trainer3D, TrainOptions, full_shapes, problems

__all__ = [
    "ElasticTrainer3D",
    "ReplacementFailed",
    "SCHEDULES",
    "StepStats",
    "TrainOptions",
    "Trainer3D",
    "full_shapes",
    "load_trainer",
    "problems",
    "save_trainer",
]
