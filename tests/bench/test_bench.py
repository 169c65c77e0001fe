"""End-to-end checks of the benchmark CLI (python -m pycollectives.bench), run as subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import paths
import pytest

pytest.importorskip("pycollectives", reason="pycollectives (and its extension) cannot be imported")

from pycollectives.bench.cli import build_parser  # noqa: E402
from pycollectives.bench.runners import Runner  # noqa: E402
from pycollectives.bench.specs import COLLECTIVES, SPECS  # noqa: E402
from pycollectives.bench.sweep import bench_collective  # noqa: E402

ROOT = str(paths.ROOT)
COLUMNS = "#       size         count      type   redop    root     time   algbw   busbw #wrong"
TIMEOUT = 120


def run_bench(*flags: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run the benchmark with these flags; fails the test on a timeout."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # never let the benchmark think it runs under torchrun
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pycollectives.bench", *flags, "--timeout", str(timeout - 10)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def parse_tables(stdout: str) -> dict[tuple[str, str], list[list[str]]]:
    """{(backend, collective): [row fields]} from the nccl-tests style tables."""
    tables: dict[tuple[str, str], list[list[str]]] = {}
    current = None
    for line in stdout.splitlines():
        m = re.match(r"# Collective: (\w+)\s+backend: (\w+)", line)
        if m:
            current = (m.group(2), m.group(1))
            tables[current] = []
        elif line.startswith("#") or not line.strip():
            if line.startswith("# Comparison"):
                current = None
        elif current is not None:
            tables[current].append(line.split())
    return tables


def test_bench_all_collectives(tmp_path):
    out_json = tmp_path / "bench.json"
    p = run_bench(
        "--nproc",
        "2",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "--trials",
        "1",
        "--coll",
        "all",
        "--json",
        str(out_json),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# pycollectives-bench" in p.stdout and "simd_level" in p.stdout
    assert COLUMNS in p.stdout
    tables = parse_tables(p.stdout)
    printed = 0
    for coll in COLLECTIVES:
        rows = tables.get(("pycoll", coll))
        assert rows, f"no rows for {coll}:\n{p.stdout}"
        for fields in rows:
            assert len(fields) == 9, fields
            assert fields[-1] == "0", f"{coll}: wrong values in {fields}"
            float(fields[5]), float(fields[6]), float(fields[7])  # time, algbw, busbw are numbers
        printed += len(rows)
    assert p.stdout.count("# Avg bus bandwidth    :") == len(COLLECTIVES)
    assert p.stdout.count("# Out of bounds values : 0 OK") == len(COLLECTIVES)

    data = json.loads(out_json.read_text())
    assert data["metadata"]["hostname"] and data["metadata"]["cpu_model"]
    assert len(data["rows"]) == printed
    for r in data["rows"]:
        assert r["backend"] == "pycoll" and r["nranks"] == 2 and r["wrong"] == 0
        assert r["time_us"] > 0 and r["busbw"] >= 0
    assert {r["collective"] for r in data["rows"]} == set(COLLECTIVES)
    if len(os.sched_getaffinity(0)) >= 2:  # the launcher timed two CPUs before and after
        trip = data["metadata"]["cpu_round_trip_ns"]
        assert len(trip["cpus"]) == 2 and 0 < trip["before"] < 1e6 and 0 < trip["after"] < 1e6
        assert "# Cache-line round trip CPU" in p.stdout
    _check_binding(p.stdout, "auto", backends=1)  # --bind auto is the default


def _check_binding(stdout: str, bind: str, backends: int) -> None:
    """Each backend's header of a 2-rank run lists rank r's CPUs as --bind `bind` pins them."""
    cpus = sorted(os.sched_getaffinity(0))
    got = re.findall(r"#\s+Rank\s+(\d+) Pid\s+\d+ on \S+ cpus (\S+)", stdout)
    if bind == "auto" and len(cpus) >= 2:  # one CPU each, as mpirun binds 2 ranks to cores
        want = [("0", str(cpus[0])), ("1", str(cpus[1]))]
    else:
        want = [(r, ",".join(map(str, cpus))) for r in ("0", "1")]
    assert got == want * backends, (bind, stdout)


def test_cpu_round_trip_probe():
    from pycollectives import _C, PyCollectivesError

    cpus = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="two different CPUs, not 0 and 0"):
        _C.cpu_round_trip_ns(0, 0)
    with pytest.raises(ValueError, match="round_trips must be >= 5, not 4"):
        _C.cpu_round_trip_ns(0, 1, 4)
    with pytest.raises(PyCollectivesError, match="pthread_setaffinity_np"):
        _C.cpu_round_trip_ns(cpus[0], max(cpus) + 1)  # a CPU this process may not use
    if len(cpus) >= 2:
        assert 0 < _C.cpu_round_trip_ns(cpus[0], cpus[1], 1000) < 1e6


def test_bench_goes_on_when_the_round_trip_probe_fails(monkeypatch, capsys):
    from pycollectives import _C, PyCollectivesError
    from pycollectives.bench.meta import cpu_round_trip

    def refuse(a: int, b: int) -> float:
        raise PyCollectivesError("pycollectives: cpu_round_trip_ns: CPU 1 did not answer")

    monkeypatch.setattr(_C, "cpu_round_trip_ns", refuse)
    assert cpu_round_trip() is None
    if len(os.sched_getaffinity(0)) >= 2:
        assert (
            "round trip not measured: pycollectives: cpu_round_trip_ns" in capsys.readouterr().err
        )


def test_bench_registered_buffers(tmp_path):
    """-R 1: pycollectives' buffers are alloc_shared windows; every collective still
    checks out, and the JSON metadata says which buffers were used."""
    out_json = tmp_path / "bench.json"
    p = run_bench("--nproc", "3", "-b", "8", "-e", "1M", "-f", "16", "-n", "2", "-w", "1",
                  "--trials", "1", "--coll", "all", "-R", "1", "--json", str(out_json))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# buffers: registered (comm.alloc_shared windows)" in p.stdout, p.stdout
    tables = parse_tables(p.stdout)
    for coll in COLLECTIVES:
        rows = tables.get(("pycoll", coll))
        assert rows and all(f[-1] == "0" for f in rows), (coll, p.stdout)
    assert json.loads(out_json.read_text())["metadata"]["versions"]["buffers"] == "registered"


_HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def compare_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """The --compare gloo run of each --interleave, once per module: {interleave: (process, plot
    path)}. Interleave 0 also writes --plot (where matplotlib is installed), interleave 1 runs
    with --bind none: test_bench_plot_flag_writes_the_plot and test_bench_binds_ranks_to_cpus
    check those on the same runs."""
    runs = {}
    for interleave in ("0", "1"):
        png = str(tmp_path_factory.mktemp("plot") / "busbw.png")
        extra = ["--plot", png] if interleave == "0" and _HAVE_MATPLOTLIB else []
        extra += ["--bind", "none"] if interleave == "1" else []
        runs[interleave] = run_bench("--interleave", interleave, "--nproc", "2", "-b", "1K", "-e",
                                     "4K", "-f", "4", "-n", "2", "-w", "1", "--trials", "1",
                                     "--coll", "all_reduce,all_gather", "--compare", "gloo",
                                     *extra), png  # fmt: skip
    return runs


@pytest.mark.parametrize("interleave", ["0", "1"])
def test_bench_compare_gloo(interleave, compare_runs):
    p = compare_runs[interleave][0]
    assert p.returncode == 0, p.stdout + p.stderr
    tables = parse_tables(p.stdout)
    for backend in ("pycoll", "gloo"):
        for coll in ("all_reduce", "all_gather"):
            rows = tables.get((backend, coll))
            assert rows and all(f[-1] == "0" for f in rows), (backend, coll, p.stdout)
    for coll in ("all_reduce", "all_gather"):
        assert f"# Comparison: {coll}" in p.stdout
    lines = p.stdout.splitlines()
    head = [ln for ln in lines if ln.startswith("#") and "ratio" in ln and "gloo us" in ln]
    assert len(head) == 2, p.stdout
    ratios = [ln.split()[-1] for ln in lines if re.match(r"^\s+\d+ \|", ln)]
    assert len(ratios) == 4 and all(float(r) > 0 for r in ratios), p.stdout


def test_bench_interleave_spreads_trials(tmp_path):
    """--interleave 1 --trials 3: every row carries its 3 per-trial times (one per round) and
    reports their median, and -c 1 still checks every row."""
    out_json = tmp_path / "bench.json"
    flags = "--interleave 1 --nproc 2 -b 1K -e 16K -f 4 -n 2 -w 1 --trials 3 -c 1"
    p = run_bench(*flags.split(), "--coll", "all_reduce,reduce_scatter", "--compare", "gloo",
                  "--json", str(out_json))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    tables = parse_tables(p.stdout)
    rows = json.loads(out_json.read_text())["rows"]
    for backend in ("pycoll", "gloo"):
        for coll in ("all_reduce", "reduce_scatter"):
            printed = tables.get((backend, coll))
            assert printed and len(printed) == 3 and all(f[-1] == "0" for f in printed), p.stdout
            got = [r for r in rows if r["backend"] == backend and r["collective"] == coll]
            assert [r["size"] for r in got] == [1024, 4096, 16384], got
    for r in rows:
        assert r["wrong"] == 0, r
        assert len(r["trials_us"]) == 3 and all(t > 0 for t in r["trials_us"]), r
        assert r["time_us"] == statistics.median(r["trials_us"]), r
        # pycollectives' rows say which path their timed calls took (-n 2 x 3 trials; the
        # planner's cost model fits each path apart); gloo's say nothing
        want = 6 if r["backend"] == "pycoll" else 0
        assert sum(r["paths"].values()) == want and set(r["paths"]) <= PATHS, r


PATHS = {"slots", "oneshot", "direct", "cma", "hierarchical", "flat"}


class _FakeRunner(Runner):
    """One rank, in process: every call does nothing (right for a 1-rank all-reduce), or raises
    when `error` is set."""

    probe_first_call = True

    def __init__(self, name: str, error: bool = False) -> None:
        super().__init__(0, 1)
        self.name, self.error, self.calls = name, error, 0

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        def call() -> None:
            self.calls += 1
            if self.error:
                raise RuntimeError("no such collective\nsecond line")

        return call

    def barrier(self):  # noqa: D102
        pass

    def max_over_ranks(self, values):  # noqa: D102
        return list(values)

    def sum_over_ranks(self, value):  # noqa: D102
        return value


@pytest.mark.parametrize("interleave", ["0", "1"])
def test_bench_sweep_probes_the_first_call(interleave):
    """A backend whose first call fails records the reason once: all its rows are n/a with the
    note, printed on the first line only; the other backend runs its trials and checks, with
    -w warmup calls before a size's first trial and (interleaved) 1 before each later one."""
    args = build_parser().parse_args(
        ["-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "3", "--trials", "3",
         "--interleave", interleave]
    )  # fmt: skip
    good, bad = _FakeRunner("good"), _FakeRunner("bad", error=True)
    said: list[str] = []
    rows = bench_collective([good, bad], SPECS["all_reduce"], args, said.append)
    assert [(r.backend, r.size) for r in rows] == [
        (b, s) for b in ("good", "bad") for s in (1024, 4096, 16384)
    ]
    for r in rows[:3]:
        assert r.wrong == 0 and len(r.trials_us) == 3, r
        assert r.time_us == statistics.median(r.trials_us), r
    rewarm = 2 if interleave == "1" else 0
    # the probe, then per size: warmup, rewarm before the 2nd and 3rd trial, trials, check
    assert good.calls == 1 + 3 * (3 + rewarm + 3 * 2 + 1)
    assert bad.calls == 1  # the probe only
    note = "bad: RuntimeError: no such collective"
    assert all(r.time_us is None and r.trials_us == [] and r.note == note for r in rows[3:])
    assert "\n".join(said).count(f"# {note}") == 1, said


