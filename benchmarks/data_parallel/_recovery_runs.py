"""Helpers of recovery_vs_restart.py: the model sizes, the kill, the ranks'
memory, and the in-place run of `--strategy zero2` (ElasticZero, stage 2,
buddy copies refreshed every `--refresh` steps) and its phases.

In place under ZeRO-2, from the kill to the slowest survivor's commit of the
lost step: detect (to its failing agree()), agree, shrink, rebuild (the
unwrap, the check that the survivors committed alike, then: gather, the full
state as of the last committed copy on every survivor, the dead rank's shards
from its buddy's copy, gather_full_state; reshard, the model given the full
values and a new ZeroOptimizer over the survivors loading its shard of them;
copy, the first buddy refresh of the re-sharded state, the recovery point;
then the agreement that the rebuild succeeded everywhere and the old
communicator closed), the steps redone since the copy (none with --refresh 1)
and the lost step. `refresh`: one refresh (the send of this rank's shard state
to its buddy and the receive of its predecessor's) plus its commit (the copy
of this rank's own state), per refresh, on the steps before the kill.

Memory (MiB, each rank's RssAnon; the largest over the survivors): built
(ElasticZero made), steady (before the step of the kill), assemble (inside
gather_full_state once it assembled what it returns, before it frees what it
gathered: every survivor's copy besides, where it gathers them all at once),
gather (after it: what it returned), reshard (after the new ZeroOptimizer and its copy), end; with
the ZeroOptimizer's storage by role and the buddy copy's bytes at steady;
`*_total` RssAnon + RssShmem at each point from steady on (the largest over
the survivors), and peak_over_steady the survivors' largest VmHWM from
steady (reset there) to the end above their VmRSS at steady: the true peak
of the recovery and the retried step, between the points too; step_peak
the same of the step before (k - 1): what any step adds (activations,
gradients), for comparison.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

SIZES = {"10M": (256, 12), "50M": (512, 16), "100M": (768, 14), "200M": (1024, 16)}
VOCAB, SEQ, BATCH, HEADS, LR = 64, 16, 8, 8, 3e-4


def config(size: str):  # noqa: ANN201
    """The reference GPT's config of `size` (a key of SIZES)."""
    from pycollectives.strategies.models import GPTConfig

    d, layers = SIZES[size]
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=layers, n_head=HEADS, d_model=d)


def write(out: str, name: str, rec: dict) -> None:
    """Writes `rec` as JSON to out/name."""
    Path(out, name).write_text(json.dumps(rec))


