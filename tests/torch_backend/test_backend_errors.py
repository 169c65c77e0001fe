"""The torch.distributed backend "pycoll": its errors (bad arguments, timeouts, a
dead peer carried by a Work), asynchronous Works, "cpu:pycoll,cuda:pycoll",
and the README's torch DDP example under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import paths
import torch
from spawn import free_port, run

ROOT = paths.ROOT


# -- errors ------------------------------------------------------------------------
def _misc(rank: int, n: int) -> dict[str, Any]:
    """ "cpu:pycoll,cuda:pycoll"; bad arguments; asynchronous Works; isend/irecv
    of large tensors issued send-first on both ranks; a late peer's timeout."""
    import datetime
    import time

    import torch.distributed as dist

    import pycollectives  # noqa: F401

    dist.init_process_group(
        "cpu:pycoll,cuda:pycoll", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=2)
    )
    res: dict[str, Any] = {"backend": dist.get_backend()}

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
            res[key] = ""
        except Exception as e:  # noqa: BLE001 - returned to the test
            res[key] = f"{type(e).__name__}: {e}"

    i32 = torch.ones(2, dtype=torch.int32)
    catch("bxor", lambda: dist.all_reduce(i32, op=dist.ReduceOp.BXOR))
    catch("bool", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)))
    catch("gather_size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)))
    catch(
        "splits",
        lambda: dist.all_to_all_single(torch.empty(4), torch.empty(4), [1, 1], [4, 4]),
    )
    catch("recv_self", lambda: dist.recv(torch.empty(2), rank))
    # all_gather_coalesced: one Work, its future's value every output list
    # (torch's layout: lists[r][i] is rank r's ins[i])
    lists = [[torch.empty(3), torch.empty(2, 2)] for _ in range(n)]
    ins = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)]
    got = dist.all_gather_coalesced(lists, ins, async_op=True).wait()
    res["gather_coalesced"] = [[t.flatten().tolist() for t in lst] for lst in got]
    bad_lists = [[torch.empty(3)] for _ in range(n)]
    catch("gather_coalesced_bad", lambda: dist.all_gather_coalesced(bad_lists, ins))
    # every form of the op torch accepts; one that is no op at all
    pg = dist.distributed_c10d._get_default_group()
    catch("op_int", lambda: pg.allreduce([torch.ones(2)], 3))
    catch("op_bad", lambda: pg.allreduce([torch.ones(2)], op="max"))
    # sparse: SUM only, other layouts refused, naming the layout
    sp = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3,))
    catch("sparse_max", lambda: dist.all_reduce(sp, op=dist.ReduceOp.MAX))
    catch("sparse_csr", lambda: dist.all_reduce(torch.eye(3).to_sparse_csr()))
    catch("sparse_broadcast", lambda: dist.broadcast(sp, 0))
    # a per-call timeout: rank 0 alone in a barrier of a group of its own
    sub = dist.new_group(timeout=datetime.timedelta(seconds=300))
    if rank == 0:
        catch(
            "barrier_timeout", lambda: dist.barrier(sub, timeout=datetime.timedelta(seconds=0.001))
        )
    dist.destroy_process_group(sub)
    # monitored_barrier on the group itself (torch's dist.monitored_barrier is gloo-only)
    pg.monitored_barrier(datetime.timedelta(seconds=20))
    pg.monitored_barrier(datetime.timedelta(seconds=20), wait_all_ranks=True)
    if rank == 0:
        catch("mb_zero", lambda: pg.monitored_barrier(datetime.timedelta(0)))
    sub = dist.new_group()
    if rank == 0:
        catch("mb_late", lambda: sub.monitored_barrier(datetime.timedelta(seconds=0.3)))
    dist.destroy_process_group(sub)
    # Asynchronous: the call returns while the peer is still away.
    if rank == 1:
        time.sleep(0.5)
    t = torch.full((1000,), float(rank + 1))
    t0 = time.perf_counter()
    w = dist.all_reduce(t, async_op=True)
    res["issue_s"] = time.perf_counter() - t0
    res["done_at_issue"] = w.is_completed()
    if rank == 0:
        catch("short_wait", lambda: w.wait(datetime.timedelta(milliseconds=50)))
    w.wait()
    res["async_value"] = float(t[0])
    # isend + irecv of 4 MiB on both ranks, sends first: deferred into one batch.
    big = torch.full((1 << 20,), float(rank))
    got = torch.empty(1 << 20)
    peer = 1 - rank
    works = [dist.isend(big, peer), dist.irecv(got, peer)]
    for w in works:
        w.wait()
    res["isend_irecv"] = float(got[0]) == float(peer) and bool(torch.all(got == got[0]))
    # A fire-and-forget isend that is not waited on still goes out (flush timer).
    small = torch.arange(5.0)
    if rank == 0:
        w = dist.isend(small, 1)
        time.sleep(1.0)
        w.wait()
    else:
        t0 = time.perf_counter()
        dist.recv(small := torch.empty(5), 0)
        res["unwaited_isend_s"] = time.perf_counter() - t0
        res["unwaited_isend_ok"] = small.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # A late peer: rank 0's Work carries the timeout (2 s) instead of hanging.
    if rank == 0:
        catch("late", lambda: dist.all_reduce(torch.ones(2), async_op=True).wait())
    else:
        time.sleep(3)
    dist.destroy_process_group()
    return res


