"""The calls of the "pycoll" backend that run as core collectives: all-reduce,
broadcast, the all-gathers, the reduce-scatters, reduce and barrier. Each
function checks its arguments and returns the call's Launch."""

from __future__ import annotations

from typing import Any

import torch

from ..communicator import Communicator
from .args import Args
from .options import CallOptions, check_complex
from .planned_call import Launch, outside_autograd


def _scale(ts: list[torch.Tensor], factor: Any) -> None:
    """PREMUL_SUM's scaling of the caller's tensors, in place."""
    with outside_autograd():
        for t in ts:
            t.mul_(factor)


def allreduce(a: Args, ts: list[torch.Tensor], o: CallOptions, value: Any) -> Launch:
    """All-reduce of each tensor in place (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)."""
    check_complex(a, "allreduce", o, ts)
    if o.factor is not None:  # PREMUL_SUM: scale, then sum (in place, as NCCL)
        _scale(ts, o.factor)
    copies: list = []
    bufs = [a.buf(t, copies) for t in ts]

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.all_reduce(b, o.op, async_op=async_op, timeout=o.timeout) for b in bufs]

    return Launch("allreduce", issue, value, copies, bufs)


def allreduce_coalesced(a: Args, ts: list[torch.Tensor], o: CallOptions) -> Launch:
    """All-reduce of several tensors as one call: one flat buffer per dtype."""
    check_complex(a, "allreduce_coalesced", o, ts)
    if o.factor is not None:
        _scale(ts, o.factor)
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in ts:
        groups.setdefault(t.dtype, []).append(t)
    flats, copies = [], []
    for same in groups.values():
        if len(same) == 1:
            flats.append(a.buf(same[0], copies))
            continue
        flat = torch.cat([t.reshape(-1) for t in same])
        flats.append(a.buf(flat, None))
        off = 0
        for t in same:
            copies.append((t, flat[off : off + t.numel()].view(t.shape)))
            off += t.numel()

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.all_reduce(f, o.op, async_op=async_op, timeout=o.timeout) for f in flats]

    return Launch("allreduce_coalesced", issue, list(ts), copies, flats)


def broadcast(a: Args, t: torch.Tensor, o: CallOptions) -> Launch:
    """Broadcast of rank o.root's tensor, in place."""
    copies: list = []
    buf = a.buf(t, copies)

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.broadcast(buf, o.root, async_op=async_op, timeout=o.timeout)]

    return Launch("broadcast", issue, [t], copies, buf)


def gather_list(
    a: Args, name: str, outs: Any, inp: torch.Tensor, arg: str
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Checks one all-gather of `inp` into `outs`, a list of world_size tensors
    like it; returns the core's input and flat output buffers and the copies
    from the flat output into `outs`."""
    if not isinstance(outs, (list, tuple)) or len(outs) != a.size:
        raise ValueError(a.err(name, f"{arg} must be lists of {a.size} tensors"))
    for o in outs:
        a.tensor(o, name, arg)
        if o.numel() != inp.numel() or o.dtype != inp.dtype:
            raise ValueError(
                a.err(
                    name,
                    f"output tensor of {o.numel()} {o.dtype} elements does not match the "
                    f"input ({inp.numel()} {inp.dtype})",
                )
            )
    src = inp.contiguous()
    flat = torch.empty((a.size, *src.shape), dtype=src.dtype, device=src.device)
    copies = [(o, flat[r].view_as(o)) for r, o in enumerate(outs)]
    return a.buf(src, None), a.buf(flat, None), copies


def allgather(a: Args, outs: list, inp: torch.Tensor, o: CallOptions, value: Any) -> Launch:
    """All-gather of `inp` into the list `outs` (outs[r]: rank r's)."""
    src, flat, copies = gather_list(a, "allgather", outs, inp, "output_tensors")

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.all_gather(flat, src, async_op=async_op, timeout=o.timeout)]

    return Launch("allgather", issue, value, copies, (src, flat))


def allgather_coalesced(a: Args, output_lists: Any, input_list: Any, o: CallOptions) -> Launch:
    """All-gather of several tensors as one call, in torch's layout:
    output_lists[r][i] gets rank r's input_list[i]."""
    name = "allgather_coalesced"
    ins = a.tensors(input_list, name, "input_list")
    if not isinstance(output_lists, (list, tuple)) or len(output_lists) != a.size:
        raise ValueError(
            a.err(
                name, f"output_lists must hold {a.size} lists (one per rank) of {len(ins)} tensors"
            )
        )
    for r, lst in enumerate(output_lists):
        if not isinstance(lst, (list, tuple)) or len(lst) != len(ins):
            raise ValueError(
                a.err(name, f"output_lists[{r}] must hold {len(ins)} tensors, like input_list")
            )
    parts = [
        gather_list(a, name, [output_lists[r][i] for r in range(a.size)], t, "output_lists")
        for i, t in enumerate(ins)
    ]
    copies = [cp for _, _, part_copies in parts for cp in part_copies]

    def issue(c: Communicator, async_op: bool) -> list:
        return [
            c.all_gather(flat, src, async_op=async_op, timeout=o.timeout) for src, flat, _ in parts
        ]

    return Launch(name, issue, output_lists, copies, parts)


def all_gather_into_tensors(
    a: Args, name: str, outputs: list, inputs: list, o: CallOptions
) -> Launch:
    """all_gather_into_tensor of outputs[i] and inputs[i], as one call."""
    a.same_length(name, outputs, inputs, "outputs and inputs")
    copies: list = []
    pairs = [
        (a.buf(a.tensor(x, name, "output"), copies), a.buf(a.tensor(y, name, "input"), None))
        for x, y in zip(outputs, inputs, strict=True)
    ]

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.all_gather(x, y, async_op=async_op, timeout=o.timeout) for x, y in pairs]

    return Launch(name, issue, list(outputs), copies, pairs)


