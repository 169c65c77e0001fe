"""clip_grad_norm_ over sharded gradients, with torch's bits.

torch.nn.utils.clip_grad_norm_ takes the norm of every parameter's gradient
(one reduction kernel per tensor, whose summation order is the kernel's own:
vector lanes, then their sum, on the CPU), then the norm of the vector of those
norms, in parameter order. A norm assembled from pieces (partial sums of
squares per shard, as DeepSpeed and torch FSDP2's _NormPartial do) adds the
same squares in another order and differs from it in the last bits about one
step in four, and a clip that bites turns that into different updates.

So every parameter's norm is taken by the same kernel on a tensor of the
parameter's shape, as under DDP:

- a parameter inside this rank's shard: on its view there (a contiguous,
  64-byte aligned view of the parameter's shape, see flat_param.py);
- a parameter that straddles shards (at most world_size - 1 per flat
  parameter): assembled whole on the rank that holds its largest piece (one
  batch_p2p of the other pieces, CPU), which takes its norm; device tensors
  (no batch_p2p there) are summed whole onto every rank instead (one
  all-reduce of those parameters, each element added to zeros: exact).

The norms go into one vector in the root module's parameters() order (each
held by one rank, zeros elsewhere: an all-reduce of it is exact), and the total
is the norm of that vector, the coefficient and the scaling computed as torch
computes them. With fp32 gradients the result equals torch's on the full
gradients bit for bit; gradients in a narrower dtype (a bf16 reduce without
master gradients) take their norms in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pycollectives import Communicator, ReduceOp

from .flat_param import FlatParam

__all__ = ["clip_grad_norm"]

# CPU: straddling parameters assembled on one rank by batch_p2p (False: the
# all-reduce route that device tensors take; tests compare the two).
ASSEMBLE_ON_OWNER = True


def _norm(g: torch.Tensor, p: float) -> torch.Tensor:
    if g.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(g, p, dtype=torch.float32)
    return torch.linalg.vector_norm(g, p)


def total_norm(
    comm: Communicator, flats: Sequence[FlatParam], root: nn.Module, p: float
) -> torch.Tensor:
    """Collective over `comm`: the norm of order `p` of the gradient of the
    model `root` whose trainable flat parameters are `flats` (every rank the
    same, in the same order), as torch.nn.utils.get_total_norm computes it
    over the full gradients."""
    rank = comm.rank
    entries: list[tuple[FlatParam, int]] = [
        (f, k) for f in flats if f.grad_shard is not None for k in range(len(f.layout.slots))
    ]
    if not entries:
        return torch.tensor(0.0)
    # torch's order: its parameter order, grouped by gradient dtype (first seen first).
    index = {id(q): i for i, q in enumerate(root.parameters())}
    pos = [index.get(id(f.params[k]), len(index) + n) for n, (f, k) in enumerate(entries)]
    groups: dict[torch.dtype, int] = {}
    for i in sorted(range(len(entries)), key=pos.__getitem__):
        groups.setdefault(entries[i][0].grad_shard.dtype, len(groups))
    entries = [
        entries[i]
        for i in sorted(
            range(len(entries)), key=lambda i: (groups[entries[i][0].grad_shard.dtype], pos[i])
        )
    ]
    device = entries[0][0].grad_shard.device
    dtype = torch.promote_types(
        torch.float32, max((f.grad_shard.dtype for f, _ in entries), key=lambda d: d.itemsize)
    )
    norms = torch.zeros(len(entries), dtype=dtype, device=device)
    pieces = {id(f): f.layout.pieces(rank) for f, _ in entries}
    straddle: list[tuple[int, FlatParam, int]] = []
    for n, (f, k) in enumerate(entries):
        holders = f.layout.holders(k)
        if len(holders) > 1:
            straddle.append((n, f, k))
        elif holders and holders[0][0] == rank:
            s, at = f.layout.slots[k], pieces[id(f)][k][2]
            norms[n] = _norm(f.grad_shard[at : at + s.numel].view(s.shape), p)
    if ASSEMBLE_ON_OWNER and device.type == "cpu":
        _gather_to_owners(comm, straddle, pieces, norms, p)
        comm.all_reduce(norms, ReduceOp.SUM)  # one nonzero term per entry: exact
    else:  # (no batch_p2p for device tensors on one host)
        comm.all_reduce(norms, ReduceOp.SUM)
        _sum_everywhere(comm, straddle, pieces, norms, p)
    return torch.linalg.vector_norm(norms, p)


def _gather_to_owners(
    comm: Communicator,
    straddle: list[tuple[int, FlatParam, int]],
    pieces: dict[int, list[tuple[int, int, int]]],
    norms: torch.Tensor,
    p: float,
) -> None:
    """The norms of the parameters that straddle shards: each is assembled on
    its owner (the rank holding its largest piece, the lowest such rank on a
    tie) from the others' pieces, in one batch_p2p, and its norm written into
    `norms` there (zero elsewhere)."""
    rank, ops, mine = comm.rank, [], []
    for n, f, k in straddle:
        holders = f.layout.holders(k)
        owner = max(holders, key=lambda h: (h[2] - h[1], -h[0]))[0]
        lo, hi, at = pieces[id(f)][k]
        if rank == owner:
            s = f.layout.slots[k]
            whole = torch.empty(s.numel, dtype=f.grad_shard.dtype, device=f.grad_shard.device)
            whole[lo:hi].copy_(f.grad_shard[at : at + hi - lo])
            ops += [("recv", whole[a:b], r) for r, a, b in holders if r != rank]
            mine.append((n, whole.view(s.shape)))
        elif lo < hi:
            ops.append(("send", f.grad_shard[at : at + hi - lo], owner))
    if ops:
        comm.batch_p2p(ops)
    for n, whole in mine:
        norms[n] = _norm(whole, p)


def _sum_everywhere(
    comm: Communicator,
    straddle: list[tuple[int, FlatParam, int]],
    pieces: dict[int, list[tuple[int, int, int]]],
    norms: torch.Tensor,
    p: float,
) -> None:
    """The norms of the parameters that straddle shards, on every rank: each
    summed whole onto every rank (one all-reduce per dtype; each element comes
    from one rank, zeros from the others: exact)."""
    by_dtype: dict[torch.dtype, list[tuple[int, FlatParam, int]]] = {}
    for n, f, k in straddle:
        by_dtype.setdefault(f.grad_shard.dtype, []).append((n, f, k))
    for dt, items in by_dtype.items():
        sizes = [f.layout.slots[k].numel for _, f, k in items]
        whole = torch.zeros(sum(sizes), dtype=dt, device=norms.device)
        off = 0
        for (_, f, k), size in zip(items, sizes, strict=True):
            lo, hi, at = pieces[id(f)][k]
            whole[off + lo : off + hi].copy_(f.grad_shard[at : at + hi - lo])
            off += size
        comm.all_reduce(whole, ReduceOp.SUM)
        off = 0
        for (n, f, k), size in zip(items, sizes, strict=True):
            norms[n] = _norm(whole[off : off + size].view(f.layout.slots[k].shape), p)
            off += size


def clip_grad_norm(
    comm: Communicator,
    flats: Sequence[FlatParam],
    root: nn.Module,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Collective over `comm`: clips the gradient shards of `flats` (those of
    the model `root`, see total_norm) as torch.nn.utils.clip_grad_norm_ clips
    the full gradients (see the module docstring); returns the total norm.
    Raises RuntimeError on every rank for a non-finite norm with error_if_nonfinite."""
    p = float(norm_type)
    total = total_norm(comm, flats, root, p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"sharding: rank {comm.rank}: the total norm of order {p} of the gradients "
            f"is {float(total)}; clip_grad_norm_(error_if_nonfinite=True)"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for f in flats:
        if f.grad_shard is not None:
            f.grad_shard.mul_(coef.to(f.grad_shard.device))
    return total
