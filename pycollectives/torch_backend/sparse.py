"""All-reduce of sparse COO tensors, as gloo computes it: every rank's
coalesced indices and values are all-gathered and summed, and the coalesced
sum replaces each rank's tensor (the same bits on every rank). SUM only."""

from __future__ import annotations

import torch

from ..communicator import Communicator, ReduceOp
from .args import Args
from .options import CallOptions
from .planned_call import Launch, outside_autograd


def is_sparse(t: object) -> bool:
    """Whether `t` is a torch tensor of a sparse layout."""
    return isinstance(t, torch.Tensor) and t.layout != torch.strided


def sparse_allreduce(a: Args, ts: list[torch.Tensor], o: CallOptions) -> Launch:
    """The Launch of an all-reduce of one sparse COO tensor. Its sizes are
    exchanged before its data, so it runs synchronously even when the caller
    asked for an asynchronous Work (which is then complete at once). Raises
    ValueError for several tensors, another sparse layout or another op."""
    name = "allreduce"
    if len(ts) != 1:
        raise ValueError(a.err(name, f"sparse tensors are reduced one at a time, got {len(ts)}"))
    t = ts[0]
    if t.layout != torch.sparse_coo:
        raise ValueError(
            a.err(name, f"tensors has layout {t.layout}; sparse all-reduce takes torch.sparse_coo")
        )
    if o.op != ReduceOp.SUM or o.factor is not None:
        raise ValueError(
            a.err(name, f"op={o.op_name} with a sparse tensor: only SUM is supported (as gloo)")
        )

    def issue(c: Communicator, async_op: bool) -> list:
        summed = _sum(a, c, t.coalesce(), o.timeout)
        with outside_autograd():
            t.copy_(summed)
        return []

    return Launch(name, issue, [t])


def _sum(a: Args, c: Communicator, x: torch.Tensor, timeout: float | None) -> torch.Tensor:
    """The sum over the ranks of the coalesced sparse `x`, coalesced."""
    idx = x.indices().t().contiguous()  # (nnz, sparse_dim)
    vals = x.values().contiguous()  # (nnz, *dense)
    nnz = torch.tensor([idx.shape[0]], dtype=torch.int64)
    counts = torch.empty(a.size, dtype=torch.int64)
    c.all_gather(counts, nnz, timeout=timeout)
    most = int(counts.max())
    # Equal blocks for the all-gathers: pad every rank's entries to the largest count.
    idx_pad = idx.new_zeros((most, idx.shape[1]))
    idx_pad[: idx.shape[0]] = idx
    vals_pad = vals.new_zeros((most, *vals.shape[1:]))
    vals_pad[: vals.shape[0]] = vals
    all_idx = idx.new_empty((a.size * most, idx.shape[1]))
    all_vals = vals.new_empty((a.size * most, *vals.shape[1:]))
    c.all_gather(all_idx, idx_pad, timeout=timeout)
    c.all_gather(a.buf(all_vals, None), a.buf(vals_pad, None), timeout=timeout)
    keep = torch.cat([torch.arange(r * most, r * most + int(n)) for r, n in enumerate(counts)])
    summed = torch.sparse_coo_tensor(all_idx[keep].t(), all_vals[keep], x.shape)
    return summed.coalesce()