def test_backend_errors_async_and_p2p() -> None:
    for rank, res in enumerate(run(_misc, 2, timeout=60)):
        assert res["backend"] == "cpu:pycoll,cuda:pycoll", res
        assert "ValueError" in res["bxor"] and f"rank {rank}: allreduce" in res["bxor"], res
        assert "TypeError" in res["bool"] and "bool" in res["bool"], res
        assert f"rank {rank}: all_gather" in res["gather_size"], res
        assert "input_split_sizes" in res["splits"] and f"rank {rank}" in res["splits"], res
        assert "ValueError" in res["recv_self"] and "this rank" in res["recv_self"], res
        assert res["gather_coalesced"] == [[[float(q)] * 3, [10.0 + q] * 4] for q in range(2)], res
        assert "output_lists[0] must hold 2 tensors" in res["gather_coalesced_bad"], res
        assert "TypeError" in res["op_int"] and f"rank {rank}: allreduce" in res["op_int"], res
        assert "TypeError" in res["op_bad"] and "'max'" in res["op_bad"], res
        assert "ValueError" in res["sparse_max"] and "only SUM" in res["sparse_max"], res
        assert "torch.sparse_csr" in res["sparse_csr"] and f"rank {rank}" in res["sparse_csr"]
        assert "torch.sparse_coo" in res["sparse_broadcast"], res
        assert "broadcast" in res["sparse_broadcast"], res
        if rank == 0:
            assert "Rank 0 timed out in monitoredBarrier" in res["mb_zero"], res
            assert "Rank 1 failed to pass monitoredBarrier in 300 ms" in res["mb_late"], res
            assert "Timed out waiting 1ms" in res["barrier_timeout"], res
            assert "CollectiveTimeout" in res["barrier_timeout"], res
        assert res["async_value"] == 3.0 and res["isend_irecv"] is True, res
        if rank == 1:  # rank 0 waited on its isend only 1 s later
            assert res["unwaited_isend_ok"] and res["unwaited_isend_s"] < 0.8, res
        if rank == 0:  # rank 1 arrived 0.5 s later
            assert res["done_at_issue"] is False and res["issue_s"] < 0.25, res
            assert "TimeoutError" in res["short_wait"] and "rank 0: wait" in res["short_wait"]
            assert "Timed out waiting 50ms" in res["short_wait"], res
            assert "CollectiveTimeout" in res["late"] and "rank 1" in res["late"], res


def _peer_dies(rank: int, n: int) -> str:
    import torch.distributed as dist

    import pycollectives  # noqa: F401

    dist.init_process_group("pycoll", rank=rank, world_size=n)
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        os._exit(3)
    w = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    return ""


def test_work_carries_peer_failure() -> None:
    res = run(_peer_dies, 2, timeout=60, expect_exit={1: 3})
    assert "rank 1" in res[0] and ("PeerFailure" in res[0] or "died" in res[0]), res[0]


# -- the README example ------------------------------------------------------------
def test_torch_ddp_example_under_torchrun() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(ROOT / "examples" / "torch_ddp.py")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pycoll: 2 ranks" in p.stdout, p.stdout
