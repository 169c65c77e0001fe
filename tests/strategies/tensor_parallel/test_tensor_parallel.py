"""Tensor-parallel layers against the plain torch layers, forward and every
gradient, at tp = 1..4, with and without sequence parallelism.

Two kinds of data:
- small integers in float32: every product and sum is exact in any order, so
  the parallel layers must match nn.Linear / nn.Embedding bitwise (this checks
  which slices go where and which sums are taken, with no tolerance);
- random float32 against a float64 reference (rtol 1e-5, atol 1e-6): a
  row-parallel sum adds tp partial dot products where one process adds one,
  so the last bits differ; float32 keeps ~7 digits of the 8-term sums here.
The cross-entropy is checked in float64 against F.cross_entropy (1e-12: exp
and log round differently when the vocabulary is summed in tp pieces).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pycollectives as pc
from pycollectives.strategies.parallel_dims import ParallelDims
from pycollectives.strategies.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

B, T, IN, OUT = 2, 12, 8, 12  # T, OUT divisible by 1, 2, 3 and 4


def data(kind: str, *shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank: small integers (float32) or normal float32."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ints":
        return torch.randint(-3, 4, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def check(bad: list[str], what: str, got: torch.Tensor | None, want: torch.Tensor, kind: str):
    """Appends to `bad` unless got == want (ints: bitwise; random: float64 tolerance)."""
    if got is None:
        bad.append(f"{what}: no gradient")
    elif kind == "ints":
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(f"{what}: differs (max {(got.double() - want.double()).abs().max():.3g})")
    elif not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6):
        bad.append(f"{what}: max |diff| {(got.double() - want.double()).abs().max():.3g}")


def sl(t: torch.Tensor, dim: int, comm: pc.Communicator) -> torch.Tensor:
    """This rank's slice of `t` along `dim`."""
    return t.chunk(comm.world_size, dim)[comm.rank]


def reference(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, kind: str) -> dict:
    """Output and gradients of the plain layer (in float64 for random data)."""
    if kind != "ints":
        layer = layer.double()
        x = x.double() if x.is_floating_point() else x
        dy = dy.double()
    x = x.clone().requires_grad_(x.is_floating_point())
    y = layer(x)
    y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, **grads}


def run_column(comm, kind, sp, overlap, gather, bad):
    full = nn.Linear(IN, OUT)
    with torch.no_grad():
        full.weight.copy_(data(kind, OUT, IN, seed=1))
        full.bias.copy_(data(kind, OUT, seed=2))
    x, dy = data(kind, B, T, IN, seed=3), data(kind, B, T, OUT, seed=4)
    layer = ColumnParallelLinear.from_linear(
        full, comm, sequence_parallel=sp, overlap=overlap, gather_output=gather
    )
    ref = reference(full, x, dy, kind)
    xin = (sl(x, 1, comm) if sp else x).clone().requires_grad_()
    y = layer(xin)
    y.backward(dy if gather else sl(dy, 2, comm))
    tag = f"column sp={sp} overlap={overlap} gather={gather}"
    check(bad, f"{tag} y", y, ref["y"] if gather else sl(ref["y"], 2, comm), kind)
    check(bad, f"{tag} dx", xin.grad, sl(ref["dx"], 1, comm) if sp else ref["dx"], kind)
    check(bad, f"{tag} dW", layer.weight.grad, sl(ref["weight"], 0, comm), kind)
    check(bad, f"{tag} db", layer.bias.grad, sl(ref["bias"], 0, comm), kind)


def run_row(comm, kind, sp, parallel_input, bad):
    full = nn.Linear(OUT, IN)
    with torch.no_grad():
        full.weight.copy_(data(kind, IN, OUT, seed=5))
        full.bias.copy_(data(kind, IN, seed=6))
    x, dy = data(kind, B, T, OUT, seed=7), data(kind, B, T, IN, seed=8)
    layer = RowParallelLinear.from_linear(
        full, comm, sequence_parallel=sp, input_is_parallel=parallel_input
    )
    ref = reference(full, x, dy, kind)
    xin = (sl(x, 2, comm) if parallel_input else x).clone().requires_grad_()
    y = layer(xin)
    y.backward(sl(dy, 1, comm) if sp else dy)
    tag = f"row sp={sp} parallel_input={parallel_input}"
    check(bad, f"{tag} y", y, sl(ref["y"], 1, comm) if sp else ref["y"], kind)
    check(bad, f"{tag} dx", xin.grad, sl(ref["dx"], 2, comm) if parallel_input else ref["dx"], kind)
    check(bad, f"{tag} dW", layer.weight.grad, sl(ref["weight"], 1, comm), kind)
    check(bad, f"{tag} db", layer.bias.grad, ref["bias"], kind)


