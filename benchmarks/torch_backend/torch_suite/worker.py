"""The worker and rank side: runs inside the worker subprocess (`python -P -c "import
torch_suite.worker ..."`, see runner._worker_cmd) and its rank processes, which import torch.
Imported with TORCH_SUITE_WORKER=1, it builds the suite's test class (TestDistBackendWithSpawn)
as an attribute of this module, so that the pickled references to it that the ranks receive
resolve; worker_main lists the tests or runs them, one JSON line per event."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
import traceback
import types
import unittest
from pathlib import Path
from typing import Any

from .config import (
    DEFAULT_TIMEOUT,
    REAL_BACKEND_ENV,
    REFERENCE,
    SUITE_MODULE,
    TRACE_ENV,
    WORKER_ENV,
)


def _install_expecttest_stub() -> None:
    """Makes `import expecttest` work where the package is missing: torch's TestCase
    derives from expecttest.TestCase, whose expect-file assertions the suite never uses."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.ACCEPT = False  # type: ignore[attr-defined]
        stub.TestCase = type("TestCase", (unittest.TestCase,), {"longMessage": True})  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stub


def _backend_class(pg: Any) -> str:
    """`name Class` of a process group: its CPU backend's class for a plain ProcessGroup
    (gloo's), the group's own class where a plugin's creator returns a ProcessGroup subclass
    (pycoll's)."""
    import torch
    import torch.distributed as dist

    if type(pg) is dist.ProcessGroup:
        return f"{dist.get_backend(pg)} {type(pg._get_backend(torch.device('cpu'))).__name__}"
    return f"{dist.get_backend(pg)} {type(pg).__name__}"


