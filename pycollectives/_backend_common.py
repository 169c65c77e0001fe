"""Shared helpers of the "pycoll" backend (pycollectives.backend): the table of
torch reduce ops, the registry of the live groups (closed at exit), and the
argument helpers (_ArgsMixin) that every operation of ProcessGroupPycoll uses.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .communicator import ReduceOp

if TYPE_CHECKING:
    from .backend import ProcessGroupPycoll

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {
    _RedOpType.SUM: ReduceOp.SUM,
    _RedOpType.AVG: ReduceOp.AVG,
    _RedOpType.PRODUCT: ReduceOp.PROD,
    _RedOpType.MIN: ReduceOp.MIN,
    _RedOpType.MAX: ReduceOp.MAX,
}


_groups_lock = threading.Lock()
_live_groups: list[ProcessGroupPycoll] = []


@atexit.register
def _close_all_at_exit() -> None:
    """Closes the Communicators of the groups the program did not destroy, before
    the interpreter tears down (their C++ threads must not outlive it)."""
    for g in list(_live_groups):
        with contextlib.suppress(Exception):  # nothing to report to at exit
            g.abort()


class _ArgsMixin:
    """Argument checks and core buffers, mixed into ProcessGroupPycoll (uses its
    _rank and _size)."""

    # -- argument helpers ------------------------------------------------------
    def _err(self, name: str, msg: str) -> str:
        return f"pycollectives: rank {self._rank}: {name}: {msg}"

    def _tensor(self, t: Any, name: str, arg: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                self._err(name, f"{arg} must be a torch.Tensor, not {type(t).__name__}")
            )
        return t

    def _same_length(self, name: str, a: Any, b: Any, what: str) -> None:
        """Raises ValueError naming `what` ("outputs and inputs") if a and b differ in length."""
        if len(a) != len(b):
            raise ValueError(self._err(name, f"{what} differ in length"))

    def _one(self, tensors: Any, name: str, arg: str = "tensors") -> torch.Tensor:
        if isinstance(tensors, torch.Tensor):
            return self._tensor(tensors, name, arg)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(self._err(name, f"{arg} must hold exactly one tensor, got {n}"))
        return self._tensor(tensors[0], name, arg)

    def _buf(self, t: torch.Tensor, copies: list | None) -> torch.Tensor:
        """A contiguous real view of `t` for the core; where `t` is not
        contiguous a copy, copied back into `t` afterwards if `copies` is a list."""
        buf = t
        if not buf.is_contiguous():
            buf = buf.contiguous()
            if copies is not None:
                copies.append((t, buf))
        if buf.is_complex():
            buf = torch.view_as_real(buf)
        return buf

    def _peer(self, peer: Any, name: str, arg: str) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self._size:
            raise ValueError(self._err(name, f"{arg}={peer!r} is out of range [0, {self._size})"))
        return peer

    def _op(self, opts: Any, name: str, tensors: Sequence[torch.Tensor]) -> tuple[ReduceOp, Any]:
        """(pycollectives op, PREMUL_SUM factor or None) of torch options."""
        rop = getattr(opts, "reduceOp", opts)
        if rop is None:
            rop = dist.ReduceOp.SUM
        kind = rop.op if isinstance(rop, dist.ReduceOp) else rop
        factor = None
        if kind == _RedOpType.PREMUL_SUM:
            factor, code = rop.factor, ReduceOp.SUM
        else:
            code = _OPS.get(kind)
            if code is None:
                raise ValueError(
                    self._err(
                        name,
                        f"op={kind} is not supported (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)",
                    )
                )
        if code not in (ReduceOp.SUM, ReduceOp.AVG) and any(t.is_complex() for t in tensors):
            raise ValueError(self._err(name, f"op={kind} is not defined for complex tensors"))
        return code, factor