def run_embedding(comm, kind, sp, bad):
    full = nn.Embedding(OUT, IN)
    with torch.no_grad():
        full.weight.copy_(data(kind, OUT, IN, seed=9))
    g = torch.Generator().manual_seed(10)
    idx, dy = torch.randint(0, OUT, (B, T), generator=g), data(kind, B, T, IN, seed=11)
    layer = VocabParallelEmbedding.from_embedding(full, comm, sequence_parallel=sp)
    ref = reference(full, idx, dy, kind)
    y = layer(idx)
    y.backward(sl(dy, 1, comm) if sp else dy)
    check(bad, f"embedding sp={sp} y", y, sl(ref["y"], 1, comm) if sp else ref["y"], kind)
    check(bad, f"embedding sp={sp} dW", layer.weight.grad, sl(ref["weight"], 0, comm), kind)


def job_layers(comm: pc.Communicator) -> list[str]:
    bad: list[str] = []
    with ParallelDims(comm, tp=comm.world_size) as dims:
        tp = dims.tp_comm
        for kind in ("ints", "random"):
            for sp in (False, True):
                for overlap in (True, False):
                    run_column(tp, kind, sp, overlap, False, bad)
                run_row(tp, kind, sp, True, bad)
                run_embedding(tp, kind, sp, bad)
            run_column(tp, kind, False, True, True, bad)
            run_row(tp, kind, False, False, bad)
    return bad


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_layers_match_torch(pool, tp):
    for r, bad in enumerate(pool(tp).run(job_layers, timeout=120)):
        assert not bad, f"rank {r}: {bad}"


def job_cross_entropy(comm: pc.Communicator) -> list[str]:
    bad: list[str] = []
    n, vocab = 10, 48
    g = torch.Generator().manual_seed(0)
    logits64 = 3 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[3] = -100  # ignored
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for reduction in ("mean", "sum", "none"):
            ref_in = logits64.clone().requires_grad_()
            ref = F.cross_entropy(ref_in, targets, reduction=reduction)
            dl = torch.linspace(0.5, 1.5, n, dtype=torch.float64) if reduction == "none" else None
            ref.backward(dl)
            start = comm.rank * vocab // comm.world_size
            mine = sl(logits64, 1, comm).to(dtype).requires_grad_()
            before = comm.stats()
            loss = vocab_parallel_cross_entropy(mine, targets, comm, start, reduction=reduction)
            after = comm.stats()
            loss.backward(None if dl is None else dl.to(dtype))
            tag = f"{dtype} {reduction}"
            if not torch.allclose(loss.double(), ref, rtol=tol, atol=tol):
                bad.append(f"{tag} loss {loss} != {ref}")
            if not torch.allclose(mine.grad.double(), sl(ref_in.grad, 1, comm), rtol=tol, atol=tol):
                bad.append(
                    f"{tag} grad max diff {(mine.grad.double() - sl(ref_in.grad, 1, comm)).abs().max()}"
                )
            if comm.world_size > 1:  # 2 all-reduces of 1 and 2 numbers per token, nothing else
                calls = {k: after[k]["calls"] - before.get(k, {}).get("calls", 0) for k in after}
                sent = after["all_reduce"]["bytes_sent"] - before.get("all_reduce", {}).get(
                    "bytes_sent", 0
                )
                if {k: c for k, c in calls.items() if c} != {"all_reduce": 2}:
                    bad.append(f"{tag}: communicated {calls}")
                if sent > 4 * 3 * n * loss.element_size():
                    bad.append(f"{tag}: sent {sent} bytes: more than 3 numbers per token")
    return bad


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_vocab_parallel_cross_entropy(pool, tp):
    for r, bad in enumerate(pool(tp).run(job_cross_entropy, timeout=60)):
        assert not bad, f"rank {r}: {bad}"