class _OrderRunner(_FakeRunner):
    """A _FakeRunner that records the element count of every call, in order."""

    def __init__(self) -> None:
        super().__init__("one")
        self.order: list[int] = []

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        def call() -> None:
            self.order.append(inp.numel())

        return call


@pytest.mark.parametrize("interleave", ["0", "1"])
def test_bench_interleave_one_runner(interleave):
    """--interleave 1 with one backend (no --compare) goes round the sizes trial by trial, as
    it does with peers: a size's trials are spread over the whole sweep (plan_costs.py's
    fresh-communicator rounds rely on it); --interleave 0 runs a size's trials back to back."""
    args = build_parser().parse_args(
        ["-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "1", "--trials", "2", "-c", "0",
         "--interleave", interleave]
    )  # fmt: skip
    one = _OrderRunner()
    rows = bench_collective([one], SPECS["all_reduce"], args, lambda _: None)
    assert [(r.size, len(r.trials_us)) for r in rows] == [(1024, 2), (4096, 2)]
    calls = [n * 4 for n in one.order[1:]]  # after the probe; float32 elements -> bytes
    if interleave == "1":  # round 1: warmup + trial per size; round 2: rewarm + trial per size
        assert calls == [1024, 1024, 4096, 4096, 1024, 1024, 4096, 4096], calls
    else:
        assert calls == [1024, 1024, 1024, 4096, 4096, 4096], calls


