"""The state a replacement receives under ElasticTrainer3D (replacement.py;
docs/recovery.md, "Tensor and pipeline parallel grids"): what a rank's buddy
copy holds in each of Trainer3D's dp modes (state_tensors), which rank sends
a newcomer its place's copy (sources), the transfer, the checks that every
rank restores alike, and the load into a new Trainer3D.
"""

from __future__ import annotations

import torch

from ..data_parallel.redundancy import BuddyCopy
from ..data_parallel.state_layout import (
    MAX_LAYOUT,
    MAX_STATE,
    Entry,
    StateTensor,
    decode_entries,
    encode_entries,
)
from ..parallel_dims import ParallelDims
from .trainer import Trainer3D, TrainOptions

__all__ = [
    "ReplacementFailed",
    "check_alike",
    "load",
    "placement",
    "recovered",
    "sources",
    "state_tensors",
    "transfer",
]


class ReplacementFailed(RuntimeError):
    """A recovery of ElasticTrainer3D failed (every survivor raises it, the
    cause chained): the newcomers did not come in time, one died while the
    grid was rebuilt or the state moved, or this rank was fenced out; or a
    lost rank's state is lost (sources(): every rank raises it, the
    newcomers too). `failed`: the world ranks being replaced."""

    def __init__(self, message: str, failed: tuple[int, ...]) -> None:
        super().__init__(message)
        self.failed = failed


def recovered(opts: TrainOptions) -> str:
    """What a newcomer receives under `opts` (for progress lines)."""
    if opts.fsdp:
        return "its FSDP shard (parameters and AdamW state)"
    if opts.zero:
        return f"its ZeRO-{opts.zero} shard (parameters and AdamW state)"
    return "its stage shard and AdamW state"


