"""The torch.distributed backend "pycoll" on the tensors frameworks hand it:
tensors made and reduced under torch.inference_mode() (Lightning validates in
it), and torch.nn.Parameters and views of them (written outside autograd, as
c10d's collectives write). Every collective whose result is copied back into
the caller's tensor (a list output, a non-contiguous view) runs synchronously
and with async_op=True; the results must be bitwise equal to gloo's on contiguous
tensors (2 ranks: every sum is a + b on both backends)."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from spawn import run

MODES = ("plain", "inference", "param")
# gloo's reference runs on contiguous tensors: gloo 2.13's all_reduce of a column
# view t[:, 1] of a (6, 2) tensor sums only its first 3 elements.
REFERENCE = "contig"


def _ops(n: int, rank: int) -> dict[str, Callable]:
    """name -> op(mk, rnd, async_op) returning the tensors the op wrote. mk(k)
    makes a non-contiguous 1-D tensor of k elements in the mode's kind (a column
    of a (k, 2) tensor: an inference tensor, a view of a Parameter); rnd(k)
    random data of this rank."""
    import torch.distributed as dist

    def done(w: Any) -> None:  # a Work (async_op=True); None or recv's sender rank
        if hasattr(w, "wait"):
            w.wait()

    def all_reduce(mk: Callable, rnd: Callable, a: bool) -> list:
        t = mk(6, rnd(6))
        done(dist.all_reduce(t, async_op=a))
        return [t]

    def broadcast(mk: Callable, rnd: Callable, a: bool) -> list:
        t = mk(5, rnd(5))
        done(dist.broadcast(t, 0, async_op=a))
        return [t]

    def reduce(mk: Callable, rnd: Callable, a: bool) -> list:
        t = mk(4, rnd(4))
        done(dist.reduce(t, 1, async_op=a))
        return [t] if rank == 1 else []

    def all_gather(mk: Callable, rnd: Callable, a: bool) -> list:
        outs = [mk(3) for _ in range(n)]
        done(dist.all_gather(outs, mk(3, rnd(3)), async_op=a))
        return outs

    def reduce_scatter(mk: Callable, rnd: Callable, a: bool) -> list:
        out = mk(3)
        done(dist.reduce_scatter(out, [mk(3, rnd(3)) for _ in range(n)], async_op=a))
        return [out]

    def reduce_scatter_tensor(mk: Callable, rnd: Callable, a: bool) -> list:
        out = mk(2)
        done(dist.reduce_scatter_tensor(out, mk(2 * n, rnd(2 * n)), async_op=a))
        return [out]

    def all_to_all_single(mk: Callable, rnd: Callable, a: bool) -> list:
        out = mk(2 * n)
        done(dist.all_to_all_single(out, mk(2 * n, rnd(2 * n)), async_op=a))
        return [out]

    def all_to_all(mk: Callable, rnd: Callable, a: bool) -> list:
        outs = [mk(2) for _ in range(n)]
        done(dist.all_to_all(outs, [mk(2, rnd(2)) for _ in range(n)], async_op=a))
        return outs

    def gather(mk: Callable, rnd: Callable, a: bool) -> list:
        outs = [mk(3) for _ in range(n)] if rank == 0 else None
        done(dist.gather(mk(3, rnd(3)), outs, dst=0, async_op=a))
        return outs or []

    def scatter(mk: Callable, rnd: Callable, a: bool) -> list:
        out = mk(3)
        ins = [mk(3, rnd(3)) for _ in range(n)] if rank == 0 else None
        done(dist.scatter(out, ins, src=0, async_op=a))
        return [out]

    def send_recv(mk: Callable, rnd: Callable, a: bool) -> list:
        t = mk(4, rnd(4))
        if rank == 0:
            done(dist.isend(t, 1) if a else dist.send(t, 1))
            return []
        done(dist.irecv(t, 0) if a else dist.recv(t, 0))
        return [t]

    return {f.__name__: f for f in (all_reduce, broadcast, reduce, all_gather, reduce_scatter,
            reduce_scatter_tensor, all_to_all_single, all_to_all, gather, scatter, send_recv)}  # fmt: skip


def _maker(mode: str) -> Callable:
    """mk(k, data=None): a non-contiguous k-element tensor holding `data` (zeros
    if None) as a column of a (k, 2) tensor: plain, made under inference mode,
    or of a Parameter (the view of a leaf that requires grad); for the
    reference, a contiguous tensor."""

    def mk(k: int, data: torch.Tensor | None = None) -> torch.Tensor:
        if mode == REFERENCE:
            return torch.zeros(k) if data is None else data.clone()
        base = torch.zeros(k, 2)
        if data is not None:
            base[:, 1] = data
        if mode == "param":
            base = torch.nn.Parameter(base)
        return base[:, 1]

    return mk


def _run_all(rank: int, n: int, backend: str) -> dict[str, Any]:
    """Every op in every mode (gloo: the reference only), sync and async:
    {mode/sync|async/op: tensors or error}."""
    out: dict[str, Any] = {}
    for mode in MODES if backend == "pycoll" else (REFERENCE,):
        for a in (False, True):
            g = torch.Generator().manual_seed(100 + rank)  # the same data in every run

            def rnd(k: int, g: torch.Generator = g) -> torch.Tensor:
                return torch.randn(k, generator=g)

            for name, op in _ops(n, rank).items():
                ctx = torch.inference_mode() if mode == "inference" else contextlib.nullcontext()
                key = f"{mode}/{'async' if a else 'sync'}/{name}"
                try:
                    with ctx:
                        out[key] = [t.detach().clone() for t in op(_maker(mode), rnd, a)]
                except Exception as e:  # noqa: BLE001 - compared by the test
                    out[key] = f"{type(e).__name__}: {e}"
    # A contiguous Parameter, its transpose, and PREMUL_SUM on a Parameter (the
    # scaling is an in-place write too; gloo has no PREMUL_SUM: x * f, then SUM).
    import torch.distributed as dist

    for a in (False, True):
        key = f"param/{'async' if a else 'sync'}"
        try:
            g = torch.Generator().manual_seed(7 + rank)
            p = torch.nn.Parameter(torch.randn(3, 4, generator=g))
            w = dist.all_reduce(p.t(), async_op=a)
            _ = w.wait() if a else None
            q = torch.nn.Parameter(torch.randn(5, generator=g))
            w = dist.broadcast(q, 1, async_op=a)
            _ = w.wait() if a else None
            r = torch.nn.Parameter(torch.randn(4, generator=g))
            if backend == "pycoll":
                w = dist.all_reduce(r, op=dist._make_nccl_premul_sum(0.25), async_op=a)
            else:
                with torch.no_grad():
                    r.mul_(0.25)
                w = dist.all_reduce(r, async_op=a)
            _ = w.wait() if a else None
            out[f"{key}/whole"] = [p.detach().clone(), q.detach().clone(), r.detach().clone()]
            out[f"{key}/requires_grad"] = [p.requires_grad, q.requires_grad, p.grad_fn is None]
        except Exception as e:  # noqa: BLE001 - compared by the test
            out[f"{key}/whole"] = f"{type(e).__name__}: {e}"
    return out


def _job(rank: int, n: int) -> bytes:
    """_run_all under gloo, then under pycoll, in this rank's process."""
    import torch.distributed as dist

    import pycollectives  # noqa: F401 - registers "pycoll"

    warnings.filterwarnings("ignore")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0,
        wait_for_workers=False,
    )  # fmt: skip
    results = {}
    for backend in ("gloo", "pycoll"):
        dist.init_process_group(
            backend, store=dist.PrefixStore(backend, store), rank=rank, world_size=n
        )
        results[backend] = _run_all(rank, n, backend)
        dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


