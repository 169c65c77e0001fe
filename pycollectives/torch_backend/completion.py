"""The completion thread of a "pycoll" group: it waits for the core operations
in issue order and completes the torch Futures behind the returned Works
(DDP's `get_future().then(...)` hooks run there), or fails them with the
operation's error."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .planned_call import outside_autograd


class Completer:
    """One thread, started by the first submit. `wake_every()` says how long
    the thread may sleep with nothing submitted (None: until the next submit),
    and `on_idle()` runs when that time passed (the group's deferred sends and
    receives are issued there)."""

    def __init__(
        self, name: str, wake_every: Callable[[], float | None], on_idle: Callable[[], None]
    ) -> None:
        self._name = name
        self._wake_every = wake_every
        self._on_idle = on_idle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(
        self, works: list, futs: list, values: list, copies: Sequence = (), keep: Any = None
    ) -> None:
        """Completes futs[i] with values[i] once every core Work in `works` is
        done and the `copies` ((destination, source) tensors) are made; `keep`
        holds buffers alive until then. Empty lists just wake the thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((works, futs, values, copies, keep))

    def close(self) -> None:
        """Completes what was submitted, then stops the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        q = self._queue
        while True:
            try:
                item = q.get(timeout=self._wake_every())
            except queue.Empty:
                self._on_idle()
                continue
            if item is None:
                return
            works, futs, values, copies, _keep = item
            try:
                for w in works:
                    w._work.wait(-1.0)  # the core's own timeout bounds this
                if copies:
                    with outside_autograd():
                        for dst, src in copies:
                            dst.copy_(src)
            except BaseException as e:  # noqa: BLE001 - handed to the Futures
                for f in futs:
                    f.set_exception(e)
                del item, works, futs, values, copies, _keep, e
                continue
            for f, v in zip(futs, values, strict=True):
                f.set_result(v)
            del item, works, futs, values, copies, _keep  # free the buffers now
