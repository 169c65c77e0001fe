"""pycollectives: collective communication for distributed deep learning.

import pycollectives as pc
comm = pc.init()            # under torchrun
comm.all_reduce(tensor)     # in place, SUM
"""

# First: a clone that was never built (`pip install .` put the build in
# site-packages) loads that build's modules, or says in one line what to do.
from . import _source_tree  # noqa: F401, I001
from . import _C
from .communicator import Communicator, ReduceOp, Work
from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommunicatorAborted,
    PeerFailure,
    PyCollectivesError,
)
from .rendezvous import init

__version__ = "0.1.0"

# The torch.distributed backend "pycoll" (pycollectives/torch_backend/, docs/backend.md).
from .torch_backend import register as _register_torch_backend  # noqa: E402

_register_torch_backend()


def simd_level() -> str:
    """Which CPU reduction kernels are in use: "avx512", "avx2" or "generic"."""
    return _C.simd_level()


__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorAborted",
    "PeerFailure",
    "PyCollectivesError",
    "ReduceOp",
    "Work",
    "init",
    "simd_level",
]
