"""The pipeline runtime's communication, as named functions on the pipeline
communicator (pycollectives; never torch.distributed).

Messages check themselves, at no cost. pycollectives checks that a receive
and its send agree on element count and dtype, and on a mismatch raises
CollectiveMismatch on both ranks and aborts the communicator, so every rank
stops. The runtime sends each tensor's bytes under a dtype that depends on
the message's number k among the step's messages from its sender to its
receiver: the k-th view of `VIEWS` (k modulo how many divide its size; the
same bytes, viewed, never copied), and the receiver views its buffer alike.
A rank that skips a receive, or sends one message too many, then meets its
next message from that peer under another dtype, and every rank fails right
there instead of computing on the wrong micro-batch. Two more signatures
close the set: an empty int8 message is the *end mark* two neighbours
exchange after their last action (a message still unreceived then fails
this step, not the next), an empty uint8 one the *stop signal* a rank whose
compute failed sends its neighbours, whose next receive from it then fails,
so the abort reaches every rank. (A tag message before each message would
say more, at the cost of a message more each.)

Collectives that make bad input fail on every rank alike: `agree` (each
rank's error, if any, and a digest of what must be the same everywhere),
`gather_specs` (what each stage sends and expects), `gather_tie_holders`.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pycollectives import Communicator

from .actions import Action, Kind
from .execution_model import Record
from .gpt_stage import TensorSpec
from .schedule import Schedule

__all__ = [
    "MessageCodes",
    "agree",
    "digest",
    "exchange_end_marks",
    "gather_records",
    "gather_specs",
    "gather_tie_holders",
    "stop_peers",
    "sum_tied_gradients",
]

_STATUS_BYTES = 1024  # per rank in `agree`: status, digest, message
_MAX_DIMS = 8
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_KINDS = tuple(Kind)
_STOP = torch.empty(0, dtype=torch.uint8)


def digest(text: str) -> int:
    """A 63-bit digest of `text`, the same in every process."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


# The dtypes a message's bytes are sent under, by its number in the step.
VIEWS = (
    torch.uint8,
    torch.int8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
)
_END = torch.empty(0, dtype=torch.int8)


def _views(nbytes: int) -> tuple[torch.dtype, ...]:
    """The VIEWS whose element size divides `nbytes`."""
    return tuple(d for d in VIEWS if nbytes % d.itemsize == 0)


class MessageCodes:
    """The signature (dtype view) of every message of rank `rank` in
    `schedule` (see the module docstring)."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule, self.rank = schedule, rank
        sent: Counter[int] = Counter()
        received: Counter[int] = Counter()
        self.number: dict[Action, int] = {}  # a send or receive -> its number with its peer
        for a in schedule.actions[rank]:
            if a.is_comm:
                count = sent if a.kind.is_send else received
                self.number[a] = count[a.peer]
                count[a.peer] += 1

    def view(self, a: Action, t: torch.Tensor) -> torch.Tensor:
        """`t` (contiguous) as message `a` goes: flat, under its dtype."""
        views = _views(t.numel() * t.itemsize)
        dtype = views[self.number[a] % len(views)]
        flat = t.reshape(-1)
        if flat.storage_offset() * t.itemsize % dtype.itemsize:
            flat = flat.clone()  # a view of another alignment (never for fresh buffers)
        return flat.view(dtype)

    @staticmethod
    def explain(message: str) -> str:
        """A sentence saying what each side of a send/recv mismatch in
        pycollectives' `message` meant; '' if it is not one."""
        pat = r"rank (\d+) called {}\(count=(\d+), (\w+), peer=\d+\)"
        recv, send = re.search(pat.format("recv"), message), re.search(pat.format("send"), message)
        if not (recv and send):
            return ""
        return (
            f"rank {recv[1]} expected {_meaning(int(recv[2]), recv[3])} from rank {send[1]}, "
            f"which sent {_meaning(int(send[2]), send[3])}: the two ranks disagree on which "
            "message comes next (a receive or a send was skipped, or a rank stopped)"
        )


