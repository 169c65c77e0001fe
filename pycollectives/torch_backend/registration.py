"""Registers the torch.distributed backend "pycoll" (on `import pycollectives`)."""

from __future__ import annotations

from typing import Any


def register() -> bool:
    """Registers "pycoll" with torch.distributed.Backend (idempotent).

    Returns False, without raising, where torch or torch.distributed is not
    available (NumPy-only use), True otherwise.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    from .process_group import BACKEND_NAME

    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return True
    dist.Backend.register_backend(
        BACKEND_NAME, _create_process_group, extended_api=True, devices=["cpu", "cuda"]
    )
    return True


def _create_process_group(dist_opts: Any, backend_opts: Any = None) -> Any:
    """The creator torch calls (extended API): one Communicator per group."""
    from .process_group import ProcessGroupPycoll

    return ProcessGroupPycoll(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        group_name=dist_opts.group_id,
    )