def _optimized(trainer: Trainer3D) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what the optimizer steps, in its param_groups' order:
    the parameters (zero=0; FSDP: their pieces of the shards) or ZeRO's flat
    master shards."""
    names = {id(p): n for n, p in trainer.named_params}
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    return [(names.get(id(p), f"optimizer parameter {i}"), p) for i, p in enumerate(params)]


def state_tensors(trainer: Trainer3D) -> list[StateTensor]:
    """(index, key, tensor, sharded) of this rank's training state: each of
    its dp mode's masters (key "param", indexed in Trainer3D.dp.masters(): the
    parameters with zero=0, the master shards with --zero/--fsdp), then each
    optimized tensor's AdamW state (indexed in the optimizer's parameters).
    `sharded`: whether the mode shards it over dp (not a scalar such as
    AdamW's step). Raises TypeError for
    optimizer state that is not a tensor."""
    sharded = bool(trainer.opts.zero or trainer.opts.fsdp)
    out: list[StateTensor] = [
        (i, "param", t, sharded) for i, (_, t) in enumerate(trainer.dp.masters())
    ]
    for i, (name, p) in enumerate(_optimized(trainer)):
        state = trainer.optimizer.state.get(p, {})
        for key in sorted(state):
            if not isinstance(state[key], torch.Tensor):
                raise TypeError(
                    f"ElasticTrainer3D: rank {trainer.dims.world.rank}: optimizer state {key!r} "
                    f"of {name} is a {type(state[key]).__name__}, not a tensor"
                )
            out.append((i, key, state[key], sharded and state[key].dim() > 0))
    return out


def sources(
    dims: ParallelDims,
    buddies: list[int] | None = None,
    sharded: bool = False,
    replaced: tuple[int, ...] | None = None,
) -> dict[int, tuple[int, str]]:
    """For each replaced world rank (`replaced`, default dims.replaced: the
    survivors check with the failed ranks before they grow), the rank that
    sends it its state and which copy: its buddy's ("remote", rank
    buddies[r], default r + 1), else, unless the state is `sharded` over dp
    (--zero, --fsdp: no replica holds it), a surviving data-parallel
    replica's own ("local"), else the copy that a lost replica's surviving
    buddy holds ("remote": the replicas' states are the same). The same on
    every rank.

    Raises ReplacementFailed (the replaced ranks its `failed`) naming each
    lost rank and its buddy where neither survived (nor, unsharded, a
    replica): the state is lost."""
    replaced = dims.replaced if replaced is None else replaced
    n, gone = dims.world.world_size, set(replaced)
    buddies = buddies or [(r + 1) % n for r in range(n)]
    out, lost = {}, []
    for r in replaced:
        group = [q for q in dims.group_of(r, "dp") if q != r]
        replicas = [q for q in group if q not in gone]
        # A lost replica's buddy holds that replica's state: the same as r's (unsharded)
        held = [buddies[q] for q in group if q in gone and buddies[q] not in gone]
        if buddies[r] not in gone:
            out[r] = (buddies[r], "remote")
        elif replicas and not sharded:
            out[r] = (replicas[0], "local")
        elif held and not sharded:
            out[r] = (held[0], "remote")
        else:
            lost.append(r)
    if lost:
        why = (
            "failed with it, and no other rank holds its shard of the training state "
            "(sharded over dp)"
            if sharded
            else "and every data-parallel replica failed with it, with their buddies"
            if dims.sizes["dp"] > 1
            else "failed with it, and no other rank holds its state (dp=1: no replica)"
        )
        raise ReplacementFailed(
            f"ElasticTrainer3D: rank {dims.world.rank}: "
            + "; ".join(
                f"the state of {dims.where(r)} is lost: its buddy {dims.where(buddies[r])} {why}"
                for r in lost
            )
            + "; restart from a checkpoint",
            tuple(replaced),
        )
    return out


def placement(dims: ParallelDims, copy: BuddyCopy | None) -> list[int] | None:
    """Collective over dims.world where ranks were replaced (else None): each
    world rank's buddy in the copies the survivors hold (placed on the old
    world's hosts), sent by the lowest surviving rank to every rank. Checked:
    a newcomer has none of its own. Raises RuntimeError for anything but a
    placement of the world's ranks."""
    if not dims.replaced:
        return None
    world, n = dims.world, dims.world.world_size
    root = min(r for r in range(n) if r not in dims.replaced)
    mine = copy.buddies if copy is not None and world.rank == root else [0] * n
    got = torch.tensor(mine, dtype=torch.int64)
    world.broadcast(got, root)
    buddies = got.tolist()
    if copy is not None and buddies != copy.buddies:  # a survivor: its copies' placement
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: world rank {root} placed the copies on "
            f"{buddies[:16]}, this rank on {copy.buddies[:16]}"
        )
    if sorted(buddies) != list(range(n)) or any(b == r for r, b in enumerate(buddies)):
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: world rank {root} sent the buddies "
            f"{buddies[:16]}, not a placement of {n} ranks"
        )
    return buddies


