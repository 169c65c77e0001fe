"""The collectives of the sharding engine, as named functions over a
pycollectives Communicator (never torch.distributed):

    function              what moves                              bytes per rank (ring)
    all_gather_flat       each rank's shard -> the full flat       (N-1)/N x flat
    reduce_scatter_flat   full flat gradients -> averaged shard    (N-1)/N x flat
    OrderGuard.announce   one 64-byte row per rank (all-reduce)    what each rank is about to do
    all_gather_bytes      a variable-length byte string per rank   (setup only)
    broadcast_tensors     rank 0's tensors, fused per dtype        (setup only)

The guard is what turns the classic ZeRO-3 hang (ranks running different unit
forwards) into an error: before each all-gather or reduce-scatter of a unit,
every rank contributes a fingerprint row (unit, phase, step, position) to a
small all-reduce. Rows that differ mean the ranks are about to exchange
different units: two units of the same size would otherwise mix silently.
Every rank sees every row, so every rank raises the same ShardingMismatch
naming the unit, the step and what each rank was doing. The fingerprints go
through all_reduce, so the all-gather and reduce-scatter counters of
comm.stats() hold the units' bytes alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from pycollectives import Communicator, ReduceOp, Work

from .flat_param import FlatParam

__all__ = [
    "PHASES",
    "OrderGuard",
    "ShardingMismatch",
    "all_gather_bytes",
    "all_gather_flat",
    "broadcast_tensors",
    "reduce_scatter_flat",
]

FORWARD, BACKWARD, REDUCE, STEP = 1, 2, 3, 4
PHASES = {
    FORWARD: "all-gather for forward",
    BACKWARD: "all-gather for backward",
    REDUCE: "reduce-scatter of gradients",
    STEP: "all-gather after the optimizer step",
}
_MAGIC = 0x5A3E  # marks a fingerprint row (all-zero rows mean a rank wrote none)
_ROW = 8  # int64 per rank: 64 bytes, one ring chunk


class ShardingMismatch(RuntimeError):
    """The ranks were about to run different collectives of the sharding engine."""


def all_gather_flat(comm: Communicator, flat: FlatParam) -> Work | None:
    """Starts gathering every rank's shard of `flat` into `flat.full` (storage
    allocated first). Unsharded, the input is full's own block: in place."""
    flat.alloc_full()
    return comm.all_gather(flat.full, flat.gather_input(), async_op=True)


def reduce_scatter_flat(comm: Communicator, out: torch.Tensor, full: torch.Tensor) -> Work | None:
    """Starts averaging the ranks' flat gradients `full` into this rank's shard
    `out` (ReduceOp.AVG: the same (a + b) / 2 per element as DDP's all-reduce)."""
    return comm.reduce_scatter(out, full, ReduceOp.AVG, async_op=True)


def all_gather_bytes(comm: Communicator, payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order (two all-gathers: lengths, then bytes)."""
    n = comm.world_size
    sizes = torch.empty(n, dtype=torch.int64)
    comm.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64))
    width = max(1, int(sizes.max()))
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = torch.empty(n * width, dtype=torch.uint8)
    comm.all_gather(every, mine)
    rows = every.view(n, width)
    return [bytes(rows[r, : int(sizes[r])].tolist()) for r in range(n)]


def broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Copies rank 0's values of `tensors` into every rank's, one broadcast per dtype and device."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, 0)
            off = 0
            for t in group:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()


@dataclass
class _Check:
    table: torch.Tensor  # [world_size, _ROW] int64, this rank's row filled before the sum
    work: Work | None
    seq: int


class OrderGuard:
    """Fingerprint exchange before each collective of the engine (see the
    module docstring). `announce` starts it asynchronously; `settle(check)`
    verifies every fingerprint announced up to `check`, in order, so that
    whichever collective a rank waits for, it first learns of the earliest
    disagreement. Disabled, it does nothing and costs nothing.

    Raises ShardingMismatch (from settle) on every rank when the rows differ.
    """

    def __init__(self, comm: Communicator, unit_names: list[str], enabled: bool = True) -> None:
        self.comm, self.names, self.enabled = comm, unit_names, enabled
        self._pending: deque[_Check] = deque()
        self._seq = 0
        self._zero_row = [0] * _ROW

    def announce(
        self, unit: int, phase: int, step: int, micro: int, position: int, forwards: int
    ) -> _Check | None:
        """Starts the exchange of this rank's fingerprint for the collective it
        is about to issue: unit index, phase, step, micro-batch, the position of
        this collective among the step's collectives of that phase, and how many
        unit forwards this rank has run in the current forward pass."""
        if not self.enabled:
            return None
        rows = [self._zero_row] * self.comm.world_size  # one tensor built, not three ops
        rows[self.comm.rank] = [_MAGIC, unit, phase, step, micro, position, forwards, 0]
        table = torch.tensor(rows, dtype=torch.int64)
        self._seq += 1
        check = _Check(table, self.comm.all_reduce(table, ReduceOp.SUM, async_op=True), self._seq)
        self._pending.append(check)
        return check

    def settle(self, check: _Check | None = None) -> None:
        """Waits for and verifies every fingerprint announced up to `check`
        (all of them if None). Raises ShardingMismatch on disagreement."""
        while self._pending and (check is None or self._pending[0].seq <= check.seq):
            c = self._pending.popleft()
            if c.work is not None:
                c.work.wait()
            rows = c.table.tolist()  # 8 ints a rank: compared in Python, no tensor ops
            if any(row != rows[0] for row in rows):
                self._pending.clear()
                raise ShardingMismatch(self._message(c.table))

    def _describe(self, row: list[int]) -> str:
        magic, unit, phase, step, micro, pos, fwd, _ = row
        if magic != _MAGIC:
            return "no collective of the sharding engine (a different collective, or none)"
        name = self.names[unit] if 0 <= unit < len(self.names) else f"unit #{unit}"
        what = PHASES.get(phase, f"phase {phase}")
        return (
            f"{what} of unit '{name}' at step {step} (micro-batch {micro}), its collective "
            f"#{pos} of that kind in this step, after {fwd} unit forwards in this forward pass"
        )

    def _message(self, rows: torch.Tensor) -> str:
        groups: dict[tuple, list[int]] = {}
        for r in range(rows.shape[0]):
            groups.setdefault(tuple(rows[r].tolist()), []).append(r)
        steps = sorted({row[3] for row in groups})
        parts = "; ".join(
            f"{'rank' if len(rs) == 1 else 'ranks'} {rs[0] if len(rs) == 1 else rs}: "
            f"{self._describe(list(row))}"
            for row, rs in sorted(groups.items(), key=lambda kv: kv[1])
        )
        return (
            f"sharding: rank {self.comm.rank}: the ranks ran different unit collectives at step "
            f"{steps[0]}: {parts}. Every rank must run the same units' forwards, the same "
            "number of times and in the same order (a module skipped or repeated on some ranks "
            "makes ZeRO-3 hang in DeepSpeed); this error is raised on every rank instead."
        )
