"""pycollectives: collective communication for distributed deep learning.

import pycollectives as pc
comm = pc.init()            # under torchrun
comm.all_reduce(tensor)     # in place, SUM

`import pycollectives` loads the compiled extension but not torch: the names
that need torch (Communicator, init, ...) are imported on first use (PEP 562),
and the torch.distributed backend "pycoll" is registered now if torch is
imported, else as soon as it is (docs/backend.md).
"""

from typing import TYPE_CHECKING, Any  # noqa: I001

# First: a clone that was never built (`pip install .` put the build in
# site-packages) loads that build's modules, or says in one line what to do.
from . import _source_tree  # noqa: F401
from . import _C
from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommunicatorAborted,
    CommunicatorRevoked,
    GrowRefused,
    PeerFailure,
    PyCollectivesError,
)
from .torch_backend.registration import register_when_torch_is_imported

if TYPE_CHECKING:
    from .communicator import Communicator, ReduceOp, Work
    from .rendezvous import init
    from .rendezvous.grow import join

__version__ = "0.1.0"

# The torch.distributed backend "pycoll" (pycollectives/torch_backend/, docs/backend.md).
register_when_torch_is_imported()

# Public names whose modules import torch (pycollectives._buffers): name -> module.
_LAZY = {
    "Communicator": "communicator",
    "ReduceOp": "communicator",
    "Work": "communicator",
    "init": "rendezvous",
    "join": "rendezvous.grow",
}


def __getattr__(name: str) -> Any:
    """Imports the module of a public name that needs torch on its first use; a submodule's
    name (`pycollectives.communicator`, which the package imported itself before) imports it."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def simd_level() -> str:
    """Which CPU reduction kernels are in use: "avx512", "avx2" or "generic"."""
    return _C.simd_level()


__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorAborted",
    "CommunicatorRevoked",
    "GrowRefused",
    "PeerFailure",
    "PyCollectivesError",
    "ReduceOp",
    "Work",
    "init",
    "join",
    "simd_level",
]
