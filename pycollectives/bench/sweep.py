"""The timing loop of a rank process: one :class:`_Sweep` per backend measures a collective size by
size and trial by trial (``-w`` warmup calls, ``--trials`` trials of ``-n`` calls, the median of
the slowest rank's time, the ``-c 1`` check), and :func:`bench_collective` runs the sweeps one
after the other or, with ``--interleave 1``, in rounds."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pycollectives.bench.check import count_wrong, expected_result, fill_check_inputs
from pycollectives.bench.report import Row, column_header, footer, format_row
from pycollectives.bench.runners import Runner
from pycollectives.bench.specs import DTYPES, CollSpec, counts_for, size_list, torch_dtype


def time_trial(
    runner: Runner, fn: Callable[[], None], iters: int, sync: Callable[[], None] | None = None
) -> float:
    """One trial: a barrier, then `iters` calls timed together. Returns this rank's seconds per
    call. `sync` (CUDA: torch.cuda.synchronize) runs before the barrier and before the stop."""
    if sync:
        sync()
    runner.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - t0) / iters


@dataclass
class _Point:
    """One size of a sweep between its prepare and its finish: the row, the buffers and bound
    call (None when the backend cannot run it) and this rank's seconds per call of each trial."""

    row: Row
    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None
    fn: Callable[[], None] | None = None
    per_iter: list[float] = field(default_factory=list)


class _Sweep:
    """One collective on one backend, measured size by size and trial by trial, so that backends
    can take turns (--interleave): prepare(count, size) makes a size's row, buffers and bound call,
    trial(size) times one trial of it, finish(size) records its median (and -c 1 check) and frees
    its buffers. Every rank makes the same calls in the same order (they run collectives)."""

    def __init__(
        self, runner: Runner, spec: CollSpec, args: argparse.Namespace, rewarm: int = 0
    ) -> None:
        self.runner, self.spec, self.args = runner, spec, args
        self.rewarm = rewarm  # warmup calls before each trial of a size after its first
        self.dname, self.tname = DTYPES[args.datatype]
        self.tdtype = torch_dtype(args.datatype)
        self.device = getattr(args, "cuda_device", None)  # "cuda:i", set by rank_main
        self.sync = torch.cuda.synchronize if self.device is not None else None
        self.reason = runner.unsupported(spec, self.dname, args.op)
        self.points: dict[int, _Point] = {}  # size -> prepared and not yet finished
        self.rows: list[Row] = []  # in the order prepared
        self.lines = [f"# Collective: {spec.name}  backend: {runner.name}\n{column_header(spec)}"]
        self._noted = ""  # the note of the last finished row (a repeated note is not printed)

    def prepare(self, count: int, size: int) -> None:
        """Makes the row of one size and, unless the backend cannot run it, its buffers (holding
        the check inputs) and bound call. The sweep's first size probes the first call where the
        runner asks for it: an error there becomes the reason of every row."""
        runner, spec, args = self.runner, self.spec, self.args
        n, op, root = runner.world_size, args.op, args.root
        row = Row(
            backend=runner.name, collective=spec.name, nranks=n, size=size, count=count,
            dtype=self.dname, op=op if spec.reduces else "none", root=root if spec.rooted else -1,
            time_us=None, algbw=None, busbw=None, wrong=None, note=self.reason or "",
        )  # fmt: skip
        point = self.points[size] = _Point(row)
        first = not self.rows
        self.rows.append(row)
        if self.reason is not None:
            return
        inp, out = runner.buffers(spec, count, self.tdtype, self.device)
        fill_check_inputs(spec, runner.rank, n, count, op, root, inp, out)
        fn = runner.bind(spec.name, inp, out, op, root)
        if runner.probe_first_call and first:
            try:
                fn()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                self.reason = f"{runner.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                row.note = self.reason
                return
        point.inp, point.out, point.fn = inp, out, fn

    def trial(self, size: int) -> None:
        """Times one trial of a prepared size (nothing if the backend cannot run it): `-w` warmup
        calls before its first trial, `rewarm` before each later one."""
        point = self.points[size]
        if point.fn is None:
            return
        for _ in range(self.rewarm if point.per_iter else self.args.warmup_iters):
            point.fn()
        before = self.runner.paths(self.spec.name)
        point.per_iter.append(time_trial(self.runner, point.fn, self.args.iters, self.sync))
        for path, calls in self.runner.paths(self.spec.name).items():
            if calls > before.get(path, 0):
                point.row.paths[path] = point.row.paths.get(path, 0) + calls - before.get(path, 0)

    def finish(self, size: int) -> str:
        """Records a size once its trials are done: per trial the slowest rank's time per call,
        their median, bandwidths and with -c 1 the wrong elements of one fresh call. Frees the
        size's buffers; returns its table line."""
        point = self.points.pop(size)
        row = point.row
        if point.fn is not None:
            row.trials_us = [t * 1e6 for t in self.runner.max_over_ranks(point.per_iter)]
            row.time_us = statistics.median(row.trials_us)
            row.algbw = size / row.time_us / 1e3 if row.time_us > 0 else 0.0  # GB/s
            row.busbw = row.algbw * self.spec.busbw_factor(row.nranks)
            if self.args.check:
                row.wrong = self._check(point)
        line = format_row(row, self.tname)
        if row.time_us is None and row.note and row.note != self._noted:
            line += f"   # {row.note}"
        self._noted = row.note
        self.lines.append(line)
        return line

    def _check(self, point: _Point) -> int:
        """Wrong elements, summed over ranks, of one call on fresh check inputs."""
        runner, spec, args, row = self.runner, self.spec, self.args, point.row
        rank, n, count, op, root = runner.rank, runner.world_size, row.count, args.op, args.root
        fill_check_inputs(spec, rank, n, count, op, root, point.inp, point.out)
        point.fn()
        want = expected_result(spec, rank, n, count, op, root, self.tdtype,
                               check_nonroot=runner.check_nonroot_reduce)  # fmt: skip
        result = point.out if point.out is not None else point.inp
        return runner.sum_over_ranks(count_wrong(result, want))


