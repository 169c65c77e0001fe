"""What a torch call asks for beside its tensors (the reduction, the root, the
timeout, whether the caller waits at once), from every form torch's
ProcessGroup API takes: an options object (AllreduceOptions, ...), a ReduceOp,
a RedOpType, a root rank, a timedelta, or nothing."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..communicator import ReduceOp
from .args import Args

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {
    _RedOpType.SUM: ReduceOp.SUM,
    _RedOpType.AVG: ReduceOp.AVG,
    _RedOpType.PRODUCT: ReduceOp.PROD,
    _RedOpType.MIN: ReduceOp.MIN,
    _RedOpType.MAX: ReduceOp.MAX,
}


@dataclass(frozen=True)
class CallOptions:
    """One call's options, normalized."""

    async_op: bool = True  #: False: torch waits at once (a synchronous torch call)
    op: ReduceOp = ReduceOp.SUM
    factor: float | torch.Tensor | None = None  #: PREMUL_SUM's factor
    op_name: str = "SUM"  #: as torch names it, for errors
    root: int = 0
    timeout: float | None = None  #: seconds; None: the group's


def _seconds(t: Any) -> float | None:
    """A torch timeout (timedelta; negative: unset) in seconds, or None."""
    if t is None:
        return None
    s = t.total_seconds() if isinstance(t, datetime.timedelta) else float(t)
    return s if s > 0 else None


def _red_op(op: Any, args: Args, name: str) -> tuple[ReduceOp, Any, str]:
    """(pycollectives op, PREMUL_SUM factor or None, torch's name) of a
    RedOpType, a ReduceOp or None; ValueError for another op."""
    if op is None:
        return ReduceOp.SUM, None, "SUM"
    # RedOpType first: isinstance(RedOpType.SUM, dist.ReduceOp) is True too.
    kind = op if isinstance(op, _RedOpType) else getattr(op, "op", None)
    if not isinstance(kind, _RedOpType):
        raise TypeError(args.err(name, f"op={op!r} is not a torch.distributed.ReduceOp"))
    if kind == _RedOpType.PREMUL_SUM:
        return ReduceOp.SUM, op.factor, "PREMUL_SUM"
    code = _OPS.get(kind)
    if code is None:
        raise ValueError(
            args.err(
                name, f"op={kind.name} is not supported (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)"
            )
        )
    return code, None, kind.name


def call_options(
    args: Args,
    name: str,
    opts: Any = None,
    *,
    op: Any = None,
    root: Any = None,
    timeout: Any = None,
    rooted: bool = False,
) -> CallOptions:
    """Normalizes `opts` (an options object, a ReduceOp or RedOpType, a root
    rank where `rooted`, a timedelta, or None) and the keyword forms of torch's
    overloads (`op=`, `root=`, `timeout=`). Raises TypeError or ValueError,
    naming the argument, for anything else."""
    async_op = True
    if opts is None or isinstance(opts, (_RedOpType, dist.ReduceOp)):
        op = opts if op is None else op
    elif isinstance(opts, datetime.timedelta):
        timeout = opts if timeout is None else timeout
    elif isinstance(opts, int) and not isinstance(opts, bool):
        if not rooted:
            raise TypeError(args.err(name, f"an int ({opts}) is not an option of {name}"))
        root = opts if root is None else root
    elif hasattr(opts, "asyncOp") and hasattr(opts, "timeout"):  # AllreduceOptions, ...
        async_op = bool(opts.asyncOp)
        timeout = opts.timeout if timeout is None else timeout
        op = getattr(opts, "reduceOp", None) if op is None else op
        root = getattr(opts, "rootRank", None) if root is None else root
    else:
        raise TypeError(args.err(name, f"unexpected options {opts!r}"))
    code, factor, op_name = _red_op(op, args, name)
    root = args.peer(0 if root is None else root, name, "root")
    return CallOptions(async_op, code, factor, op_name, root, _seconds(timeout))


def check_complex(args: Args, name: str, o: CallOptions, tensors: list[torch.Tensor]) -> None:
    """Complex tensors reduce as their real view: only sums and averages."""
    if o.op not in (ReduceOp.SUM, ReduceOp.AVG) and any(t.is_complex() for t in tensors):
        raise ValueError(args.err(name, f"op={o.op_name} is not defined for complex tensors"))
