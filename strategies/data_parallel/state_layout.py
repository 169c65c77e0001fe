"""The packed layout of a rank's state for its buddy copy (redundancy.py), its
codec, and the exchange of layouts that differ from rank to rank.

A rank's state (shard state under ZeRO or fully_shard, a pipeline stage's
parameters and optimizer state under ElasticTrainer3D) is packed end to end
into host bytes; each `Entry` says where one tensor lies. Where every rank's
layout is the same (ZeroShards, FSDPShards) nothing about it travels. Where it
differs (TensorState: a pipeline's first stage holds the embedding, its last
the head), each refresh tells the buddy this rank's layout where it changed
since the last commit (`LayoutExchange`): the layout comes from another
process, so `decode_entries` checks every field, and the bytes a peer may
announce are bounded by the capacity it declared at setup (its first
exchange), itself bounded, so that a forged or corrupted layout cannot make
the receiver allocate more than the sender's place holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pycollectives import Communicator

__all__ = [
    "MAX_LAYOUT",
    "MAX_STATE",
    "Entry",
    "FullState",
    "LayoutExchange",
    "StateTensor",
    "decode_entries",
    "default_capacity",
    "encode_entries",
    "layout_of",
    "packed_size",
]

MAX_LAYOUT, MAX_STATE = 1 << 26, 1 << 40  # bytes of a layout, and of its state, from a peer
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor of the shard state: flat parameter `flat` (its index among
    the engine's flat parameters), `key` ("param" for the master shard, else
    the optimizer state's key), its place in the packed bytes, and whether it
    is sharded (a block per rank, laid out as the flat parameter's shard) or
    a scalar every rank holds alike. `slot`: for state kept per parameter
    (a torch optimizer over fully_shard's pieces), which parameter of the
    flat; -1 for state of the whole flat."""

    flat: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes
    nbytes: int
    sharded: bool
    device: torch.device  # where the tensor lives (the copy itself is in host memory)
    slot: int = -1


# The full state, by (flat index, key, slot), with its Entry (gather_full_state).
FullState = dict[tuple[int, str, int], tuple[torch.Tensor, Entry]]

# One tensor of a state to copy: (index, key, tensor, sharded), as Entry says.
StateTensor = tuple[int, str, torch.Tensor, bool]


def layout_of(tensors: list[StateTensor]) -> tuple[list[Entry], list[torch.Tensor]]:
    """The packed layout of `tensors`, end to end in their order, and the tensors
    (a ShardSource's layout())."""
    entries, off = [], 0
    for flat, key, t, sharded in tensors:
        n = t.numel() * t.element_size()
        entries.append(Entry(flat, key, t.dtype, tuple(t.shape), off, n, sharded, t.device))
        off += n
    return entries, [t for _, _, t, _ in tensors]


def packed_size(entries: list[Entry]) -> int:
    """The packed bytes of a layout."""
    return entries[-1].offset + entries[-1].nbytes if entries else 0


def default_capacity(entries: list[Entry]) -> int:
    """The bytes a state whose layout at setup is `entries` may grow to: four
    times its bytes and 16 bytes a tensor, room for up to three elementwise
    optimizer states and a scalar per parameter (AdamW's moments, amsgrad's
    maximum, its step) when the setup held the parameters only."""
    return 4 * packed_size(entries) + 16 * len(entries)


def encode_entries(entries: list[Entry]) -> bytes:
    """A layout as bytes (JSON), for a peer's decode_entries."""
    rows = [[e.flat, e.key, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset,
             e.nbytes, e.sharded, str(e.device), e.slot] for e in entries]  # fmt: skip
    return json.dumps(rows).encode()


def decode_entries(raw: bytes, who: str) -> list[Entry]:
    """The layout encode_entries wrote, checked: each entry's dtype known,
    its bytes its shape's, packed end to end from 0, MAX_STATE bytes at most.
    Raises RuntimeError starting with `who` for anything else (it came from
    another process)."""
    try:
        rows = json.loads(raw.decode())
        out, off = [], 0
        for flat, key, dtype, shape, offset, nbytes, sharded, device, slot in rows:
            d, shape = _DTYPES[dtype], tuple(shape)
            numel = 1
            for s in shape:
                numel *= s
            ok = all(isinstance(v, int) and v >= 0 for v in (flat, offset, nbytes, *shape))
            ok = ok and isinstance(slot, int) and slot >= -1
            if not (ok and isinstance(key, str) and isinstance(sharded, bool)) or offset != off:
                raise ValueError(f"entry {len(out)}")
            if nbytes != numel * d.itemsize:
                raise ValueError(f"entry {len(out)}: {nbytes} bytes for {shape} {dtype}")
            device = torch.device(device)
            out.append(Entry(flat, key, d, shape, offset, nbytes, sharded, device, slot))
            off += nbytes
            if off > MAX_STATE:
                raise ValueError(f"more than {MAX_STATE} bytes in all")
        return out
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise RuntimeError(f"{who} layout is malformed ({e}): {raw[:80]!r}") from None