def bench_collective(
    runners: Sequence[Runner], spec: CollSpec, args: argparse.Namespace, say: Callable[[str], None]
) -> list[Row]:
    """Benchmark one collective over all sizes on every runner: one runner after the other (all
    trials of a size back to back), each row printed as it is measured, or with --interleave 1
    in `--trials` rounds, each of which runs one trial of every runner at every size (the same
    tables, printed once the collective is done; with one runner too: a size's trials then
    spread over the whole sweep, not a few milliseconds of it)."""
    interleave = bool(args.interleave)
    sweeps = [_Sweep(r, spec, args, rewarm=1 if interleave else 0) for r in runners]
    elsize = torch.empty(0, dtype=sweeps[0].tdtype).element_size()
    sizes: dict[int, int] = {}  # size -> count, in order
    for nbytes in size_list(args.minbytes, args.maxbytes, args.stepfactor):
        count, size = counts_for(spec, nbytes, elsize, runners[0].world_size)
        if count > 0:  # else too small for one element per rank; duplicates after rounding merge
            sizes.setdefault(size, count)
    if interleave:
        _interleaved(sweeps, sizes, args.trials)
        for sweep in sweeps:
            say("\n".join(sweep.lines))
            say(footer(sweep.rows))
    else:
        for sweep in sweeps:  # one backend after the other, each row printed as it is measured
            say(sweep.lines[0])
            for size, count in sizes.items():
                sweep.prepare(count, size)
                for _ in range(args.trials):
                    sweep.trial(size)
                say(sweep.finish(size))
            say(footer(sweep.rows))
    return [row for sweep in sweeps for row in sweep.rows]


def _interleaved(sweeps: Sequence[_Sweep], sizes: dict[int, int], trials: int) -> None:
    """`trials` rounds over every size (size -> count), one trial of every sweep at each: a
    slowdown of the machine then spoils one trial of a size, which the median rejects, rather
    than all of them. Buffers are made in the first round and freed after the last trial."""
    for rnd in range(trials):
        for size, count in sizes.items():
            for sweep in sweeps:
                if rnd == 0:
                    sweep.prepare(count, size)
                sweep.trial(size)
                if rnd == trials - 1:
                    sweep.finish(size)
