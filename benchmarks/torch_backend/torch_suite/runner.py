"""The orchestrator: runs the suite's tests for one (backend, world size) in worker
subprocesses (worker.py) and collects their outcomes as TestResults; a watchdog kills a worker
whose test runs past its bound and a new worker goes on with the rest. Imports no torch."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .config import (
    BENCH,
    DEFAULT_GRACE,
    DEFAULT_TIMEOUT,
    OUTCOMES,
    REAL_BACKEND_ENV,
    REFERENCE,
    TRACE_ENV,
    WORKER_ENV,
    WORKER_MODULE,
)
from .errors import summarize_error


@dataclass
class TestResult:
    """One test's outcome: pass, fail, skip or hang; the full error text (a failure's or a
    hang's traceback, with the ranks' tracebacks or stacks), the skip reason, and the groups
    the ranks created ("default pycoll ProcessGroupPycoll", "new_group gloo ProcessGroupGloo")."""

    name: str
    outcome: str
    seconds: float = 0.0
    error: str = ""
    reason: str = ""
    pg_backends: list[str] = field(default_factory=list)

    @property
    def summary(self) -> list[str]:
        """The key lines of the error: per distinct rank error, its exception and where."""
        return summarize_error(self.error)


@dataclass
class Run:
    """The results of one (backend, world size, mode) run; mode is "plain" or "bypass"."""

    backend: str
    world_size: int
    mode: str
    results: dict[str, TestResult]
    wall_s: float = 0.0
    code: list[dict[str, str]] = field(default_factory=list)  # code_state() before, after

    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(OUTCOMES, 0)
        for r in self.results.values():
            c[r.outcome] += 1
        return c


def code_state() -> dict[str, str]:
    """What the ranks import: pycollectives' location, its git HEAD, how many paths of the
    package and csrc/ differ from it, and a digest of the package's files as they are now
    (sources and the built extension), so that runs of a tree being edited can be told apart."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("pycollectives")  # finds it without importing torch
    if spec is None or spec.origin is None:
        return {}
    pkg = Path(spec.origin).parent
    h = hashlib.sha1()
    for f in sorted(pkg.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(pkg)).encode())
            h.update(f.read_bytes())

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(pkg.parent), *args], capture_output=True, text=True)
        return out.stdout.strip()

    dirty = git("status", "--porcelain", "--", "pycollectives", "csrc").splitlines()
    return {"path": str(pkg), "head": git("rev-parse", "--short", "HEAD"),
            "dirty_paths": str(len(dirty)), "files_sha1": h.hexdigest()[:12]}  # fmt: skip


def _worker_env(
    backend: str, world_size: int, bypass_gate: bool, timeout: float, start_method: str, tmp: str
) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("INIT_METHOD", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    temp_dir = os.path.join(tmp, "suite")
    os.makedirs(os.path.join(temp_dir, "barrier"), exist_ok=True)
    trace = os.path.join(tmp, "trace")
    os.makedirs(trace, exist_ok=True)
    env.update(
        {
            WORKER_ENV: "1",
            REAL_BACKEND_ENV: backend,
            "BACKEND": REFERENCE if bypass_gate else backend,
            "WORLD_SIZE": str(world_size),
            "TEMP_DIR": temp_dir,
            # As torch CI's "init file" variant: the file://-only tests are not skipped at
            # import. (Each test's ranks get their own file:// INIT_METHOD from its setUp.)
            "INIT_METHOD": f"file://{os.path.join(temp_dir, 'init_file')}",
            "TMPDIR": tmp,
            TRACE_ENV: trace,
            "TORCH_SUITE_TIMEOUT": str(timeout),
            "TORCH_SUITE_START_METHOD": start_method,
            "OMP_NUM_THREADS": "1",
            # The forkserver imports its preload modules from PYTHONPATH (not sys.path).
            "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH")) if p),
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",  # no "To execute this test, run ..." lines
        }
    )
    return env


# `python -P` (Python >= 3.11) leaves the working directory off the worker's sys.path, and off
# its forkserver's (multiprocessing passes the flag on); before, a bootstrap removes the entry
# that `-c` put there ('': the working directory), as pycollectives.bench.launch's bench_command.
_SAFE_PATH_FLAG = sys.version_info >= (3, 11)


def _worker_cmd(*args: str) -> list[str]:
    """The worker's command line. A running worker first starts its forkserver, which then
    imports torch, the suite and pycollectives while the worker imports them too. The working
    directory stays off sys.path: from a clone's root the worker would import the source tree's
    pycollectives (no built _C) instead of the one on PYTHONPATH or in site-packages."""
    code = "import sys\n" if _SAFE_PATH_FLAG else "import sys; del sys.path[0]\n"
    code += f"sys.path.insert(0, {str(BENCH)!r})\n"
    if "--list" not in args:
        code += (
            "import os\n"
            "if os.environ.get('TORCH_SUITE_START_METHOD') == 'forkserver':\n"
            "    from multiprocessing import forkserver\n"
            f"    forkserver.set_forkserver_preload([{WORKER_MODULE!r}])\n"
            "    forkserver.ensure_running()\n"
        )
    code += f"import {WORKER_MODULE}\nsys.exit({WORKER_MODULE}.worker_main(sys.argv[1:]))"
    return [sys.executable, *(["-P"] if _SAFE_PATH_FLAG else []), "-c", code, *args]


