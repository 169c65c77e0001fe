"""The collectives of the "pycoll" backend (pycollectives.backend) that run as
core collectives (_CollectivesMixin, mixed into ProcessGroupPycoll): all-reduce,
broadcast, the all-gathers, the reduce-scatters, reduce and barrier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .communicator import Communicator


class _CollectivesMixin:
    """The core collectives of ProcessGroupPycoll (mixed into it)."""

    # -- collectives -------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """All-reduce of each tensor in place (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)."""
        name = "allreduce"
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        ts = [self._tensor(t, name, "tensors") for t in tensors]
        op, factor = self._op(opts, name, ts)
        if factor is not None:  # PREMUL_SUM: scale, then sum (in place, as NCCL)
            for t in ts:
                t.mul_(factor)
        copies: list = []
        bufs = [self._buf(t, copies) for t in ts]

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_reduce(b, op, async_op=a) for b in bufs]

        return self._launch(name, issue, list(tensors), copies, bufs, opts=opts)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> dist.Work:
        """All-reduce of several tensors as one operation (one flat buffer per dtype)."""
        name = "allreduce_coalesced"
        ts = [self._tensor(t, name, "tensors") for t in tensors]
        op, factor = self._op(opts, name, ts)
        if factor is not None:
            for t in ts:
                t.mul_(factor)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in ts:
            groups.setdefault(t.dtype, []).append(t)
        flats, copies = [], []
        for dt_ts in groups.values():
            if len(dt_ts) == 1:
                flats.append(self._buf(dt_ts[0], copies))
                continue
            flat = torch.cat([t.reshape(-1) for t in dt_ts])
            flats.append(self._buf(flat, None))
            off = 0
            for t in dt_ts:
                n = t.numel()
                copies.append((t, flat[off : off + n].view(t.shape)))
                off += n

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_reduce(f, op, async_op=a) for f in flats]

        return self._launch(name, issue, list(tensors), copies, flats, opts=opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        """Broadcast of rank opts.rootRank's tensor, in place."""
        name = "broadcast"
        t = self._one(tensors, name)
        root = self._peer(getattr(opts, "rootRank", 0), name, "src")
        copies: list = []
        buf = self._buf(t, copies)

        def issue(c: Communicator, a: bool) -> list:
            return [c.broadcast(buf, root, async_op=a)]

        return self._launch(name, issue, [t], copies, buf, opts=opts)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """All-gather into a list of world_size tensors (output_tensors[0])."""
        name = "allgather"
        inp = self._one(input_tensors, name, "input_tensors")
        if len(output_tensors) != 1:
            raise ValueError(
                self._err(name, f"output_tensors must be [list of {self._size} tensors]")
            )
        src, flat, copies = self._gather_list(name, output_tensors[0], inp, "output_tensors")

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_gather(flat, src, async_op=a)]

        return self._launch(name, issue, output_tensors, copies, (src, flat), opts=opts)

    def allgather_coalesced(
        self, output_lists: list, input_list: list, opts: Any = None
    ) -> dist.Work:
        """All-gather of several tensors as one Work (completed with `output_lists`):
        output_lists[i] gets every rank's input_list[i]."""
        name = "allgather_coalesced"
        self._same_length(name, output_lists, input_list, "output_lists and input_list")
        parts = [
            self._gather_list(name, outs, self._tensor(inp, name, "input_list"), "output_lists")
            for outs, inp in zip(output_lists, input_list, strict=True)
        ]
        copies = [cp for _, _, part_copies in parts for cp in part_copies]

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_gather(flat, src, async_op=a) for src, flat, _ in parts]

        return self._launch(name, issue, output_lists, copies, parts, opts=opts)

    def _gather_list(
        self, name: str, outs: Any, inp: torch.Tensor, arg: str
    ) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Checks one all-gather of `inp` into the list `outs` of world_size tensors
        like it; returns the core's input and flat output buffers and the copies
        from the flat output into `outs`."""
        if not isinstance(outs, (list, tuple)) or len(outs) != self._size:
            raise ValueError(self._err(name, f"{arg} must be lists of {self._size} tensors"))
        for o in outs:
            self._tensor(o, name, arg)
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError(
                    self._err(
                        name,
                        f"output tensor of {o.numel()} {o.dtype} elements does not match the "
                        f"input ({inp.numel()} {inp.dtype})",
                    )
                )
        src = inp.contiguous()
        flat = torch.empty((self._size, *src.shape), dtype=src.dtype, device=src.device)
        copies = [(o, flat[r].view_as(o)) for r, o in enumerate(outs)]
        return self._buf(src, None), self._buf(flat, None), copies

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> dist.Work:
        """All-gather into one tensor (torch's all_gather_into_tensor)."""
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None, name: str = ""
    ) -> dist.Work:
        """Several all_gather_into_tensor as one Work (completed with `outputs`)."""
        name = name or "all_gather_into_tensor_coalesced"
        self._same_length(name, outputs, inputs, "outputs and inputs")
        copies: list = []
        pairs = [
            (
                self._buf(self._tensor(o, name, "output"), copies),
                self._buf(self._tensor(i, name, "input"), None),
            )
            for o, i in zip(outputs, inputs, strict=True)
        ]

        def issue(c: Communicator, a: bool) -> list:
            return [c.all_gather(ob, ib, async_op=a) for ob, ib in pairs]

        return self._launch(name, issue, list(outputs), copies, pairs, opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self, output_tensors: list, input_tensors: list, opts: Any = None
    ) -> dist.Work:
        """Reduce-scatter of a list of world_size tensors into output_tensors[0]."""
        name = "reduce_scatter"
        out = self._one(output_tensors, name, "output_tensors")
        ins = input_tensors[0] if input_tensors else []
        if len(input_tensors) != 1 or len(ins) != self._size:
            raise ValueError(
                self._err(name, f"input_tensors must be [list of {self._size} tensors]")
            )
        ins = [self._tensor(t, name, "input_tensors") for t in ins]
        op, factor = self._op(opts, name, [out, *ins])
        flat = torch.cat([self._buf(t, None).reshape(-1) for t in ins])
        if factor is not None:
            flat.mul_(factor)
        copies: list = []
        ob = self._buf(out, copies)

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce_scatter(ob, flat, op, async_op=a)]

        return self._launch(name, issue, [out], copies, (ob, flat), opts=opts)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        opts: Any = None,
    ) -> dist.Work:
        """Reduce-scatter of one tensor (torch's reduce_scatter_tensor)."""
        return self.reduce_scatter_single_coalesced(
            [output], [input], opts, "reduce_scatter_tensor"
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None, name: str = ""
    ) -> dist.Work:
        """Several reduce_scatter_tensor as one Work (completed with `outputs`)."""
        name = name or "reduce_scatter_tensor_coalesced"
        self._same_length(name, outputs, inputs, "outputs and inputs")
        outs = [self._tensor(o, name, "output") for o in outputs]
        ins = [self._tensor(i, name, "input") for i in inputs]
        op, factor = self._op(opts, name, outs + ins)
        copies: list = []
        pairs = []
        for o, i in zip(outs, ins, strict=True):
            ib = self._buf(i, None)
            if factor is not None:  # PREMUL_SUM: scale a copy (the input stays as it was)
                ib = ib.mul(factor)
            pairs.append((self._buf(o, copies), ib))

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce_scatter(ob, ib, op, async_op=a) for ob, ib in pairs]

        return self._launch(name, issue, list(outputs), copies, pairs, opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """Reduce into rank opts.rootRank's tensor (others unchanged)."""
        name = "reduce"
        t = self._one(tensors, name)
        root = self._peer(getattr(opts, "rootRank", 0), name, "dst")
        op, factor = self._op(opts, name, [t])
        copies: list = []
        buf = self._buf(t, copies)
        if factor is not None:
            if self._rank == root:
                buf.mul_(factor)
            else:  # other ranks' tensors stay unchanged
                buf = buf.mul(factor)
                copies = []

        def issue(c: Communicator, a: bool) -> list:
            return [c.reduce(buf, root, op, async_op=a)]

        return self._launch(name, issue, [t], copies, buf, opts=opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        """Completes once every rank of the group has entered the barrier."""

        def issue(c: Communicator, a: bool) -> list:
            return [c.barrier(async_op=a)]

        return self._launch("barrier", issue, [], opts=opts)