def reduce_scatter(a: Args, out: torch.Tensor, ins: Any, o: CallOptions) -> Launch:
    """Reduce-scatter of a list of world_size tensors into `out`."""
    name = "reduce_scatter"
    if not isinstance(ins, (list, tuple)) or len(ins) != a.size:
        raise ValueError(a.err(name, f"input_tensors must be [list of {a.size} tensors]"))
    ins = [a.tensor(t, name, "input_tensors") for t in ins]
    check_complex(a, name, o, [out, *ins])
    flat = torch.cat([a.buf(t, None).reshape(-1) for t in ins])
    if o.factor is not None:
        flat.mul_(o.factor)
    copies: list = []
    ob = a.buf(out, copies)

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.reduce_scatter(ob, flat, o.op, async_op=async_op, timeout=o.timeout)]

    return Launch(name, issue, [out], copies, (ob, flat))


def reduce_scatter_tensors(
    a: Args, name: str, outputs: list, inputs: list, o: CallOptions
) -> Launch:
    """reduce_scatter_tensor of outputs[i] and inputs[i], as one call."""
    a.same_length(name, outputs, inputs, "outputs and inputs")
    outs = [a.tensor(x, name, "output") for x in outputs]
    ins = [a.tensor(y, name, "input") for y in inputs]
    check_complex(a, name, o, outs + ins)
    copies: list = []
    pairs = []
    for x, y in zip(outs, ins, strict=True):
        yb = a.buf(y, None)
        if o.factor is not None:  # PREMUL_SUM: scale a copy (the input stays as it was)
            yb = yb.mul(o.factor)
        pairs.append((a.buf(x, copies), yb))

    def issue(c: Communicator, async_op: bool) -> list:
        return [
            c.reduce_scatter(x, y, o.op, async_op=async_op, timeout=o.timeout) for x, y in pairs
        ]

    return Launch(name, issue, list(outputs), copies, pairs)


def reduce(a: Args, t: torch.Tensor, o: CallOptions) -> Launch:
    """Reduce into rank o.root's tensor (the others' stay unchanged)."""
    check_complex(a, "reduce", o, [t])
    copies: list = []
    buf = a.buf(t, copies)
    if o.factor is not None:
        if a.rank == o.root:
            _scale([buf], o.factor)
        else:  # other ranks' tensors stay unchanged
            buf = buf.mul(o.factor)
            copies = []

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.reduce(buf, o.root, o.op, async_op=async_op, timeout=o.timeout)]

    return Launch("reduce", issue, [t], copies, buf)


def barrier(o: CallOptions) -> Launch:
    """Completes once every rank of the group has entered the barrier."""

    def issue(c: Communicator, async_op: bool) -> list:
        return [c.barrier(async_op=async_op, timeout=o.timeout)]

    return Launch("barrier", issue, [])
