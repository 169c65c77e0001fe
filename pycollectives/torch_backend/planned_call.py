"""A torch call planned for the core (`Launch`): what to issue and how to complete it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..communicator import Communicator


def outside_autograd() -> torch.inference_mode:
    """The context of every write of the backend into the caller's tensors
    (copies back from contiguous buffers, PREMUL_SUM's scaling, local blocks):
    outside autograd, as c10d's collectives write, so that a Parameter or a
    view of one takes them (its version counter still moves), and allowed on
    inference tensors on any thread (the completion thread is not in the
    caller's inference mode, which is per thread)."""
    return torch.inference_mode()


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

    def start(self, comm: Communicator, lock: Any, completer: Any, async_op: bool) -> Any:
        """Issues the core operations on `comm` under the group's issue `lock`
        and returns the torch Future of the call.

        Where torch waits at once (async_op False: the synchronous
        torch.distributed calls), the operations run synchronously (the
        core's fast path on this thread, no hand-off to the progress and
        completion threads) and the Future is complete. Otherwise they are
        asynchronous and the group's `completer` (completion.Completer)
        completes the Future."""
        fut = torch.futures.Future()
        if not async_op:
            with lock:
                self.issue(comm, False)
            if self.copies:
                with outside_autograd():
                    for dst, src in self.copies:
                        dst.copy_(src)
            fut.set_result(self.value)
            return fut
        with lock:
            works = self.issue(comm, True)
        if not works and not self.copies:
            fut.set_result(self.value)
        else:
            completer.submit(works, [fut], [self.value], self.copies, self.keep)
        return fut
