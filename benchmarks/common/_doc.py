"""What the benchmark scripts share: a free port, running the benchmark CLI for its JSON,
rewriting their own section of docs/benchmarks.md (between their markers,
leaving the rest alone) and naming the machine's CPU."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from pycollectives.bench.launch import bench_command

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a TCPStore the ranks meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_cores(seconds: float = 2.0) -> float | None:
    """How many of this machine's CPUs other processes kept busy over the next `seconds`
    (/proc/stat: non-idle time over the interval; the caller sleeps through it), unlike the
    load average, which still counts the runs of the minutes before. None where /proc/stat
    cannot be read."""

    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    a = sample()
    time.sleep(seconds)
    b = sample()
    if a is None or b is None or b[0] <= a[0]:
        return None
    total, idle = b[0] - a[0], b[1] - a[1]
    return (os.cpu_count() or 1) * (total - idle) / total


def run_bench(nranks: int, flags: list[str], env: dict[str, str] | None = None) -> dict:
    """Runs `pycollectives-bench --nproc nranks --json ... flags` (its table
    discarded) and returns the JSON it wrote: metadata and rows. Raises
    CalledProcessError when the benchmark fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        args = ["--nproc", str(nranks), "--json", out, *flags]
        print("+ pycollectives-bench", " ".join(args), flush=True)
        # bench_command: from a clone's root, plain `python -m` would import the source tree
        cmd = bench_command(args)
        subprocess.run(
            cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, **(env or {}))
        )
        return json.loads(Path(out).read_text())


def round_trips(label: str, data: dict) -> str:
    """`label before/after`: the cache-line round trip between two CPUs (ns) the invocation
    measured before and after its ranks ran (`pycollectives-bench` metadata)."""
    t = data["metadata"].get("cpu_round_trip_ns") or {}
    ns = [f"{t[k]:.0f}" if t.get(k) is not None else "-" for k in ("before", "after")]
    return f"{label} {'/'.join(ns)}"


def median_times(
    nranks: int,
    flags: list[str],
    modes: dict[str, dict[str, str]],
    rounds: int,
    check: Callable[[str, dict], None] | None = None,
) -> dict[tuple[str, int, str], float]:
    """Runs the benchmark once per mode (name -> environment) per round, the modes' order
    reversed every other round, and returns the median pycollectives time (us) over rounds
    per (collective, size, mode). check(mode, data) may reject a run (raise SystemExit);
    a row with wrong elements does."""
    times: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for rnd in range(rounds):
        order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
        for mode in order:
            data = run_bench(nranks, flags, modes[mode])
            if check:
                check(mode, data)
            for row in data["rows"]:
                if row["backend"] != "pycoll" or row["time_us"] is None:
                    continue
                if row["wrong"]:
                    raise SystemExit(f"{mode}: {row['wrong']} wrong elements: {row}")
                times[(row["collective"], row["size"], mode)].append(row["time_us"])
    return {k: statistics.median(v) for k, v in times.items()}


def ratio_cells(a: float | None, b: float | None) -> str:
    """Table cells `a | b | a/b` (times in us), or dashes where either is missing."""
    return " - | - | - |" if a is None or b is None else f" {a:.1f} | {b:.1f} | {a / b:.2f} |"


def size_label(size: int) -> str:
    """1 MiB, 64 KiB, 12 B."""
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= k:
            return f"{size // k} {unit}"
    return f"{size} B"


def rounds_args(doc: str, ranks: str, colls: str | None = None) -> argparse.Namespace:
    """--ranks (default `ranks`), --rounds (2) and --no-write, for the scripts that compare two
    settings of pycollectives over interleaved rounds; --coll (default `colls`) if given."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ranks", default=ranks)
    if colls is not None:
        ap.add_argument("--coll", default=colls, help="comma-separated collectives")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()


def emit_section(
    begin: str, end: str, title: str, command: str, notes: list[str], tables: list[str], write: bool
) -> None:
    """Prints a section (title, the command's bullet, machine and date, `notes` as bullets, the
    tables) and, if `write`, puts it between its markers in docs/benchmarks.md."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    body = [
        begin,
        f"## {title}",
        "",
        f"- Command: {command}",
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}",
        f"- Date: {when}",
        *(f"- {note}" for note in notes),
        "",
        *tables,
        end,
    ]
    text = "\n".join(body)
    print(text)
    if write:
        write_section(text + "\n", begin, end)


def publish(
    name: str, title: str, notes: list[str], tables: list[str], record: dict, write: bool
) -> None:
    """A script's record and section under one `name`: writes docs/data/NAME-DATE.json (the
    command, machine and date, then `record`) and, through emit_section, the section between
    <!-- NAME:begin --> and <!-- NAME:end -->; with `write` false only prints the section."""
    date = datetime.date.today().isoformat()
    script = Path(sys.argv[0]).resolve()
    script_name = (
        script.relative_to(DOC.parents[1]) if script.is_relative_to(DOC.parents[1]) else script
    )
    argv = " ".join(sys.argv[1:])
    command = f"python {script_name}{' ' + argv if argv else ''}"
    if write:
        data = DOC.parent / "data"
        data.mkdir(exist_ok=True)
        head = {
            "command": command,
            "machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "date": date,
        }
        (data / f"{name}-{date}.json").write_text(json.dumps({**head, **record}, indent=1) + "\n")
    emit_section(f"<!-- {name}:begin -->", f"<!-- {name}:end -->", title,
                 f"`{command}` (data: docs/data/{name}-{date}.json)", notes, tables, write)  # fmt: skip


def run_note(load0: tuple, load1: tuple, t0: float, busy0: float | None = None) -> str:
    """The load averages at start and end, the seconds since `t0` (perf_counter) and the
    other processes' CPU use before the run (busy_cores, where measured), as a note line."""
    busy = (
        f"; other processes kept {busy0:.2f} of the CPUs busy before it."
        if busy0 is not None
        else "."
    )
    return (
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all{busy}"
    )


def write_section(section: str, begin: str, end: str, path: Path = DOC) -> None:
    """Replaces the text from marker `begin` through marker `end` in `path` by
    `section` (which carries both markers); appends it when the markers are
    missing, creating the file if needed."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