def mem() -> dict[str, float]:
    """This process's memory now (MiB, /proc/self/status): anon (RssAnon:
    its own pages, what the ranks add up to), shmem (RssShmem: the shared
    memory it touched, its own windows and the peers' it read: ZeRO-1/2's
    full flat parameters and reduce windows live there), rss (VmRSS, every
    page mapped) and hwm (VmHWM, the peak of rss)."""
    keys = {"RssAnon": "anon", "RssShmem": "shmem", "VmRSS": "rss", "VmHWM": "hwm"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            out[keys[key]] = round(int(value.split()[0]) / 1024, 1)
    return out


def reset_peak() -> None:
    """Resets VmHWM to the current VmRSS (Linux: 5 to /proc/self/clear_refs);
    nothing where the kernel refuses it."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def die_in_backward(blocks: Any, out: str, when: Any) -> None:
    """SIGKILL this process in the backward when `when()` holds, after writing the instant."""
    import torch

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when():
            write(out, "kill.json", {"t": time.monotonic()})
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    list(blocks[-1].parameters())[-1].register_hook(hook)


def own_session() -> None:
    """Puts this rank in a session of its own, as torchrun starts each of its
    workers (start_new_session=True). With the kernel's autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) each session is one CPU share:
    spawn's ranks, all in the launcher's session, otherwise share one where
    the restart's workers get one each, and under other jobs' load the
    in-place steps ran 1.1-2.4x slower than the same code in sessions of
    their own (10M, 4 ranks, load 6)."""
    os.setsid()


def _timed(marks: dict, name: str, fn: Any, after: Any = None) -> Any:
    """fn, recording its last call's (start, end) in marks[name], and `after()`'s
    value in marks[name + "_mem"] when given."""

    def call(*a: Any, **kw: Any) -> Any:
        t = time.monotonic()
        got = fn(*a, **kw)
        marks[name] = (t, time.monotonic())
        if after is not None:
            marks[name + "_mem"] = after()
        return got

    return call


def inplace_zero_rank(size: str, k: int, refresh: int, out: str) -> None:
    """One rank of the in-place ZeRO-2 run (started by spawn): ElasticZero,
    buddy copies refreshed every `refresh` steps; the last rank dies in the
    backward of step k."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
    from pycollectives.strategies.data_parallel import ElasticZero, full_state, redundancy
    from pycollectives.strategies.models.gpt import GPT

    own_session()
    torch.set_num_threads(1)
    comm = pc.init(timeout=120)
    rank, n, marks, copies = comm.rank, comm.world_size, {}, []
    model = GPT(config(size))
    ez = ElasticZero(model, torch.optim.AdamW, comm, 2, copy_every=refresh, lr=LR)
    marks["built_mem"] = mem()
    cls = redundancy.BuddyCopy
    refresh_fn, commit_fn = cls.refresh, cls.commit

    def timed_refresh(self: Any) -> None:
        t = time.monotonic()
        refresh_fn(self)
        copies.append([ez.steps, t, time.monotonic() - t, 0.0])

    def timed_commit(self: Any, step: int) -> None:
        t = time.monotonic()
        commit_fn(self, step)
        if copies:
            copies[-1][3] = time.monotonic() - t

    cls.refresh, cls.commit = timed_refresh, timed_commit  # this worker process only
    for name in ("assemble", "_gather_kept"):  # the end of gather_full_state, before it frees
        setattr(full_state, name, _at_end(marks, getattr(full_state, name)))
    comm.agree = _failing_agree(marks, comm.agree)
    comm.shrink = _timed(marks, "shrink", comm.shrink)
    ez.rebuild = _timed(marks, "gather", ez.rebuild, mem)
    ez.wrap = _timed(marks, "reshard", ez.wrap, mem)
    ez._stage = _timed(marks, "copy", ez._stage)  # noqa: SLF001
    data = SyntheticSequences(VOCAB, SEQ, 4096)
    batches = GlobalBatches(4096, BATCH)
    ends = []

    def loss_fn(m: Any, r: int, size_: int) -> torch.Tensor:
        ids = batches.global_ids(ez.steps)
        x, y = data.batch(ids[r * BATCH // size_ : (r + 1) * BATCH // size_])
        return m(x, y) * (len(x) * size_ / BATCH)

    if rank == n - 1:
        die_in_backward(model.blocks, out, lambda: ez.steps == k)
    while ez.steps <= k:
        s, t = ez.steps, time.monotonic()
        if s == k - 1 and "step_start_mem" not in marks:  # a step's own peak, for comparison
            reset_peak()
            marks["step_start_mem"] = mem()
        if s == k and "steady_mem" not in marks:
            if "step_start_mem" in marks:
                marks["step_end_mem"] = mem()
            marks["steady_mem"] = mem()
            reset_peak()  # end_mem's hwm: the peak from here (the recovery, the retried step)
            marks["storage"] = {**ez.zero.storage(), "buddy_copy": ez.copy.nbytes}
        if ez.step(loss_fn):
            ends.append((s, t, time.monotonic()))
        else:
            marks["dropped"] = time.monotonic()
            marks["rolled_back_to"] = ez.steps
    marks["end_mem"] = mem()
    rec = {"marks": marks, "steps": ends, "copies": copies, "left": ez.world_size}
    write(out, f"inplace-{rank}.json", rec)
    ez.comm.close()


def _at_end(marks: dict, fn: Any) -> Any:
    """fn, recording mem() as marks["assemble_mem"] when it returns."""

    def call(*a: Any, **kw: Any) -> Any:
        got = fn(*a, **kw)
        marks["assemble_mem"] = mem()
        return got

    return call


def _failing_agree(marks: dict, agree: Any) -> Any:
    """comm.agree, recording the first call that fails or agrees False as marks["agree"]."""

    def call(*a: Any, **kw: Any) -> Any:
        t = time.monotonic()
        got = agree(*a, **kw)
        if got.failed or not got.value:
            marks.setdefault("agree", (t, time.monotonic()))
        return got

    return call


def inplace_zero_summary(ranks: list[dict], kill: float) -> dict[str, Any]:
    """The slowest survivor's phases (seconds) of an in-place ZeRO-2 run, the
    refresh's cost before the kill, and the ranks' memory (MiB: the largest
    over the survivors at each point, and their sum at the rebuild's peak)."""
    slow = max(ranks, key=lambda r: r["steps"][-1][2])
    m, steps = slow["marks"], slow["steps"]
    (a0, a1), (s0, s1) = m["agree"], m["shrink"]
    (g0, g1), (w0, w1), (c0, c1) = m["gather"], m["reshard"], m["copy"]
    dropped, back = m["dropped"], m["rolled_back_to"]
    after = [e for e in steps if e[1] >= dropped]
    redone = after[:-1]
    redo_end = redone[-1][2] if redone else dropped
    before = [e for e in steps if e[2] < dropped][1:]  # the first step is a warm-up
    copies = [c for c in slow["copies"] if c[0] > 0 and c[1] < a0]  # before the failure
    keys = ("built_mem", "steady_mem", "assemble_mem", "gather_mem", "reshard_mem", "end_mem")
    memory = {key[:-4]: max(r["marks"][key]["anon"] for r in ranks) for key in keys}
    memory["assemble_sum"] = sum(r["marks"]["assemble_mem"]["anon"] for r in ranks)
    memory["hwm"] = max(r["marks"]["end_mem"]["hwm"] for r in ranks)
    memory["steady_shmem"] = max(r["marks"]["steady_mem"]["shmem"] for r in ranks)
    for key in keys[1:]:  # anon + shmem: ZeRO-1/2's flat parameters are shared memory
        memory[key[:-4] + "_total"] = max(
            r["marks"][key]["anon"] + r["marks"][key]["shmem"] for r in ranks
        )
    # the peak RSS from steady (VmHWM reset there) above steady's RSS, per survivor
    memory["peak_over_steady"] = max(
        r["marks"]["end_mem"]["hwm"] - r["marks"]["steady_mem"]["rss"] for r in ranks
    )
    if all("step_end_mem" in r["marks"] for r in ranks):  # a step's peak over its start, k-1's
        memory["step_peak"] = max(
            r["marks"]["step_end_mem"]["hwm"] - r["marks"]["step_start_mem"]["rss"] for r in ranks
        )
    memory["storage"] = {k: round(v / 2**20, 1) for k, v in slow["marks"]["storage"].items()}
    return {
        "detect": a0 - kill, "agree": a1 - a0, "shrink": s1 - s0,
        "rebuild": (s0 - a1) + (dropped - s1), "gather": g1 - g0,
        "reshard": (w1 - w0) - (c1 - c0), "copy": c1 - c0,
        "redo": redo_end - dropped, "redone": len(redone), "rolled_back_to": back,
        "retry": after[-1][2] - redo_end, "total": after[-1][2] - kill,
        "step": statistics.median(e[2] - e[1] for e in before),
        "refresh": statistics.median(c[2] + c[3] for c in copies) if copies else 0.0,
        "mem": memory,
    }  # fmt: skip
