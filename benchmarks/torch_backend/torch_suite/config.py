"""What the orchestrator and the worker agree on: the suite, the reference backend, the
environment variables the orchestrator hands the worker (and through it, the ranks), the
defaults. Imports nothing but the standard library."""

from __future__ import annotations

from pathlib import Path

# The directory holding this package (benchmarks/): first on the worker's sys.path and
# PYTHONPATH, so that the worker and the ranks import `torch_suite.worker`.
BENCH = Path(__file__).resolve().parent.parent
WORKER_MODULE = "torch_suite.worker"  # what the worker, the forkserver and the ranks import
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
REFERENCE = "gloo"  # the backend whose name the gates let through, and the reference
OUTCOMES = ("pass", "fail", "skip", "hang")

# Environment of the worker (and through it, of the rank processes).
WORKER_ENV = "TORCH_SUITE_WORKER"  # "1": importing this module builds the test class
REAL_BACKEND_ENV = "TORCH_SUITE_BACKEND"  # what process groups are created with
TRACE_ENV = "TORCH_SUITE_TRACE_DIR"  # where ranks record the groups they create

DEFAULT_TIMEOUT = 60.0  # seconds per test
DEFAULT_GRACE = 60.0  # watchdog slack beyond torch's own per-test timeout
