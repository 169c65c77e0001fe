"""A torch call planned for the core: what to issue and how to complete it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..communicator import Communicator


@dataclass
class Launch:
    """One torch call: `issue(comm, async_op)` issues its core operations and
    returns their Works (none when synchronous); once they completed, the
    `copies` ((destination, source) tensors) are made and the call's Future
    completes with `value`; `keep` holds the buffers alive until then. A
    receive from any source names its sender through `source()`."""

    name: str
    issue: Callable[[Communicator, bool], list]
    value: Any
    copies: Sequence = ()
    keep: Any = None
    source: Callable[[], int] | None = None