def transfer(
    dims: ParallelDims, copy: BuddyCopy | None, plan: dict[int, tuple[int, str]]
) -> tuple[int, list[Entry], torch.Tensor] | None:
    """Point to point over dims.world: each source (`plan`, as sources()
    gives it) sends its newcomer the copy's step, layout and bytes. Returns
    them on a newcomer (checked: they came from another process), None
    elsewhere."""
    world, me = dims.world, dims.world.rank
    header = torch.zeros(3, dtype=torch.int64)
    first: list[tuple[str, torch.Tensor, int]] = []
    second: list[tuple[str, torch.Tensor, int]] = []
    for r, (src, which) in plan.items():
        if me == src:
            assert copy is not None, "a source without a copy"
            buf, entries = (
                (copy.remote, copy.remote_entries)
                if which == "remote"
                else (copy.local, copy.entries)
            )
            meta = torch.frombuffer(bytearray(encode_entries(entries)), dtype=torch.uint8)
            first.append(("send", torch.tensor([copy.step, meta.numel(), buf.numel()]), r))
            second += [("send", meta, r)] + ([("send", buf, r)] if buf.numel() else [])
        elif me == r:
            first.append(("recv", header, src))
    if first:
        world.batch_p2p(first)
    if me not in plan:
        if second:
            world.batch_p2p(second)
        return None
    step, k, nbytes = (int(v) for v in header)
    who = f"ElasticTrainer3D: rank {me}: world rank {plan[me][0]}'s"
    if step < 0 or not 0 < k <= MAX_LAYOUT or not 0 <= nbytes <= MAX_STATE:
        raise RuntimeError(f"{who} header is malformed: step {step}, {k} + {nbytes} bytes")
    raw, data = torch.empty(k, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    world.batch_p2p(
        [("recv", raw, plan[me][0])] + ([("recv", data, plan[me][0])] if nbytes else [])
    )
    entries = decode_entries(bytes(raw.numpy()), who)
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    if end != nbytes:
        raise RuntimeError(f"{who} layout holds {end} bytes, its state {nbytes}")
    return step, entries, data


def check_alike(dims: ParallelDims, step: int, copy_every: int) -> None:
    """Collective: every rank restores the same step with the same copy_every."""
    world = dims.world
    every = torch.empty(world.world_size * 2, dtype=torch.int64)
    world.all_gather(every, torch.tensor([step, copy_every]))
    rows = every.view(world.world_size, 2).tolist()
    if any(r[1] != rows[0][1] for r in rows):
        raise ValueError(
            f"ElasticTrainer3D: rank {world.rank}: the ranks' copy_every differ: "
            + ", ".join(f"rank {q}: {r[1]}" for q, r in enumerate(rows))
        )
    if any(r[0] != rows[0][0] for r in rows):
        raise RuntimeError(
            f"ElasticTrainer3D: rank {world.rank}: the ranks' copies hold different steps: "
            + ", ".join(f"rank {q}: {r[0]}" for q, r in enumerate(rows))
        )


def load(trainer: Trainer3D, entries: list[Entry], data: torch.Tensor, who: str) -> None:
    """Loads a copy (state_tensors' layout) into the trainer's masters (its
    dp mode's: parameters or master shards) and AdamW state. Local: the
    caller then calls trainer.dp.restored() on every rank. Raises
    RuntimeError where the copy does not fit the model and its layout."""
    masters, optimized = trainer.dp.masters(), _optimized(trainer)
    state: dict[int, dict[str, torch.Tensor]] = {}
    loaded = set()
    for e in entries:
        table = masters if e.key == "param" else optimized
        if not 0 <= e.flat < len(table):
            what = "tensor" if e.key == "param" else f"{e.key!r} of optimized tensor"
            raise RuntimeError(f"{who}: the copy names {what} {e.flat} of {len(table)}")
        name, p = table[e.flat]
        # A copy of the bytes: the offsets need not suit the dtype's alignment.
        t = data[e.offset : e.offset + e.nbytes].clone().view(e.dtype).view(e.shape)
        if e.key == "param":
            fits = e.shape == tuple(p.shape) and e.dtype == p.dtype
        else:  # elementwise state in the tensor's shape; scalars (AdamW's step) any dtype
            fits = t.dim() == 0 or (e.shape == tuple(p.shape) and e.dtype == p.dtype)
        if not fits:
            raise RuntimeError(
                f"{who}: the copy's {name} ({e.key}) is {e.dtype} {list(e.shape)}, the model's "
                f"{p.dtype} {list(p.shape)}: the copy is of another model or layout"
            )
        if e.key != "param":
            # AdamW's step count stays on the host; the moments go where the parameter is.
            state.setdefault(e.flat, {})[e.key] = t if e.device.type == "cpu" else t.to(p.device)
            continue
        with torch.no_grad():
            p.copy_(t)
        loaded.add(e.flat)
    if len(loaded) != len(masters):
        missing = [masters[i][0] for i in range(len(masters)) if i not in loaded]
        raise RuntimeError(f"{who}: the copy lacks {missing[:4]}")
    trainer.optimizer.state.clear()
    for i, st in state.items():
        trainer.optimizer.state[optimized[i][1]] = st
