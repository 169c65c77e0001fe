"""PyTorch's own distributed test suite (torch/testing/_internal/distributed/
distributed_test.py) on the "pycoll" backend, through benchmarks/torch_backend/torch_suite/:
a selection of its tests that gloo passes and pycoll must pass too, with 2 and 3
ranks. The tests torch gates by backend name (gloo only) run with the gate
bypassed: the suite sees BACKEND=gloo while every default group is pycoll's
(the ranks record the groups they create; each test here checks that the
default groups were pycoll's).

Each (world size, mode) runs its tests in one worker (one torch import, one
forkserver for the ranks); each test is bounded by torch's own timeout
(TORCH_TIMEOUT) and the module by BUDGET seconds in all: a test left unrun when
the budget is spent fails.
"""

from __future__ import annotations

import sys
import time

import paths
import pytest

sys.path.insert(0, str(paths.BENCH / "torch_backend"))

import torch_suite  # noqa: E402 - the package benchmarks/torch_backend/torch_suite/: its runner, no torch import

TORCH_TIMEOUT = 20.0  # seconds per suite test (these take 2 s at most with gloo)
BUDGET = 85.0  # seconds for the whole module

# Tests the suite runs for any backend name (not gated). (The *_group variants, on ranks
# [1, 2], are skip_if_small_worldsize: they run with 8 ranks or more only.)
PLAIN: dict[int, list[str]] = {
    2: [
        # all_gather_coalesced (not in DistTestCases.skip_collective["allgather_coalesced"])
        "test_all_gather_coalesced_simple",
        "test_all_gather_coalesced_complex",
        "test_all_gather_coalesced_full_group",
        "test_all_gather_coalesced_with_empty",
        # recv and irecv from any source, the sender read from the return / work._source_rank()
        "test_send_recv_any_source",
    ],
    3: [
        "test_all_gather_coalesced_simple",
        "test_all_gather_coalesced_full_group",
        "test_send_recv_any_source",  # two senders per receiver
    ],
}

# Tests the suite skips for every backend name but gloo's: run with the gate bypassed.
BYPASS: dict[int, list[str]] = {
    2: [
        # coalesced all-reduce (require_backend_is_available({"gloo"}))
        "test_all_reduce_coalesced_sum",
        "test_all_reduce_coalesced_product",
        "test_all_reduce_coalesced_min",
        "test_all_reduce_coalesced_max",
        "test_all_reduce_coalesced_full_group_sum",
        # object collectives
        "test_all_gather_object_default_pg",
        "test_all_gather_object_subgroup",
        "test_scatter_object_list",
        # batch_isend_irecv ("GLOO Batch Send Recv CPU")
        "test_batch_isend_irecv_gloo",
        "test_batch_isend_irecv_gloo_tags",
        # sparse all-reduce ("Only Gloo backend supports sparse all reduce")
        "test_sparse_all_reduce_sum",
        # timeouts ("Only gloo backend supports timeouts"): barrier on rank 0 alone raises
        # after the group's timeout
        "test_barrier_timeout_global",
        "test_barrier_timeout_full_group",
        # ProcessGroup.allreduce(tensors) with no options: get_future and DDP comm hooks (the
        # suite has no pg.allreduce(tensors, op) call; dist.all_reduce passes options)
        "test_get_future",
        "test_accumulate_gradients_no_sync_allreduce_hook",
        "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    ],
    3: [
        "test_all_reduce_coalesced_sum",
        "test_all_reduce_coalesced_full_group_max",
        "test_all_gather_object_default_pg",
        "test_scatter_object_list",
        "test_batch_isend_irecv_gloo",
        "test_sparse_all_reduce_sum",
        "test_barrier_timeout_full_group",
        "test_get_future",
    ],
}

CASES = [
    pytest.param(ws, mode, name, id=f"{name}-{ws}ranks-{mode}")
    for mode, table in (("plain", PLAIN), ("bypass", BYPASS))
    for ws, names in table.items()
    for name in names
]

_deadline: list[float] = []
_runs: dict[tuple[int, str], dict[str, torch_suite.TestResult]] = {}


def _results(ws: int, mode: str) -> dict[str, torch_suite.TestResult]:
    """The results of every test of (ws, mode), run together the first time one is asked."""
    if not _deadline:
        _deadline.append(time.time() + BUDGET)
    key = (ws, mode)
    if key not in _runs:
        tests = (PLAIN if mode == "plain" else BYPASS)[ws]
        _runs[key] = torch_suite.run_tests(
            "pycoll",
            ws,
            tests,
            bypass_gate=mode == "bypass",
            timeout=TORCH_TIMEOUT,
            grace=10.0,
            deadline=_deadline[0],
        )
    return _runs[key]


@pytest.mark.timeout(BUDGET + 30)
@pytest.mark.parametrize("ws,mode,name", CASES)
def test_torch_suite(ws: int, mode: str, name: str) -> None:
    res = _results(ws, mode)[name]
    detail = "\n".join(res.summary) or res.reason
    assert res.outcome == "pass", (
        f"{name} with {ws} ranks ({mode}): {res.outcome}\n{detail}\n\n{res.error[-4000:]}"
    )
    # "default <backend name> <class>" per default group the ranks created
    defaults = {b.split()[1] for b in res.pg_backends if b.startswith("default ")}
    assert defaults == {"pycoll"}, res.pg_backends