def _record(kind: str, pg: Any) -> None:
    """Appends `kind name Class` of a process group this rank created to its file under
    $TORCH_SUITE_TRACE_DIR (the worker collects them per test)."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(os.path.join(trace, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{kind} {_backend_class(pg)}\n")


def _install_backend_hook(real: str) -> None:
    """Wraps torch.distributed's init_process_group and new_group. init_process_group:
    backend "gloo" becomes `real` (the gate bypass; nothing changes when `real` is gloo), and
    a default group whose backend is not `real` raises. Both record the groups created
    (_record)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    orig_init, orig_new = c10d.init_process_group, c10d.new_group
    if getattr(orig_init, "_torch_suite", False):
        return

    @functools.wraps(orig_init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if args:
            args = (real if str(args[0]).lower() == REFERENCE else args[0], *args[1:])
        elif str(kwargs.get("backend")).lower() == REFERENCE:
            kwargs["backend"] = real
        orig_init(*args, **kwargs)
        _record("default", dist.group.WORLD)
        if dist.get_backend() != real:
            raise RuntimeError(f"torch_suite: the default group is {dist.get_backend()!r}, not {real!r}")  # fmt: skip

    @functools.wraps(orig_new)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        pg = orig_new(*args, **kwargs)
        if isinstance(pg, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
            _record("new_group", pg)
        return pg

    init_process_group._torch_suite = True  # type: ignore[attr-defined]
    dist.init_process_group = c10d.init_process_group = init_process_group
    dist.new_group = c10d.new_group = new_group


def _make_test_class() -> type:
    """TestDistBackendWithSpawn as torch's test_distributed_spawn.py defines it, with the rank
    processes started by this worker's start method and handed the parent's environment."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    _install_expecttest_stub()
    import torch.multiprocessing as tmp
    from torch.testing._internal import common_distributed

    import pycollectives  # noqa: F401 - registers "pycoll"

    suite = __import__(SUITE_MODULE, fromlist=["DistributedTest"])
    _install_backend_hook(os.environ[REAL_BACKEND_ENV])

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        def _spawn_processes(self) -> None:
            method = os.environ.get("TORCH_SUITE_START_METHOD", "forkserver")
            self._start_processes(tmp.get_context(method).Process)

        def _start_processes(self, proc: Any) -> None:
            env = dict(os.environ)  # TEMP_DIR and INIT_METHOD are the current test's

            def with_env(*args: Any, **kwargs: Any) -> Any:
                kwargs["kwargs"] = {**kwargs.get("kwargs", {}), "parent_env": env}
                return proc(*args, **kwargs)

            super()._start_processes(with_env)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            env = kwargs.pop("parent_env", None)
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            # A spawned rank imports the suite after the parent set INIT_METHOD for the test.
            suite.INIT_METHOD = os.getenv("INIT_METHOD", "env://")
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    # torch's own per-test timeout (the parent kills the ranks when it expires).
    timeout = int(float(os.environ.get("TORCH_SUITE_TIMEOUT", DEFAULT_TIMEOUT)))
    common_distributed.TIMEOUT_DEFAULT = timeout
    for name in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[name] = timeout
    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


if os.environ.get(WORKER_ENV) == "1":
    # The worker, the forkserver and every rank process: pickled references to the class
    # resolve to this module's attribute.
    if sys.path and sys.path[0] == "":
        # The forkserver on Python 3.10, which has no -P to inherit: its `python -c` put the
        # working directory first; pycollectives comes from PYTHONPATH or site-packages.
        del sys.path[0]
    TestDistBackendWithSpawn = _make_test_class()


def _static_skips(cls: type) -> dict[str, str | None]:
    """Every test of the class -> the reason it is skipped at import (unittest.skip on the
    method, decided by the gates), or None where it runs (and may still skip at runtime)."""
    out: dict[str, str | None] = {}
    for name in sorted(n for n in dir(cls) if n.startswith("test")):
        fn = getattr(cls, name)
        skip = getattr(fn, "__unittest_skip__", False)
        out[name] = (getattr(fn, "__unittest_skip_why__", "") or "skipped") if skip else None
    return out


class _Recorder(unittest.TestResult):
    """Writes one JSON line when a test starts and one with its outcome when it ends."""

    def __init__(self, out: Any, timeout: float, logs: list[str], trace_dir: str | None) -> None:
        super().__init__()
        self.out, self.timeout, self.logs, self.trace_dir = out, timeout, logs, trace_dir
        self.t0 = 0.0
        self.outcome: tuple[str, str, str] | None = None

    def _write(self, rec: dict[str, Any]) -> None:
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest API
        super().startTest(test)
        self.t0, self.outcome = time.time(), None
        self.logs.clear()
        self._write({"event": "start", "test": test._testMethodName, "t": self.t0})

    def missing(self, name: str) -> None:
        """A name the suite has no test for: a failure."""
        self._write({"event": "start", "test": name, "t": time.time()})
        end = {"outcome": "fail", "seconds": 0.0, "reason": "", "pg_backends": []}
        self._write({"event": "end", "test": name, **end, "error": "no such test in the suite"})

    def _set(self, outcome: str, error: str = "", reason: str = "") -> None:
        if self.outcome is None or self.outcome[0] == "pass":  # the first failure counts
            self.outcome = (outcome, error, reason)

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._set("pass")

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._set("pass", reason="expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._set("fail", error="unexpected success (the test is marked expectedFailure)")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        self._set("skip", reason=reason)

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._fail(err)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._fail(err)

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:  # noqa: N802
        if err is not None:
            self._fail(err)

    def _fail(self, err: Any) -> None:
        text = "".join(traceback.format_exception(*err))
        timed_out = "terminated or timed out after" in text
        if timed_out and time.time() - self.t0 >= self.timeout:
            if self.logs:
                text += "\n\nStacks of the ranks when torch's timeout expired:\n"
                text += "\n".join(self.logs)
            self._set("hang", error=text)
        else:
            self._set("fail", error=text)

    def stopTest(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().stopTest(test)
        outcome, error, reason = self.outcome or ("fail", "no outcome reported", "")
        backends: list[str] = []
        if self.trace_dir:
            for f in sorted(Path(self.trace_dir).glob("*.txt")):
                backends += f.read_text().split("\n")
                f.unlink()
        seen = sorted({b for b in backends if b.strip()})
        self._write(
            {
                "event": "end",
                "test": test._testMethodName,
                "outcome": outcome,
                "seconds": round(time.time() - self.t0, 2),
                "error": error[-40000:],
                "reason": reason,
                "pg_backends": seen,
            }
        )


class _LogCollector(logging.Handler):
    """Keeps the messages torch logs when a test times out (the ranks' stacks)."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "timed out" in msg or "traceback for timed out" in msg:
            self.sink.append(msg)


def worker_main(argv: list[str] | None = None) -> int:
    """The worker: `--list` prints every test with its import-time skip reason (JSON);
    otherwise runs the tests named in --tests-file in order, one JSON line per event into
    --results."""
    ap = argparse.ArgumentParser(prog="torch_suite worker")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--tests-file")
    ap.add_argument("--results")
    a = ap.parse_args(argv)
    cls = globals().get("TestDistBackendWithSpawn")
    if cls is None:
        raise SystemExit(f"worker_main needs {WORKER_ENV}=1 in the environment")
    if a.list:
        print(json.dumps(_static_skips(cls)))
        return 0
    method = os.environ.get("TORCH_SUITE_START_METHOD", "forkserver")
    if method == "forkserver":
        import torch.multiprocessing as tmp

        tmp.get_context("forkserver").set_forkserver_preload([__name__])
    logs: list[str] = []
    from torch.testing._internal import common_distributed

    logging.getLogger(common_distributed.__name__).addHandler(_LogCollector(logs))
    names = Path(a.tests_file).read_text().split()
    timeout = float(os.environ.get("TORCH_SUITE_TIMEOUT", DEFAULT_TIMEOUT))
    with open(a.results, "a") as out:
        rec = _Recorder(out, timeout, logs, os.environ.get(TRACE_ENV))
        cls.setUpClass()
        try:
            for name in names:
                if hasattr(cls, name):
                    cls(name).run(rec)
                else:
                    rec.missing(name)
        finally:
            cls.tearDownClass()
    return 0