def list_tests(backend: str, world_size: int, bypass_gate: bool = False) -> dict[str, str | None]:
    """Every test of the suite -> its import-time skip reason under that backend's name
    (under "gloo" with bypass_gate), None where it runs."""
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        env = _worker_env(backend, world_size, bypass_gate, DEFAULT_TIMEOUT, "spawn", tmp)
        out = subprocess.run(_worker_cmd("--list"), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"listing the suite failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def gated_tests(backend: str, world_size: int) -> list[str]:
    """The tests skipped at import under `backend`'s name but not under "gloo"'s."""
    own, ref = list_tests(backend, world_size), list_tests(REFERENCE, world_size)
    return sorted(n for n, why in own.items() if why is not None and ref.get(n) is None)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the worker's process group (the worker, its forkserver, its ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_tests(
    backend: str,
    world_size: int,
    tests: Iterable[str],
    *,
    bypass_gate: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    grace: float = DEFAULT_GRACE,
    start_method: str = "forkserver",
    deadline: float | None = None,
    log: Path | None = None,
    echo: Callable[[str], None] | None = None,
) -> dict[str, TestResult]:
    """Runs the named tests of the suite on `backend` with `world_size` ranks, in order, and
    returns {name: TestResult}. bypass_gate: the suite sees BACKEND=gloo while the groups
    are `backend`'s. Each test is bounded by `timeout` (torch's own, then the watchdog at
    timeout + grace kills the worker and a new worker goes on with the rest). Past
    `deadline` (time.time()), the tests not yet started are reported as hangs without
    running. `log` receives the workers' output; `echo` a line per finished test."""
    pending = list(dict.fromkeys(tests))
    results: dict[str, TestResult] = {}
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        env = _worker_env(backend, world_size, bypass_gate, timeout, start_method, tmp)
        while pending:
            if deadline is not None and time.time() > deadline:
                for name in pending:
                    results[name] = TestResult(name, "hang", error="not run: deadline passed")
                break
            tests_file, results_file = Path(tmp, "tests.txt"), Path(tmp, "results.jsonl")
            tests_file.write_text("\n".join(pending) + "\n")
            results_file.write_text("")
            worker_log = Path(tmp, "worker.log")
            with open(worker_log, "w") as logf:
                proc = subprocess.Popen(
                    _worker_cmd("--tests-file", str(tests_file), "--results", str(results_file)),
                    env=env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                current, started, why = _follow(
                    proc, results_file, results, timeout + grace, deadline, echo
                )
            output = worker_log.read_text(errors="replace")
            if log:
                with open(log, "a") as f:
                    f.write(output)
            tail = "\n".join(output.splitlines()[-30:])
            progressed = any(n in results for n in pending)
            pending = [n for n in pending if n not in results]
            if current is not None and current not in results:
                rc = proc.returncode
                if why:
                    res = TestResult(current, "hang", time.time() - started, error=why)
                else:
                    msg = (
                        f"the worker exited (code {rc}) during the test; its output ended:\n{tail}"
                    )
                    res = TestResult(current, "fail", time.time() - started, error=msg)
                results[current] = res
                pending.remove(current)
                if echo:
                    echo(f"{res.outcome:5} {current} ({res.seconds:.0f} s): {res.error[:200]}")
            elif pending and (proc.returncode != 0 or not progressed):
                # Died before starting a test, or ran none: report the rest rather than loop.
                for name in pending:
                    msg = f"the worker exited (code {proc.returncode}); its output ended:\n{tail}"
                    results[name] = TestResult(name, "fail", error=msg)
                pending = []
    return results


def _follow(
    proc: subprocess.Popen,
    results_file: Path,
    results: dict[str, TestResult],
    limit: float,
    deadline: float | None,
    echo: Callable[[str], None] | None,
) -> tuple[str | None, float, str]:
    """Reads the worker's events until it exits; kills it when a test runs past `limit`
    seconds or the deadline passes. Returns (test running when it ended, its start time,
    why it was killed or "")."""
    current: str | None = None
    started, pos, why = time.time(), 0, ""
    with open(results_file) as f:
        while True:
            exited = proc.poll() is not None
            f.seek(pos)
            chunk = f.read()
            lines = chunk.split("\n")
            pos += len(chunk) - len(lines[-1])  # keep a partial line for the next read
            for line in lines[:-1]:
                ev = json.loads(line)
                if ev["event"] == "start":
                    current, started = ev["test"], ev["t"]
                else:
                    keys = ("outcome", "seconds", "error", "reason", "pg_backends")
                    res = TestResult(ev["test"], **{k: ev[k] for k in keys})
                    results[res.name] = res
                    current = None
                    if echo:
                        first = (res.summary or [res.reason])[0] if res.outcome != "pass" else ""
                        echo(f"{res.outcome:5} {res.name} ({res.seconds:.0f} s) {first}".rstrip())
            if exited:
                return current, started, why
            now = time.time()
            if current is not None and now - started > limit:
                why = f"killed by the runner's watchdog after {now - started:.0f} s"
            elif deadline is not None and now > deadline:
                why = "killed: the run's deadline passed"
            if why:
                _kill_group(proc)
                continue  # read what it wrote before it died, then return
            time.sleep(0.2)


def select(names: Iterable[str], patterns: list[str]) -> list[str]:
    """The names matching any pattern (unittest -k: a substring, or fnmatch where the
    pattern has a wildcard); all of them without patterns."""
    if not patterns:
        return list(names)

    def hit(name: str, p: str) -> bool:
        return fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name

    return [n for n in names if any(hit(n, p) for p in patterns)]
