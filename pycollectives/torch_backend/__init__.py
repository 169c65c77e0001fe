"""The torch.distributed backend "pycoll": a ProcessGroup whose collectives run
on a pycollectives Communicator (docs/backend.md).

    import pycollectives  # registers "pycoll"
    torch.distributed.init_process_group("pycoll")  # or "cpu:pycoll,cuda:pycoll"

Modules, each importing only those listed after it (and registration's BACKEND_NAME):

- registration: the name "pycoll" and its registration with torch.distributed
  (torch optional; without torch imported, once torch is; it imports
  process_group only when torch creates a group);
- process_group: ProcessGroupPycoll, torch's call forms, issue and lifetime;
- monitored_barrier: gloo's debugging barrier, on this backend;
- p2p: deferred sends and receives, issued as batches;
- completion: the thread that completes the Works in issue order;
- collectives, p2p_collectives, sparse: what each call runs on the core (a Launch);
- launch: a planned call; options: torch's options, ops and timeouts; args:
  argument checks; work: the Work returned to torch; groups: the live groups.
"""

from __future__ import annotations

from typing import Any

from .registration import BACKEND_NAME, register, register_when_torch_is_imported

__all__ = ["BACKEND_NAME", "ProcessGroupPycoll", "register", "register_when_torch_is_imported"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the ProcessGroup imports torch.distributed.
    if name == "ProcessGroupPycoll":
        from . import process_group

        return process_group.ProcessGroupPycoll
    raise AttributeError(name)