class LayoutExchange:
    """The layouts of a state that differs from rank to rank, exchanged around
    the buddy ring: at each refresh this rank sends `buddy` a header (its
    layout's length in bytes, 0 where it is unchanged since the last commit,
    and its capacity) and then the layout where it changed, and receives
    `prev`'s likewise (point to point over `comm`).

    The capacity bounds the state bytes a rank may ever announce: its
    `capacity` (default: default_capacity of its layout at the first
    exchange), declared in its first header and the same in every later one.
    Anything a peer sends is checked before use; a refusal first revokes
    `comm` (the sender, waiting to send its state, raises at once instead of
    waiting out its timeout), then raises RuntimeError naming the peer rank
    and `what` (the operation); this rank's own state grown past its capacity
    raises ValueError likewise."""

    def __init__(
        self, comm: Communicator, buddy: int, prev: int, capacity: int | None, what: str
    ) -> None:
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0
        ):
            raise ValueError(f"{what}: rank {comm.rank}: capacity={capacity!r} must be an int >= 0")
        self.comm, self.buddy, self.prev, self.what = comm, buddy, prev, what
        self.capacity = capacity  # this rank's (set at the first exchange when None)
        self.peer_capacity: int | None = None  # prev's, from its first header

    def _refuse(self, error: type[Exception], why: str) -> Exception:
        """Revokes the communicator; the error to raise, naming this rank and `why`."""
        message = f"{self.what}: rank {self.comm.rank}: {why}"
        self.comm.revoke(message[:200])
        return error(message)

    def swap(self, entries: list[Entry], changed: bool, known: list[Entry]) -> list[Entry]:
        """Collective with the neighbours: tells the buddy `entries` (this
        rank's layout now; sent only where `changed`) and returns prev's
        (`known`, its layout at the last commit, where it did not change).
        Raises as the class says, and the communicator's errors."""
        size = packed_size(entries)
        if self.capacity is None:
            self.capacity = default_capacity(entries)
        if size > self.capacity:
            raise self._refuse(
                ValueError,
                f"this rank's state is {size} bytes, more than the capacity of {self.capacity} "
                "it declared at setup (pass a larger capacity=)",
            )
        meta = encode_entries(entries) if changed else b""
        mine = torch.tensor([len(meta), self.capacity], dtype=torch.int64)
        header = torch.empty(2, dtype=torch.int64)
        self.comm.batch_p2p([("send", mine, self.buddy), ("recv", header, self.prev)])
        k, cap = int(header[0]), int(header[1])
        first = self.peer_capacity is None
        if not 0 <= k <= MAX_LAYOUT or not 0 <= cap <= MAX_STATE:
            raise self._refuse(
                RuntimeError,
                f"rank {self.prev} announced a layout of {k} bytes and a capacity of {cap} "
                f"(at most {MAX_LAYOUT} and {MAX_STATE})",
            )
        if not first and cap != self.peer_capacity:
            raise self._refuse(
                RuntimeError,
                f"rank {self.prev} announced a capacity of {cap} bytes, not the "
                f"{self.peer_capacity} it declared at setup",
            )
        self.peer_capacity = cap
        raw = torch.empty(k, dtype=torch.uint8)
        ops = [("recv", raw, self.prev)] if k else []
        if meta:
            ops.append(("send", torch.frombuffer(bytearray(meta), dtype=torch.uint8), self.buddy))
        if ops:
            self.comm.batch_p2p(ops)
        theirs = known
        if k:
            prefix = f"{self.what}: rank {self.comm.rank}: "
            try:
                theirs = decode_entries(bytes(raw.numpy()), f"{prefix}rank {self.prev}'s")
            except RuntimeError as e:
                raise self._refuse(RuntimeError, str(e)[len(prefix) :]) from None
        if packed_size(theirs) > cap:
            raise self._refuse(
                RuntimeError,
                f"rank {self.prev} announced a layout of {packed_size(theirs)} bytes, more than "
                f"the {cap} its place holds (the capacity it declared at setup)",
            )
        return theirs
