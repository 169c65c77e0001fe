"""Argument checks of the "pycoll" backend: every error names the rank, the
operation and the argument, and the core gets contiguous real buffers."""

from __future__ import annotations

from typing import Any

import torch


class Args:
    """Checks the arguments of one group's calls (rank `rank` of `size`)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def err(self, name: str, msg: str) -> str:
        """The text of an error of operation `name` on this rank."""
        return f"pycollectives: rank {self.rank}: {name}: {msg}"

    def tensor(self, t: Any, name: str, arg: str) -> torch.Tensor:
        """`t` if it is a dense torch.Tensor; raises TypeError otherwise, and
        ValueError for another layout (sparse, mkldnn) naming it."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(self.err(name, f"{arg} must be a torch.Tensor, not {type(t).__name__}"))
        if t.layout != torch.strided:
            raise ValueError(
                self.err(name, f"{arg} has layout {t.layout}; pycoll takes dense (strided) tensors")
            )
        return t

    def tensors(self, ts: Any, name: str, arg: str) -> list[torch.Tensor]:
        """A tensor or a list of them, checked as a list."""
        if isinstance(ts, torch.Tensor):
            ts = [ts]
        if not isinstance(ts, (list, tuple)):
            raise TypeError(self.err(name, f"{arg} must be a list of tensors"))
        return [self.tensor(t, name, arg) for t in ts]

    def one(self, tensors: Any, name: str, arg: str = "tensors") -> torch.Tensor:
        """The single tensor of `tensors` (a tensor or a list of one)."""
        if isinstance(tensors, torch.Tensor):
            return self.tensor(tensors, name, arg)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(self.err(name, f"{arg} must hold exactly one tensor, got {n}"))
        return self.tensor(tensors[0], name, arg)

    def same_length(self, name: str, a: Any, b: Any, what: str) -> None:
        """Raises ValueError naming `what` ("outputs and inputs") if a and b differ in length."""
        if len(a) != len(b):
            raise ValueError(self.err(name, f"{what} differ in length ({len(a)} and {len(b)})"))

    def peer(self, peer: Any, name: str, arg: str) -> int:
        """`peer` if it is a rank of the group; ValueError otherwise."""
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise ValueError(self.err(name, f"{arg}={peer!r} is out of range [0, {self.size})"))
        return peer

    @staticmethod
    def buf(t: torch.Tensor, copies: list | None) -> torch.Tensor:
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
