"""The calls of the "pycoll" backend built on point to point: all-to-all with
split sizes or of lists, gather and scatter, each issued as one batch of
sends and receives (Communicator.batch_p2p), and the receive from any source.
Each function checks its arguments and returns the call's Launch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..communicator import Communicator
from .args import Args
from .options import CallOptions
from .planned_call import Launch, outside_autograd


def batch(c: Communicator, ops: list, async_op: bool, timeout: float | None = None) -> list:
    """Issues sends and receives that progress together (in any order on either
    side, however many, without deadlock); returns their Works."""
    return [c.batch_p2p(ops, async_op=async_op, timeout=timeout)] if ops else []


def _rows(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`buf` (the core's view of `t`) as a 2-D tensor of t's dim-0 rows."""
    rows = t.shape[0] if t.dim() else 1
    return buf.reshape(rows, buf.numel() // rows if rows else 0)


def _splits(a: Args, splits: list, t: torch.Tensor, arg: str, name: str) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % a.size:
            raise ValueError(
                a.err(name, f"{arg} is empty but dim 0 ({rows}) is not divisible by {a.size}")
            )
        return [rows // a.size] * a.size
    splits = [int(s) for s in splits]
    if len(splits) != a.size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            a.err(
                name,
                f"{arg}={splits} must be {a.size} non-negative sizes summing to dim 0 ({rows})",
            )
        )
    return splits


def _exchange(
    a: Args,
    name: str,
    ins: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    differ: str,
    o: CallOptions,
) -> tuple[Callable[[Communicator, bool], list], list]:
    """(issue function, point-to-point ops) of an all-to-all of blocks: ins[p]
    goes to rank p's outs[this rank]. This rank's own block is copied locally
    when issued (ValueError with `differ` if its two sizes differ); the others
    go as one batch, each rank sending to r+k and receiving from r-k."""
    n, me = a.size, a.rank
    ops = []
    for k in range(1, n):
        dst, src = (me + k) % n, (me - k) % n
        ops.append(("send", ins[dst], dst))
        ops.append(("recv", outs[src], src))

    def issue(c: Communicator, async_op: bool) -> list:
        if ins[me].numel() != outs[me].numel():
            raise ValueError(a.err(name, differ))
        with outside_autograd():
            outs[me].copy_(ins[me])
        return batch(c, ops, async_op, o.timeout)

    return issue, ops


def all_to_all_single(
    a: Args,
    output: Any,
    input: Any,  # noqa: A002 - torch's name
    output_split_sizes: list,
    input_split_sizes: list,
    o: CallOptions,
) -> Launch:
    """All-to-all of one tensor, even (no splits: the core's all-to-all) or
    with split sizes along dim 0 (one batch)."""
    name = "all_to_all_single"
    out = a.tensor(output, name, "output")
    inp = a.tensor(input, name, "input")
    if out.dtype != inp.dtype:
        raise ValueError(a.err(name, f"output dtype {out.dtype} differs from input {inp.dtype}"))
    copies: list = []
    ob = a.buf(out, copies)
    ib = a.buf(inp, None)
    if not output_split_sizes and not input_split_sizes:

        def issue(c: Communicator, async_op: bool) -> list:
            return [c.all_to_all(ob, ib, async_op=async_op, timeout=o.timeout)]

        return Launch(name, issue, [output], copies, (ob, ib))
    in_rows = _splits(a, input_split_sizes, inp, "input_split_sizes", name)
    out_rows = _splits(a, output_split_sizes, out, "output_split_sizes", name)
    me = a.rank
    issue, ops = _exchange(
        a,
        name,
        torch.split(_rows(ib, inp), in_rows),
        torch.split(_rows(ob, out), out_rows),
        f"input_split_sizes[{me}] and output_split_sizes[{me}] differ",
        o,
    )
    return Launch(name, issue, [output], copies, (ob, ib, ops))


def alltoall(a: Args, output_tensors: list, input_tensors: list, o: CallOptions) -> Launch:
    """All-to-all of lists: input_tensors[j] goes to rank j's output_tensors[rank]."""
    name = "alltoall"
    n, me = a.size, a.rank
    if len(output_tensors) != n or len(input_tensors) != n:
        raise ValueError(a.err(name, f"output and input lists must hold {n} tensors each"))
    outs = [a.tensor(t, name, "output_tensors") for t in output_tensors]
    ins = [a.tensor(t, name, "input_tensors") for t in input_tensors]
    copies: list = []
    obs = [a.buf(t, copies) for t in outs]
    ibs = [a.buf(t, None) for t in ins]
    issue, _ = _exchange(
        a, name, ibs, obs, f"output_tensors[{me}] and input_tensors[{me}] differ in size", o
    )
    return Launch(name, issue, output_tensors, copies, (obs, ibs))


def rooted(
    a: Args, name: str, output_tensors: Any, input_tensors: Any, o: CallOptions, to_root: bool
) -> Launch:
    """Gather (to_root: output_tensors[0][r] on the root gets rank r's input)
    or scatter (rank r's output gets input_tensors[0][r] of the root) as one
    batch of sends and receives: the root exchanges with every other rank;
    its own block is a local copy."""
    root = o.root
    # The root's side is a list of world_size tensors, the others' one tensor.
    many, many_arg = (
        (output_tensors, "output_tensors") if to_root else (input_tensors, "input_tensors")
    )
    one_list, one_arg = (
        (input_tensors, "input_tensors") if to_root else (output_tensors, "output_tensors")
    )
    copies: list = []
    one = a.buf(a.one(one_list, name, one_arg), None if to_root else copies)
    local = None
    if a.rank == root:
        blocks = many[0] if len(many) == 1 else None
        if blocks is None or len(blocks) != a.size:
            raise ValueError(
                a.err(name, f"on the root, {many_arg} must be [list of {a.size} tensors]")
            )
        bufs = [a.buf(a.tensor(t, name, many_arg), copies if to_root else None) for t in blocks]
        kind = "recv" if to_root else "send"
        ops = [(kind, bufs[r], r) for r in range(a.size) if r != root]
        local = (bufs[root], one) if to_root else (one, bufs[root])  # (destination, source)
    else:
        if many and any(len(x) for x in many):
            raise ValueError(a.err(name, f"{many_arg} must be empty on non-root ranks"))
        ops = [("send" if to_root else "recv", one, root)]

    def issue(c: Communicator, async_op: bool) -> list:
        if local is not None:
            if local[0].numel() != local[1].numel():
                raise ValueError(a.err(name, "output and input tensors differ in size"))
            with outside_autograd():
                local[0].copy_(local[1])
        return batch(c, ops, async_op, o.timeout)

    return Launch(name, issue, output_tensors, copies, (one, ops))


def recv_any(a: Args, tensors: Any) -> Launch:
    """A receive from any source into the single tensor of `tensors`; the
    Launch's source() names the sender once it completed."""
    name = "recv"
    t = a.one(tensors, name)
    if a.size < 2:
        raise ValueError(a.err(name, "no other rank to receive from"))
    copies: list = []
    buf = a.buf(t, copies)
    core: list = []

    def issue(c: Communicator, async_op: bool) -> list:
        core.append(c.recv(buf, None, async_op=True))
        return core

    return Launch(name, issue, list(tensors), copies, buf, source=lambda: core[0].source)
