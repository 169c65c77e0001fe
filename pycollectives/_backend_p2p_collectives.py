"""The collectives of the "pycoll" backend (pycollectives.backend) built on point
to point (_P2PCollectivesMixin, mixed into ProcessGroupPycoll): all-to-all with
split sizes or of lists, gather and scatter, each issued as one batch of sends
and receives (_P2PMixin._p2p_issue).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .communicator import Communicator


class _P2PCollectivesMixin:
    """all_to_all_single, alltoall, gather and scatter of ProcessGroupPycoll
    (mixed into it)."""

    # -- the collectives built on point to point -----------------------------------
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list,
        input_split_sizes: list,
        opts: Any = None,
    ) -> dist.Work:
        """All-to-all of one tensor, even (no splits) or with split sizes along dim 0."""
        name = "all_to_all_single"
        out = self._tensor(output, name, "output")
        inp = self._tensor(input, name, "input")
        if out.dtype != inp.dtype:
            raise ValueError(
                self._err(name, f"output dtype {out.dtype} differs from input {inp.dtype}")
            )
        copies: list = []
        ob = self._buf(out, copies)
        ib = self._buf(inp, None)
        if not output_split_sizes and not input_split_sizes:

            def issue(c: Communicator, a: bool) -> list:
                return [c.all_to_all(ob, ib, async_op=a)]

            return self._launch(name, issue, [output], copies, (ob, ib), opts=opts)
        in_rows = self._splits(input_split_sizes, inp, "input_split_sizes", name)
        out_rows = self._splits(output_split_sizes, out, "output_split_sizes", name)
        ib_rows = self._rows(ib, inp)
        ob_rows = self._rows(ob, out)
        me = self._rank
        issue, ops = self._exchange(
            name,
            torch.split(ib_rows, in_rows),
            torch.split(ob_rows, out_rows),
            f"input_split_sizes[{me}] and output_split_sizes[{me}] differ",
        )
        return self._launch(name, issue, [output], copies, (ob, ib, ops), opts=opts)

    alltoall_base = all_to_all_single

    @staticmethod
    def _rows(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """`buf` (the core's view of `t`) as a 2-D tensor of t's dim-0 rows."""
        rows = t.shape[0] if t.dim() else 1
        return buf.reshape(rows, buf.numel() // rows if rows else 0)

    def _splits(self, splits: list, t: torch.Tensor, arg: str, name: str) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % self._size:
                raise ValueError(
                    self._err(
                        name, f"{arg} is empty but dim 0 ({rows}) is not divisible by {self._size}"
                    )
                )
            return [rows // self._size] * self._size
        splits = [int(s) for s in splits]
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                self._err(
                    name,
                    f"{arg}={splits} must be {self._size} non-negative sizes summing to dim 0 ({rows})",
                )
            )
        return splits

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """All-to-all of lists: input_tensors[j] goes to rank j's output_tensors[rank]."""
        name = "alltoall"
        n, me = self._size, self._rank
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(self._err(name, f"output and input lists must hold {n} tensors each"))
        outs = [self._tensor(t, name, "output_tensors") for t in output_tensors]
        ins = [self._tensor(t, name, "input_tensors") for t in input_tensors]
        copies: list = []
        obs = [self._buf(t, copies) for t in outs]
        ibs = [self._buf(t, None) for t in ins]
        issue, _ = self._exchange(
            name, ibs, obs, f"output_tensors[{me}] and input_tensors[{me}] differ in size"
        )
        return self._launch(name, issue, output_tensors, copies, (obs, ibs), opts=opts)

    def _exchange(
        self, name: str, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], differ: str
    ) -> tuple[Callable[[Communicator, bool], list], list]:
        """(issue function, point-to-point ops) of an all-to-all of blocks:
        ins[p] goes to rank p's outs[this rank]. This rank's own block is copied
        locally when issued (ValueError with `differ` if its two sizes differ);
        the others go as one batch, each rank sending to r+k and receiving from
        r-k."""
        n, me = self._size, self._rank
        ops = []
        for k in range(1, n):
            dst, src = (me + k) % n, (me - k) % n
            ops.append(("send", ins[dst], dst))
            ops.append(("recv", outs[src], src))

        def issue(c: Communicator, a: bool) -> list:
            if ins[me].numel() != outs[me].numel():
                raise ValueError(self._err(name, differ))
            outs[me].copy_(ins[me])
            return self._p2p_issue(c, ops, a)

        return issue, ops

    def gather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """Gather to rank opts.rootRank: output_tensors[0][r] gets rank r's input."""
        return self._rooted("gather", output_tensors, input_tensors, opts, to_root=True)

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> dist.Work:
        """Scatter from rank opts.rootRank: rank r's output gets input_tensors[0][r]."""
        return self._rooted("scatter", output_tensors, input_tensors, opts, to_root=False)

    def _rooted(
        self, name: str, output_tensors: list, input_tensors: list, opts: Any, to_root: bool
    ) -> dist.Work:
        """Gather (to_root) or scatter as one batch of sends and receives: the
        root exchanges with every other rank; its own block is a local copy."""
        root = self._peer(getattr(opts, "rootRank", 0), name, "dst" if to_root else "src")
        # The root's side is a list of world_size tensors, the others' one tensor.
        many, many_arg = (
            (output_tensors, "output_tensors") if to_root else (input_tensors, "input_tensors")
        )
        one_list, one_arg = (
            (input_tensors, "input_tensors") if to_root else (output_tensors, "output_tensors")
        )
        copies: list = []
        one = self._buf(self._one(one_list, name, one_arg), None if to_root else copies)
        ops: list = []
        local = None
        if self._rank == root:
            blocks = many[0] if len(many) == 1 else None
            if blocks is None or len(blocks) != self._size:
                raise ValueError(
                    self._err(
                        name, f"on the root, {many_arg} must be [list of {self._size} tensors]"
                    )
                )
            bufs = [
                self._buf(self._tensor(t, name, many_arg), copies if to_root else None)
                for t in blocks
            ]
            kind = "recv" if to_root else "send"
            ops = [(kind, bufs[r], r) for r in range(self._size) if r != root]
            local = (bufs[root], one) if to_root else (one, bufs[root])  # (destination, source)
        else:
            if many and any(len(x) for x in many):
                raise ValueError(self._err(name, f"{many_arg} must be empty on non-root ranks"))
            ops = [("send" if to_root else "recv", one, root)]

        def issue(c: Communicator, a: bool) -> list:
            if local is not None:
                if local[0].numel() != local[1].numel():
                    raise ValueError(self._err(name, "output and input tensors differ in size"))
                local[0].copy_(local[1])
            return self._p2p_issue(c, ops, a)

        return self._launch(name, issue, output_tensors, copies, (one, ops), opts=opts)
