"""A pipeline schedule as data: per rank, the list of actions it runs in order.

Communication is explicit. A rank's list holds its sends and receives beside
its compute, and a maximal run of consecutive sends and receives is one
*batch*: the runtime issues it as one `Communicator.batch_p2p` (torch's
`batch_isend_irecv`), whose operations progress together and which completes
when every one of them has. This is how 1F1B's steady state exchanges an
activation for a gradient between neighbours without deadlock when a send
blocks until its receive is posted: both ranks post the send and the receive
together (torch's `_batch_p2p(fwd_sends + bwd_recvs)`).

The step of an action is its index in its rank's list: the row of
`format_table`, the column of the CSV and what errors name.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .actions import COMPUTE, TORCH_BOOKKEEPING, Action, parse_action

__all__ = ["Op", "Schedule", "ScheduleError", "format_table"]


class Op(NamedTuple):
    """What a runtime executes at once: one compute action, or a batch of
    consecutive sends and receives. `step` is the index of its first action."""

    step: int
    actions: tuple[Action, ...]

    @property
    def is_batch(self) -> bool:
        """True for a batch of sends and receives."""
        return self.actions[0].is_comm


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of a pipeline of `p` ranks, `m` micro-batches and
    `v` stages (model chunks) per rank: `p * v` stages, stage `s` held by rank
    `stage_to_rank[s]` (interleaved: `s % p`).

    Equality compares everything but `name`. Raises ValueError on
    inconsistent sizes or a mapping that does not give every rank `v` stages.
    """

    p: int
    m: int
    v: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.p < 1 or self.m < 1 or self.v < 1:
            raise ValueError(f"Schedule: p={self.p}, m={self.m}, v={self.v} must all be >= 1")
        if len(self.actions) != self.p:
            raise ValueError(f"Schedule: {len(self.actions)} action lists for p={self.p} ranks")
        if len(self.stage_to_rank) != self.p * self.v:
            raise ValueError(
                f"Schedule: stage_to_rank has {len(self.stage_to_rank)} stages, "
                f"expected p * v = {self.p * self.v}"
            )
        for r in range(self.p):
            held = self.stages_of(r)
            if len(held) != self.v:
                raise ValueError(
                    f"Schedule: rank {r} holds stages {list(held)}, expected v={self.v} stages"
                )

    @property
    def num_stages(self) -> int:
        """p * v."""
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The rank holding `stage`."""
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def ops(self, rank: int) -> list[Op]:
        """`rank`'s list cut into what runs at once: each compute action alone,
        each maximal run of sends and receives as one batch."""
        out: list[Op] = []
        acts = self.actions[rank]
        comm = [a.kind not in COMPUTE for a in acts]
        i, n = 0, len(acts)
        while i < n:
            j = i + 1
            if comm[i]:
                while j < n and comm[j]:
                    j += 1
            out.append(Op(i, acts[i:j]))
            i = j
        return out

    def compute_only(self) -> Schedule:
        """The same schedule without its sends and receives (torch's
        "compute_only" format)."""
        return Schedule(
            self.p,
            self.m,
            self.v,
            self.stage_to_rank,
            [[a for a in acts if a.is_compute] for acts in self.actions],
            name=self.name,
        )

    def table(self, *, mark: tuple[int, int] | None = None) -> str:
        """`format_table(self, mark=mark)`."""
        return format_table(self, mark=mark)

    def __str__(self) -> str:
        return format_table(self)

    def to_csv(self) -> str:
        """torch's CSV: one row per rank, one action string per cell (what
        `_PipelineScheduleRuntime._dump_csv` writes)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for acts in self.actions:
            writer.writerow([str(a) for a in acts])
        return buf.getvalue()

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        p: int | None = None,
        m: int | None = None,
        name: str = "",
        ignore: Iterable[str] = TORCH_BOOKKEEPING,
    ) -> Schedule:
        """Reads torch's CSV (one row per rank; compute only or with sends and
        receives). Empty cells are skipped (torch's idle steps), as are torch's
        bookkeeping actions named in `ignore` (UNSHARD, RESHARD, REDUCE_GRAD);
        steps are then counted over the actions kept. The stage-to-rank mapping
        is inferred from which row runs each stage, and fills in the peers of
        sends and receives. `p` defaults to the number of rows, `m` to the
        largest micro-batch + 1, `v` is the stages over p.

        Raises ValueError naming the row and column of a bad cell, a stage run
        by two ranks, a stage run by none, or ranks holding unequal numbers of
        stages.
        """
        ignored = tuple(ignore)
        rows: list[list[Action]] = []
        for r, row in enumerate(csv.reader(io.StringIO(text))):
            acts = []
            for col, cell in enumerate(row):
                cell = cell.strip()
                if not cell or (cell.lstrip("0123456789") in ignored):
                    continue
                try:
                    acts.append(parse_action(cell))
                except ValueError as e:
                    raise ValueError(f"CSV row {r} (rank {r}), column {col}: {e}") from None
            rows.append(acts)
        p = len(rows) if p is None else p
        while len(rows) < p:
            rows.append([])
        owner: dict[int, int] = {}
        for r, acts in enumerate(rows):
            for step, a in enumerate(acts):
                if owner.setdefault(a.stage, r) != r:
                    raise ValueError(
                        f"CSV rank {r}, step {step}: {a} runs stage {a.stage}, "
                        f"which rank {owner[a.stage]} also runs"
                    )
        n_stages = max(owner, default=-1) + 1
        missing = [s for s in range(n_stages) if s not in owner]
        if missing or n_stages == 0 or n_stages % p:
            raise ValueError(
                f"CSV: stages {sorted(owner)} over {p} ranks: every stage 0..S-1 must be run "
                f"by some rank (missing {missing}) and S must be a multiple of p"
            )
        mapping = tuple(owner[s] for s in range(n_stages))
        m = max((a.microbatch for acts in rows for a in acts), default=0) + 1 if m is None else m
        filled = [[a if a.is_compute else _with_peer(a, mapping) for a in acts] for acts in rows]
        return cls(p, m, n_stages // p, mapping, filled, name=name)


def _with_peer(a: Action, mapping: Sequence[int]) -> Action:
    """`a` with its peer set to the rank holding its peer stage (left None if
    that stage does not exist, for verify to report)."""
    ps = a.peer_stage()
    peer = mapping[ps] if 0 <= ps < len(mapping) else None
    return Action(a.kind, a.stage, a.microbatch, peer)


class ScheduleError(ValueError):
    """A schedule that would deadlock or break a dependency. `rank`, `step`
    and `action` (None past the end of the list) say where."""

    def __init__(self, schedule: Schedule, rank: int, step: int, reason: str) -> None:
        acts = schedule.actions[rank]
        self.rank, self.step = rank, step
        self.action: Action | None = acts[step] if step < len(acts) else None
        self.reason = reason
        where = f"{self.action}" if self.action is not None else "end of list"
        n = max(len(a) for a in schedule.actions)
        rows = range(max(0, step - 4), min(n, step + 5))
        table = format_table(schedule, mark=(rank, step), rows=rows)
        name = f"{schedule.name}: " if schedule.name else ""
        super().__init__(f"{name}rank {rank}, step {step} ({where}): {reason}\n{table}")


def format_table(
    schedule: Schedule,
    *,
    mark: tuple[int, int] | None = None,
    rows: range | None = None,
) -> str:
    """A step x rank table of the action lists (as torch's
    `_format_pipeline_order`): one row per step, one column per rank, torch's
    action strings, a batch's actions on consecutive rows. `mark=(rank, step)`
    flags that cell with `<-` and its row with `<-- rank r`; `rows` limits the
    steps shown.
    """
    n = max((len(a) for a in schedule.actions), default=0)
    rows = range(n) if rows is None else rows
    width = len(str(max(n - 1, 0)))

    def cell(r: int, i: int) -> str:
        acts = schedule.actions[r]
        text = str(acts[i]) if i < len(acts) else ""
        return text + ("<-" if mark == (r, i) else "")

    cols = [max([len(f"Rank {r}")] + [len(cell(r, i)) for i in rows]) for r in range(schedule.p)]
    label = "Step " + " " * width
    head = " " * (len(label) + 2) + " ".join(f"Rank {r}".ljust(w) for r, w in enumerate(cols))
    lines = [head.rstrip()]
    for i in rows:
        row = " ".join(cell(r, i).ljust(w) for r, w in enumerate(cols))
        flag = f"  <-- rank {mark[0]}" if mark is not None and mark[1] == i else ""
        lines.append(f"Step {i:0{width}d}: {row}".rstrip() + flag)
    return "\n".join(lines) + "\n"
