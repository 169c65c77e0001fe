"""The torch.distributed backend "pycoll"; it lives in pycollectives.torch_backend,
this name is kept for code that imports ProcessGroupPycoll from here."""

from .communicator import ReduceOp
from .torch_backend.process_group import BACKEND_NAME, ProcessGroupPycoll

__all__ = ["BACKEND_NAME", "ProcessGroupPycoll", "ReduceOp"]
