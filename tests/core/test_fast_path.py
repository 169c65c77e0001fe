"""The synchronous fast path (csrc/bindings/fast_path.cc) against the Python
path: whatever kind of buffer arrives, the result is the same, and anything the
fast path declines still gets the Python path's checks and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pycollectives as pc


class Tagged(torch.Tensor):
    """A tensor subclass: the fast path must look its attributes up normally."""


def _kinds(values: list[float]) -> dict[str, object]:
    base = torch.tensor(values, dtype=torch.float32)
    return {
        "tensor": base.clone(),
        "parameter": torch.nn.Parameter(base.clone(), requires_grad=False),
        "subclass": base.clone().as_subclass(Tagged),
        "offset view": torch.cat([torch.zeros(3), base])[3:],
        "numpy": base.numpy().copy(),
    }


def job_buffer_kinds(comm: pc.Communicator) -> list[str]:
    """Every collective of the fast path on every kind of buffer, checked exactly."""
    n, r, bad = comm.world_size, comm.rank, []
    vals = [float(r + 1), float(10 * (r + 1)), -1.0]
    total = [sum(float(q + 1) * k for q in range(n)) for k in (1, 10)] + [-float(n)]
    for name, buf in _kinds(vals).items():
        comm.all_reduce(buf)
        if list(np.asarray(buf)) != total:
            bad.append(f"all_reduce on {name}: {list(np.asarray(buf))} != {total}")
    for name, inp in _kinds([float(r * n + b) for b in range(n)]).items():
        out = _kinds([-7.0])[name]
        comm.reduce_scatter(out, inp)
        want = float(sum(q * n + r for q in range(n)))
        if float(np.asarray(out)[0]) != want:
            bad.append(f"reduce_scatter on {name}: {np.asarray(out)} != {want}")
    for name, inp in _kinds([float(r)]).items():
        out = _kinds([-7.0] * n)[name]
        comm.all_gather(out, inp)
        if list(np.asarray(out)) != [float(q) for q in range(n)]:
            bad.append(f"all_gather on {name}: {list(np.asarray(out))}")
    for name, buf in _kinds([float(r + 1), -2.0]).items():
        comm.broadcast(buf, n - 1)
        if list(np.asarray(buf)) != [float(n), -2.0]:
            bad.append(f"broadcast on {name}: {list(np.asarray(buf))}")
    for name, buf in _kinds([float(r + 1), -2.0]).items():
        comm.reduce(buf, 0, pc.ReduceOp.MAX)
        want = [float(n) if r == 0 else float(r + 1), -2.0]
        if list(np.asarray(buf)) != want:
            bad.append(f"reduce on {name}: {list(np.asarray(buf))} != {want}")
    for name, inp in _kinds([float(10 * r + b) for b in range(n)]).items():
        out = _kinds([-7.0] * n)[name]
        comm.all_to_all(out, inp)
        if list(np.asarray(out)) != [float(10 * q + r) for q in range(n)]:
            bad.append(f"all_to_all on {name}: {list(np.asarray(out))}")
    for name, inp in _kinds([float(r), 0.5]).items():
        out, nxt, prv = _kinds([-7.0, -7.0])[name], (r + 1) % n, (r - 1) % n
        comm.batch_p2p([("send", inp, nxt), ("recv", out, prv)])
        if list(np.asarray(out)) != [float(prv), 0.5]:
            bad.append(f"batch_p2p on {name}: {list(np.asarray(out))}")
        if n > 1:
            out = _kinds([-7.0, -7.0])[name]
            if r % 2 == 0:  # every rank sends before it receives, except the odd ones
                comm.send(inp, nxt)
                comm.recv(out, prv)
            else:
                comm.recv(out, prv)
                comm.send(inp, nxt)
            if list(np.asarray(out)) != [float(prv), 0.5]:
                bad.append(f"send/recv on {name}: {list(np.asarray(out))}")
    return bad


def job_declined(comm: pc.Communicator) -> list[str]:
    """Buffers and arguments the fast path declines still get the Python path's
    errors (naming the argument), and the communicator stays usable."""
    bad = []
    cases = [
        ("non-contiguous", lambda: comm.all_reduce(torch.zeros(4, 2).t()), "contiguous"),
        ("complex dtype", lambda: comm.all_reduce(torch.zeros(2, dtype=torch.complex64)), "dtype"),
        ("op", lambda: comm.all_reduce(torch.zeros(2), op=17), "op"),
        (
            "mixed dtypes",
            lambda: comm.all_gather(
                torch.zeros(comm.world_size), torch.zeros(1, dtype=torch.int32)
            ),
            "dtype",
        ),
        (
            "wrong size",
            lambda: comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * comm.world_size + 1)),
            "input",
        ),
        ("src", lambda: comm.broadcast(torch.zeros(2), comm.world_size), "src"),
        ("dst", lambda: comm.reduce(torch.zeros(2), -1), "dst"),
        ("send to self", lambda: comm.send(torch.zeros(2), comm.rank), "dst"),
        ("recv from self", lambda: comm.recv(torch.zeros(2), comm.rank), "src"),
        (
            "all_to_all sizes",
            lambda: comm.all_to_all(torch.zeros(comm.world_size), torch.zeros(2 * comm.world_size)),
            "input",
        ),
        (
            "all_to_all in place",
            lambda: comm.all_to_all(t2 := torch.zeros(comm.world_size), t2),
            "overlap",
        ),
        ("batch kind", lambda: comm.batch_p2p([("sned", torch.zeros(1), 0)]), "ops[0]"),
        ("batch peer", lambda: comm.batch_p2p([("send", torch.zeros(1), -1)]), "ops[0]"),
        ("batch unpaired", lambda: comm.batch_p2p([("send", torch.zeros(1), comm.rank)]), "pair"),
        # Negated views store the negation of their values.
        ("negated view", lambda: comm.all_reduce(torch._neg_view(torch.ones(2))), "negated"),
        (
            "negated imag",
            lambda: comm.all_gather(
                torch.zeros(comm.world_size), torch.ones(1, dtype=torch.complex64).conj().imag
            ),
            "negated",
        ),
    ]
    for what, call, word in cases:
        try:
            call()
            bad.append(f"{what}: no error")
        except (ValueError, TypeError) as e:
            if word not in str(e) or f"rank {comm.rank}" not in str(e):
                bad.append(f"{what}: {type(e).__name__}: {e}")
    t = torch.ones(3)
    comm.all_reduce(t)
    if t.tolist() != [float(comm.world_size)] * 3:
        bad.append(f"all_reduce after the errors: {t.tolist()}")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("job", [job_buffer_kinds, job_declined], ids=lambda j: j.__name__[4:])
def test_fast_path(pool, job, world_size):
    results = pool(world_size).run(job, timeout=120)
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad)


def test_fast_path_arguments(tmp_path):
    """FastPath's methods check their argument count like Python functions, and
    fast_path() takes only a core communicator."""
    with pytest.raises(TypeError, match="Communicator"):
        pc._C.fast_path(object())
    with pytest.raises(TypeError):
        pc._C.FastPath()  # only fast_path() makes one, with its communicator
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    with pc.init(rank=0, world_size=1, store=store) as comm:
        fast = comm._fast
        with pytest.raises(TypeError, match="all_reduce takes 2 arguments"):
            fast.all_reduce(torch.ones(1))
        with pytest.raises(TypeError, match="all_gather takes 2 arguments"):
            fast.all_gather()
        assert fast.all_reduce(torch.ones(1), pc.ReduceOp.SUM) is True
        assert fast.all_reduce(torch.ones(1), "sum") is False  # declined: the Python path decides
        # Every method takes the tensors it can describe, and declines what the
        # Python path must check (here: ranks out of range, or this rank as the peer).
        x, y = torch.ones(2), torch.zeros(2)
        assert fast.broadcast(x, 0) is True
        assert fast.broadcast(x, 1) is False
        assert fast.reduce(x, 0, pc.ReduceOp.SUM) is True
        assert fast.reduce(x, True, pc.ReduceOp.SUM) is False
        assert fast.all_to_all(y, x) is True
        assert fast.all_to_all(x, x) is False  # overlapping
        assert fast.batch_p2p([("send", x, 0), ("recv", y, 0)]) is True
        assert fast.batch_p2p((("recv", y, 0), ("send", x, 0))) is True
        assert fast.batch_p2p([["send", x, 0]]) is False
        assert fast.batch_p2p(iter([])) is False
        assert fast.send(x, 0) is False
        assert fast.recv(x, 0) is False
        with pytest.raises(TypeError, match="batch_p2p takes 1 arguments"):
            fast.batch_p2p()


def _view_cases() -> dict[str, torch.Tensor]:
    x = torch.arange(24.0).reshape(2, 3, 4)
    cases = {
        "1-d": torch.ones(5),
        "3-d": x,
        "0-d": torch.tensor(3.0),
        "empty": torch.empty(0),
        "empty 2-d": torch.empty(0, 3),
        "empty non-contiguous": torch.empty(3, 0).t(),
        "offset view": x[1],
        "size-1 dim, odd stride": torch.ones(3, 1)[:, :1],
        "column": torch.ones(4, 4)[:, 1:2],
        "transposed": x[0].t(),
        "step": torch.arange(10.0)[::2],
        "expanded": torch.ones(1, 3).expand(2, 3),
        "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "requires_grad": torch.ones(3, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.ones(3)),
        "subclass": torch.ones(3).as_subclass(Tagged),
        "negated": torch._neg_view(torch.ones(3)),
        "negated imag": torch.ones(1, dtype=torch.complex64).conj().imag,
        "negated subclass": torch._neg_view(torch.ones(3)).as_subclass(Tagged),
    }
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.uint8, torch.int32, torch.int64, torch.bool, torch.int16,
               torch.complex64):  # fmt: skip
        cases[str(dt)] = torch.zeros(3, dtype=dt)
    return cases


def test_view_tensor_matches_torch():
    """_C.view_tensor (the fast path's description of a tensor: through torch's DLPack exchange
    table for an exact torch.Tensor, attribute reads otherwise) gives torch's data_ptr and
    numel for every contiguous CPU tensor of a supported dtype, and None for the rest."""
    from pycollectives._buffers import _TORCH_CODES

    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        assert not pc._C.dlpack_exchange()
    elif tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13):
        assert pc._C.dlpack_exchange()  # torch 2.13 publishes a usable table
    for name, t in _view_cases().items():
        code = _TORCH_CODES.get(t.dtype)
        ok = code is not None and t.is_cpu and t.is_contiguous() and not t.is_neg()
        want = (t.data_ptr(), t.numel(), code) if ok else None
        assert pc._C.view_tensor(t) == want, name
    assert pc._C.view_tensor(np.ones(3)) is None  # NumPy: the Python path
    assert pc._C.view_tensor(torch.empty(3, device="meta")) is None
    assert pc._C.view_tensor(torch.eye(3).to_sparse()) is None
    assert pc._C.view_tensor(None) is None
