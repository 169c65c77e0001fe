"""Registers the torch.distributed backend "pycoll" (on `import pycollectives`).

`import pycollectives` does not import torch (a command such as
`pycollectives-bench --help` answers in a fraction of a second): where torch is
not imported yet, :func:`register_when_torch_is_imported` registers the backend
as soon as it is, whichever module imports it first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

BACKEND_NAME = "pycoll"


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
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return True
    dist.Backend.register_backend(
        BACKEND_NAME, _create_process_group, extended_api=True, devices=["cpu", "cuda"]
    )
    return True


def register_when_torch_is_imported() -> None:
    """Registers "pycoll" now if torch is imported, else right after torch's
    own import finishes (a one-shot finder on sys.meta_path), so that
    `import pycollectives` followed by `import torch.distributed` and
    `init_process_group("pycoll")` works in either order without
    `import pycollectives` loading torch."""
    if "torch" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds torch with the other finders and runs :func:`register` after
    torch's module has been executed (the post-import hook of wrapt and
    OpenTelemetry, for one module). It leaves sys.meta_path once torch is
    imported; a mere `importlib.util.find_spec("torch")` (how transformers
    and others ask whether torch is installed) does not use it up."""

    def __init__(self) -> None:
        self._finding = False  # our own find_spec below asks the other finders

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfter(spec.loader, self)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    """Executes a module with its own loader, then registers the backend."""

    def __init__(self, loader: Any, finder: _AfterTorchImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader, as if this one had never been there.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        try:
            register()
        except Exception as e:  # never break the import of torch itself
            warnings.warn(
                f"pycollectives: registering the torch.distributed backend {BACKEND_NAME!r} "
                f"failed: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )


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
