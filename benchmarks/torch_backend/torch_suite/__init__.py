"""PyTorch's own distributed test suite against the "pycoll" backend and gloo, side by side.

    python benchmarks/torch_backend/torch_suite                                      # pycoll,gloo; 2 ranks
    python benchmarks/torch_backend/torch_suite --backends pycoll,gloo --world-sizes 2,3,4,8 \\
        --bypass-gate --json /tmp/torch_suite_results/all.json
    python benchmarks/torch_backend/torch_suite -k all_reduce_coalesced --bypass-gate --world-sizes 3
    python benchmarks/torch_backend/torch_suite --report ws2.json ws3.json           # compare saved runs

The suite is the one in the torch wheel, torch/testing/_internal/distributed/
distributed_test.py (DistributedTest._DistTestBase), driven as torch's
test/distributed/test_distributed_spawn.py drives it: environment BACKEND,
WORLD_SIZE and TEMP_DIR, a class TestDistBackendWithSpawn(TestDistBackend,
DistributedTest._DistTestBase) whose setUp starts one process per rank; each
rank runs TestDistBackend._run (init_process_group on a file:// store, the
test, destroy). Every (backend, world size) runs in a worker subprocess
(`python -P -c "import torch_suite.worker; ..."`, the working directory kept
off sys.path so that a clone's source tree is not imported in its place: a
bootstrap drops it on Python 3.10); the worker and the ranks import
torch_suite.worker (benchmarks/ is on their PYTHONPATH; the forkserver preloads
it by name), which imports pycollectives and so registers "pycoll". INIT_METHOD
is a file:// URL at import, as in torch CI's "init file" variant (otherwise
test_barrier_timeout_global is skipped for every backend).

Differences from torch's runner, none of which changes what a test checks:
  - the rank processes start from a forkserver that has imported torch, the
    suite and pycollectives once (--start-method spawn does what torch does,
    at 4-5 CPU seconds of imports per rank per test); each rank gets the
    parent's environment of the moment (TEMP_DIR, INIT_METHOD: set per test),
    and the suite's INIT_METHOD global is set from it, as a spawned rank's
    import would;
  - OMP_NUM_THREADS=1 (up to 8 ranks share few cores), and no "To execute this
    test, run ..." lines in failure messages;
  - if the `expecttest` package is missing, a stub module stands in for it
    (torch's TestCase derives from expecttest.TestCase; the distributed suite
    calls none of its assertExpected* methods);
  - every test is bounded: torch's own per-test timeout is set to
    --timeout-per-test (its parent then kills the ranks; the test counts as
    "hang", with the ranks' stacks that torch logs), and a watchdog kills the
    whole worker (its process group) --grace seconds later, counts the running
    test as "hang" and goes on with the rest in a new worker.

The suite gates many tests by backend name (`BACKEND != "gloo"` -> skip,
`BACKEND not in {"nccl", "gloo", "ucc"}` -> skip, ...), in decorators
evaluated when it is imported. --bypass-gate adds, for every backend other
than gloo, a run of the gated tests: those skipped at import under its own name
but not under "gloo". The worker imports the suite with BACKEND=gloo, so gates
and test bodies see "gloo", and torch.distributed.init_process_group maps
backend "gloo" to the backend under test: the default group, and every group
that inherits its backend, is that backend's. Groups a test creates with an
explicit backend="gloo" (the monitored-barrier tests' helper groups) stay gloo.
Every rank records `default|new_group <backend name> <class>` of each group it
creates (e.g. "default pycoll ProcessGroupPycoll"); the results carry them per
test ("pg_backends"), and a rank whose default group is not the backend under
test fails its test.

Output: per world size, passed/failed/skipped/hung counts per backend and mode,
the tests that a backend fails or hangs while gloo passes them (each with its
exception per distinct rank error, or where the ranks were stuck, and the
frames in the suite and in the backend), and the gated tests' outcomes. --json
writes every result with its full error text, rewritten after every run, with
a digest of pycollectives' files before and after each run. Importable (with
benchmarks/ on sys.path): torch_suite.run_tests(backend, world_size, tests,
bypass_gate=...) runs a named selection and returns {test name: TestResult}.

The modules: config (what the orchestrator and the worker agree on), worker (the
worker and rank side, which imports torch), runner (the orchestrator: the
workers, their watchdog, TestResult and Run; no torch import), errors (the key
lines of an error text), report (the comparison, the --json files), __main__
(the command line).
"""

from __future__ import annotations

from .runner import Run, TestResult, gated_tests, list_tests, run_tests

__all__ = ["Run", "TestResult", "gated_tests", "list_tests", "run_tests"]
