"""Parallelism strategies built on pycollectives' collectives (never on torch.distributed's)."""