_cache: list = []


def _results() -> list[dict[str, dict[str, Any]]]:
    if not _cache:
        _cache.extend(torch.load(io.BytesIO(b), weights_only=False) for b in run(_job, 2))
    return _cache


OPS = list(_ops(2, 0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ("sync", "async"))
def test_ops_write_any_tensor_like_gloo(mode: str, kind: str) -> None:
    """Each op, in `mode`, equals gloo's synchronous run on contiguous tensors bitwise."""
    failed = []
    for rank, res in enumerate(_results()):
        gloo, pyc = res["gloo"], res["pycoll"]
        for op in OPS:
            want, got = gloo[f"{REFERENCE}/sync/{op}"], pyc[f"{mode}/{kind}/{op}"]
            assert not isinstance(want, str), f"rank {rank}: gloo {op}: {want}"
            if isinstance(got, str):
                failed.append(f"rank {rank} {op}: {got}")
                continue
            assert len(got) == len(want), f"rank {rank} {op}"
            for x, y in zip(got, want, strict=True):
                assert torch.equal(x, y), f"rank {rank} {mode}/{kind}/{op}: {x} vs gloo {y}"
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("kind", ("sync", "async"))
def test_whole_parameters_like_gloo(kind: str) -> None:
    """all_reduce(p.t()), broadcast(p) and PREMUL_SUM on Parameters: gloo's
    values, and the Parameters stay leaves that require grad."""
    for rank, res in enumerate(_results()):
        gloo, pyc = res["gloo"], res["pycoll"]
        got = pyc[f"param/{kind}/whole"]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        want = gloo[f"param/{kind}/whole"]
        assert not isinstance(want, str), f"rank {rank}: gloo: {want}"
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y), f"rank {rank}: {x} vs gloo {y}"
        assert pyc[f"param/{kind}/requires_grad"] == [True, True, True]