def _meaning(count: int, dtype: str) -> str:
    """What a message of `count` x `dtype` is in this protocol."""
    if count == 0:
        return {"uint8": "a stop signal (its step failed)", "int8": "an end mark"}.get(
            dtype, "an empty message"
        )
    d = getattr(torch, dtype, None)
    views = _views(count * d.itemsize) if isinstance(d, torch.dtype) else ()
    if d not in views:
        return f"{count} x {dtype}"
    return f"message {views.index(d)} (modulo {len(views)}) of the step"


def agree(
    comm: Communicator,
    what: str,
    error: BaseException | None = None,
    value: int = 0,
    differs: str = "",
    timeout: float | None = None,
) -> None:
    """Collective over `comm`: gathers every rank's `error` (or None) and
    `value`. Raises on every rank alike when any rank failed (ValueError if
    every error was a ValueError, else RuntimeError), naming each failing
    rank and its message, or when values differ from rank 0's: ValueError
    naming those ranks and `differs` (what they disagree on)."""
    buf = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[: _STATUS_BYTES - 16]
        buf[0] = 1 if isinstance(error, ValueError) else 2
        buf[9:11] = torch.tensor(list(len(text).to_bytes(2, "little")), dtype=torch.uint8)
        buf[16 : 16 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    buf[1:9] = torch.tensor(list(value.to_bytes(8, "little")), dtype=torch.uint8)
    every = torch.empty(comm.world_size * _STATUS_BYTES, dtype=torch.uint8)
    comm.all_gather(every, buf, timeout=timeout)
    rows = [bytes(r.tolist()) for r in every.view(comm.world_size, _STATUS_BYTES)]
    failed: dict[str, list[int]] = {}
    kinds = set()
    for r, row in enumerate(rows):
        if row[0]:
            n = int.from_bytes(row[9:11], "little")
            failed.setdefault(row[16 : 16 + n].decode(errors="replace"), []).append(r)
            kinds.add(row[0])
    if failed:
        lines = [
            f"{'rank' if len(rs) == 1 else 'ranks'} {_ranks(rs)}: {m}" for m, rs in failed.items()
        ]
        cls = ValueError if kinds == {1} else RuntimeError
        raise cls(f"{what} (raised on rank {comm.rank}): " + "\n".join(lines))
    values = [int.from_bytes(row[1:9], "little") for row in rows]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise ValueError(
            f"{what} (raised on rank {comm.rank}): ranks {differ} {differs} than rank 0"
        )


def _ranks(ranks: Sequence[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else str(list(ranks))


def _encode_spec(spec: TensorSpec | None) -> list[int]:
    if spec is None:
        return [0] * (3 + _MAX_DIMS)
    if spec.dtype not in DTYPES or len(spec.shape) > _MAX_DIMS:
        raise ValueError(f"pipeline: cannot send {spec}: dtype or rank not supported")
    shape = list(spec.shape) + [0] * (_MAX_DIMS - len(spec.shape))
    return [1, DTYPES.index(spec.dtype), len(spec.shape), *shape]


def _decode_spec(row: Sequence[int]) -> TensorSpec | None:
    if not row[0]:
        return None
    return TensorSpec(tuple(int(d) for d in row[3 : 3 + row[2]]), DTYPES[row[1]])


def gather_specs(
    comm: Communicator,
    mine: dict[int, tuple[TensorSpec | None, TensorSpec | None]],
    schedule: Schedule,
    timeout: float | None = None,
) -> list[tuple[TensorSpec | None, TensorSpec | None]]:
    """Collective: every stage's (input spec, output spec), from the rank
    holding it (`mine`: this rank's stages); the same list on every rank."""
    width = 2 * (3 + _MAX_DIMS)
    table = torch.zeros(schedule.num_stages, width, dtype=torch.int64)
    for s, (spec_in, spec_out) in mine.items():
        table[s] = torch.tensor(_encode_spec(spec_in) + _encode_spec(spec_out))
    every = torch.empty(comm.world_size * table.numel(), dtype=torch.int64)
    comm.all_gather(every, table.view(-1), timeout=timeout)
    rows = every.view(comm.world_size, schedule.num_stages, width)
    out = []
    for s in range(schedule.num_stages):
        row = rows[schedule.rank_of(s), s].tolist()
        out.append((_decode_spec(row[: width // 2]), _decode_spec(row[width // 2 :])))
    return out


def gather_tie_holders(
    comm: Communicator, keys: Iterable[str], timeout: float | None = None, max_keys: int = 8
) -> dict[str, list[int]]:
    """Collective: for each of this rank's tied-parameter `keys`, the ranks
    that hold it (in order). Raises ValueError past `max_keys` keys."""
    keys = sorted(set(keys))
    if len(keys) > max_keys:
        raise ValueError(f"pipeline: {len(keys)} tied parameters, at most {max_keys}")
    mine = torch.zeros(max_keys, dtype=torch.int64)
    mine[: len(keys)] = torch.tensor([digest(k) for k in keys], dtype=torch.int64)
    every = torch.empty(comm.world_size * max_keys, dtype=torch.int64)
    comm.all_gather(every, mine, timeout=timeout)
    rows = every.view(comm.world_size, max_keys).tolist()
    return {k: [r for r, row in enumerate(rows) if digest(k) in row] for k in keys}


def sum_tied_gradients(
    comm: Communicator,
    params: dict[str, nn.Parameter],
    holders: dict[str, list[int]],
    timeout: float | None = None,
) -> None:
    """Each tied parameter's gradient becomes the sum over the ranks holding
    it, added in rank order (the same bits on each); one batch of sends and
    receives among the holders. A missing gradient counts as zero. A CUDA
    gradient goes through the host (batch_p2p takes CPU buffers) and the sum
    comes back to its device."""
    for key in sorted(params):
        others = [r for r in holders[key] if r != comm.rank]
        if not others:
            continue
        p = params[key]
        mine = p.grad if p.grad is not None else torch.zeros_like(p)
        device, mine = mine.device, mine.contiguous().cpu()
        theirs = {r: torch.empty_like(mine) for r in others}
        ops = [("send", mine, r) for r in others] + [("recv", theirs[r], r) for r in others]
        comm.batch_p2p(ops, timeout=timeout)
        parts = [mine if r == comm.rank else theirs[r] for r in holders[key]]
        total = parts[0].clone()
        for t in parts[1:]:
            total += t
        p.grad = total.to(device)


def exchange_end_marks(
    comm: Communicator, peers: Sequence[int], timeout: float | None = None
) -> None:
    """Sends the end mark to every peer and receives theirs (one batch):
    fails with CollectiveMismatch on both sides if a message of the step is
    still unreceived between them."""
    ops = [("send", _END, q) for q in peers]
    ops += [("recv", torch.empty(0, dtype=torch.int8), q) for q in peers]
    if ops:
        comm.batch_p2p(ops, timeout=timeout)


def stop_peers(comm: Communicator, peers: Sequence[int]) -> None:
    """Sends the stop signal to `peers` without waiting (best effort: the
    communicator may already be aborted)."""
    try:
        if peers:
            comm.batch_p2p([("send", _STOP, q) for q in peers], async_op=True)
    except Exception:  # noqa: BLE001 - already failing; the caller raises its own error
        pass


def gather_records(
    comm: Communicator, records: Sequence[Record], timeout: float | None = None
) -> list[Record]:
    """Collective: every rank's (rank, start, end, Action) records, on every
    rank, in rank order."""
    rows = torch.tensor(
        [
            [r.start, r.end, _KINDS.index(r.action.kind), r.action.stage, r.action.microbatch]
            + [-1 if r.action.peer is None else r.action.peer]
            for r in records
        ],
        dtype=torch.float64,
    ).reshape(-1, 6)
    counts = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64), timeout=timeout)
    most = int(counts.max())
    padded = torch.zeros(most, 6, dtype=torch.float64)
    padded[: len(rows)] = rows
    every = torch.empty(comm.world_size * most * 6, dtype=torch.float64)
    comm.all_gather(every, padded.view(-1), timeout=timeout)
    out = []
    for r, block in enumerate(every.view(comm.world_size, most, 6)):
        for t0, t1, k, st, mb, peer in block[: int(counts[r])].tolist():
            a = Action(_KINDS[int(k)], int(st), int(mb), None if peer < 0 else int(peer))
            out.append(Record(r, t0, t1, a))
    return out