def test_cpu_compare_targets_check_every_recorded_size(monkeypatch):
    """benchmarks/collectives/cpu_compare.py's targets(): each target is checked at every size recorded in
    its range (sizes taken from the rows) against pycollectives from the peer's own invocation
    (gloo: pycoll-G); one size below the target makes it MISSED and is named with its ratio, a
    size without a peer is named as n/a."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks", "collectives"))
    cpu_compare = importlib.import_module("cpu_compare")
    kib, mib = 1 << 10, 1 << 20

    def row(backend: str, coll: str, n: int, size: int, us: float) -> dict:
        return {"backend": backend, "collective": coll, "nranks": n, "size": size, "time_us": us}

    sizes = [16 << (2 * i) for i in range(12)]  # 16 B to 64 MiB, x4
    rows = [row("pycoll", "all_reduce", n, s, 1.0) for n in (2, 3, 4) for s in sizes]
    # gloo against pycollectives from its own invocation (pycoll-G): 10x, 4.5x at 64 MiB with 3
    rows += [row("gloo", "all_reduce", n, s, 10.0) for n in (2, 3, 4) for s in sizes]
    rows += [row("pycoll-G", "all_reduce", n, s, 1.0) for n in (2, 4) for s in sizes]
    rows += [row("pycoll-G", "all_reduce", 3, s, 10.0 / 4.5 if s == 64 * mib else 1.0)
             for s in sizes]  # fmt: skip
    # 2 ranks: 2x MPI except 1.1x at 4 MiB; 4 ranks: 1.5x MPI except 0.9x at 64 B
    rows += [row("mpi", "all_reduce", 2, s, 1.1 if s == 4 * mib else 2.0) for s in sizes]
    rows += [row("mpi", "all_reduce", 4, s, 0.9 if s == 64 else 1.5) for s in sizes]
    for coll in ("reduce_scatter", "all_gather"):
        rows += [row(b, coll, 2, s, 1.0) for b in ("pycoll", "mpi") for s in sizes]
    # 3-rank sizes are not powers of two; they must not enter the 2-rank checks
    rows += [row(b, "reduce_scatter", 3, s, 1.0 if b == "pycoll" else 0.5)
             for b in ("pycoll", "mpi") for s in (12, 252, 1020)]  # fmt: skip
    rows = [r for r in rows if not (r["backend"] == "mpi" and r["collective"] == "all_gather"
                                    and r["size"] == 256 * kib)]  # fmt: skip

    lines = cpu_compare.targets(rows, {})
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert all(c[3:] == ["not measured", "-"] for c in cells), lines  # no -R 1 rows
    plain = {c[0]: (c[1], c[2]) for c in cells}

    assert plain["all-reduce, 2 ranks, >= 1.25x OpenMPI from 1 to 16 MiB"] == (
        "3 sizes, 1 MiB to 16 MiB: 1.10-2.00x; below: 4 MiB 1.10x",
        "MISSED",
    )
    assert plain["all-reduce, 2 ranks, >= 2x OpenMPI at 64 MiB"] == ("64 MiB: 2.00x", "met")
    assert plain["all-reduce, 4 ranks on 2 cores, >= OpenMPI at every size"] == (
        "12 sizes, 16 B to 64 MiB: 0.90-1.50x; below: 64 B 0.90x",
        "MISSED",
    )
    for n in (2, 4):
        assert plain[f"all-reduce, {n} ranks, >= 5x gloo at every size from 64 KiB"] == (
            "6 sizes, 64 KiB to 64 MiB: 10.00x",
            "met",
        )
    assert plain["all-reduce, 3 ranks, >= 5x gloo at every size from 64 KiB"] == (
        "6 sizes, 64 KiB to 64 MiB: 4.50-10.00x; below: 64 MiB 4.50x",
        "MISSED",
    )
    # each table line: OpenMPI against pycoll, gloo against pycoll-G
    line = cpu_compare.table(rows, "all_reduce", 3)[-1]
    assert line == "| 64 MiB | 1.00 | n/a | n/a | n/a | 2.22 | n/a | 4.50 |", line
    assert plain["reduce-scatter, 2 ranks, >= OpenMPI at every size"] == (
        "12 sizes, 16 B to 64 MiB: 1.00x",
        "met",
    )
    assert plain["all-gather, 2 ranks, >= OpenMPI at every size"] == (
        "12 sizes, 16 B to 64 MiB: 1.00x; n/a: 256 KiB",
        "incomplete",
    )


@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
    reason="needs mpi4py and mpirun",
)
def test_bench_interleave_runs_mpi_in_the_same_ranks(tmp_path):
    out_json = tmp_path / "joint.json"
    flags = "--interleave 1 --nproc 2 -b 4K -e 64K -f 4 -n 2 -w 1 --trials 1 -c 1"
    p = run_bench(*flags.split(), "--coll", "all_reduce,all_gather", "--compare", "gloo,mpi",
                  "--json", str(out_json))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    tables = parse_tables(p.stdout)
    for backend in ("pycoll", "gloo", "mpi"):
        for coll in ("all_reduce", "all_gather"):
            rows = tables.get((backend, coll))
            assert rows and len(rows) == 3 and all(f[-1] == "0" for f in rows), (backend, coll)
    # Each backend's header lists its ranks' pids: one set of processes ran all three.
    pids = re.findall(r"#\s+Rank\s+(\d+) Pid\s+(\d+)", p.stdout)
    assert len(pids) == 6 and len(set(pids)) == 2, p.stdout
    meta = json.loads(out_json.read_text())["metadata"]
    assert meta["backends"] == ["pycoll", "gloo", "mpi"] and "mpi" in meta["versions"]


@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
    reason="needs mpi4py and mpirun",
)
def test_bench_binds_more_ranks_than_cpus_round_robin_under_mpirun():
    # Plain `mpirun --bind-to core` refuses to put two ranks on a core.
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus) + 1
    p = run_bench("--bind", "core", "--nproc", str(n), "--interleave", "1", "--compare", "mpi",
                  "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "--trials", "1",
                  "--coll", "all_reduce")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    got = re.findall(r"#\s+Rank\s+(\d+) Pid\s+\d+ on \S+ cpus (\S+)", p.stdout)[:n]
    assert got == [(str(r), str(cpus[r % len(cpus)])) for r in range(n)], p.stdout


def test_bench_binds_ranks_to_cpus(compare_runs):
    """--bind none leaves each rank every CPU (the --compare gloo run with --interleave 1; the
    default, --bind auto, is checked on test_bench_all_collectives' run)."""
    p = compare_runs["1"][0]
    assert p.returncode == 0, p.stdout + p.stderr
    _check_binding(p.stdout, "none", backends=2)


def test_bench_bad_flags():
    p = run_bench("-d", "float8", timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run_bench("-e", "12Q", timeout=60)
    assert p.returncode == 2 and "invalid size" in p.stderr
    p = run_bench("--coll", "allreduce", timeout=60)
    assert p.returncode == 2 and "unknown collective" in p.stderr
    p = run_bench("-R", "1", "--device", "cuda", timeout=60)
    assert p.returncode == 2 and "CPU only" in p.stderr


def test_cuda_collectives_renders_saved_runs(tmp_path):
    """benchmarks/cuda/cuda_collectives.py --render rewrites its docs section from a
    saved measurement (no GPU needed): the recorded H100 runs give a table per
    collective and world size and a verdict per target."""
    out = tmp_path / "benchmarks.md"
    out.write_text(
        "before\n<!-- cuda_collectives:begin -->\nold\n<!-- cuda_collectives:end -->\nafter\n"
    )
    saved = os.path.join(ROOT, "docs", "data", "cuda_collectives-2026-11-22.json")
    script = os.path.join(ROOT, "benchmarks", "cuda", "cuda_collectives.py")
    p = subprocess.run(
        [sys.executable, script, "--render", saved, "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    text = out.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for n in (2, 4):
            assert f"### {coll}, {n} ranks ({n} per GPU)" in text, text
    assert text.count("of the roofline (") == 6, text
    assert "| 256 MiB | 527.0 |" in text, text  # the 2-rank all-reduce row as measured


_NO_MATPLOTLIB = "matplotlib is not installed (pip install 'pycollectives[test]')"


def test_plot_busbw_on_log_axes(tmp_path):
    """--plot's figure, from a small results JSON: one panel per collective, one line per
    backend, busbw on a log axis (the sizes span orders of magnitude of busbw), size on a log2
    axis, rows without busbw or of size 0 left out; the PNG is written."""
    pytest.importorskip("matplotlib", reason=_NO_MATPLOTLIB)
    import matplotlib.image

    from pycollectives.bench.report import Row, plot, read_json, write_json

    def row(backend: str, coll: str, size: int, busbw: float | None) -> Row:
        t = size / busbw / 1e3 if busbw else None
        return Row(backend, coll, 2, size, size // 4, "float32", "sum", 0, t, busbw, busbw, 0)

    busbw = {8: 0.002, 1024: 0.25, 1 << 20: 6.5, 64 << 20: 11.0}
    rows = [row(b, c, s, bw * (1.0 if b == "pycoll" else 0.5)) for c in ("all_reduce", "all_gather")
            for b in ("pycoll", "gloo") for s, bw in busbw.items()]  # fmt: skip
    rows += [row("gloo", "all_reduce", 4 << 20, None), row("pycoll", "all_reduce", 0, 0.0)]
    results = tmp_path / "results.json"
    write_json(str(results), {"hostname": "test"}, rows)
    _, back = read_json(str(results))
    png = tmp_path / "busbw.png"
    fig = plot(str(png), back)

    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == [
        "all_reduce (float32, 2 ranks)",
        "all_gather (float32, 2 ranks)",
    ]
    for ax in panels:
        assert ax.get_yscale() == "log" and ax.get_ylabel() == "busbw (GB/s)"
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert sorted(lines) == ["gloo", "pycoll"], lines
        for backend, factor in (("pycoll", 1.0), ("gloo", 0.5)):
            assert list(lines[backend].get_xdata()) == list(busbw), backend
            assert list(lines[backend].get_ydata()) == [v * factor for v in busbw.values()]
        lo, hi = ax.get_ylim()
        assert lo <= 0.001 and hi >= 11.0  # every point inside, orders of magnitude apart
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert (width, height) == (10 * 120, round(3.8 * 120))  # 2 panels of 5 x 3.8 in, 120 dpi


def test_bench_plot_flag_writes_the_plot(compare_runs):
    """`pycollectives-bench --plot FILE.png --compare gloo`: the run writes the PNG (the
    --interleave 0 run of compare_runs)."""
    pytest.importorskip("matplotlib", reason=_NO_MATPLOTLIB)
    p, png = compare_runs["0"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"# wrote plot to {png}" in p.stdout, p.stdout
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plan_costs_rounds_estimator(monkeypatch):
    """benchmarks/plan/plan_costs.py: merge_round adds each launch's trials, least trial and
    calls by path to the first launch's row of a point, and the "rounds" estimator takes the
    median over the launches of their least trials (a fresh communicator each: the machine
    may land on a 4x slower one), where "min" takes the least of all."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks", "plan"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks", "common"))
    plan_costs = importlib.import_module("plan_costs")

    def launch(trials: list[float], path: str) -> list[dict]:
        return [{"backend": "pycoll", "collective": "all_reduce", "nranks": 2, "size": 65536,
                 "time_us": statistics.median(trials), "trials_us": trials, "paths": {path: 5}},
                {"backend": "gloo", "collective": "all_reduce", "nranks": 2, "size": 65536,
                 "time_us": 1.0, "trials_us": [1.0], "paths": {}}]  # fmt: skip

    got: dict = {}
    for trials, path in (([30.0, 29.0], "slots"), ([10.0, 9.0], "slots"), ([31.0, 28.0], "cma")):
        plan_costs.merge_round(got, "fit", launch(trials, path))
    (row,) = got.values()  # gloo's rows are not pycollectives'
    assert row["round_mins"] == [29.0, 9.0, 28.0]
    assert row["trials_us"] == [30.0, 29.0, 10.0, 9.0, 31.0, 28.0]
    assert row["paths"] == {"slots": 10, "cma": 5}
    assert plan_costs.row_times([dict(row)], "rounds")[0]["time_us"] == 28.0
    assert plan_costs.row_times([dict(row)], "min")[0]["time_us"] == 9.0
    assert plan_costs.row_times([dict(row)], "median")[0]["time_us"] == 28.5
