"""The CUDA copy and reduction kernels (csrc/cuda), called directly through pycollectives._C.

Tests marked `cuda` need a CUDA device, torch with CUDA and a build with the CUDA kernels
(`_C.cuda_built()`); they are skipped otherwise. They check, for every dtype x op x nsrc in
{1, 2, 3, 8} x count in {0, 1, 7, 1000, 2^20 + 3} x buffer layout (aligned, a common
misalignment that leaves a scalar head, different misalignments that force the element-wise path,
dst1, dst0 aliasing a source):

- bitwise equality with the CPU kernel (`_C._reduce`) on the same inputs: small integers (exact
  in every dtype), uniform floats with NaN/inf/-0/subnormals, and random bit patterns (random
  NaN payloads: both must store the canonical NaN). The kernels define the same function as the
  CPU kernels (left fold, float16/bfloat16 in float32 rounded once), so nothing looser passes;
- nothing outside [offset, offset + count) of any buffer is written, sources are not modified;
- float sums and products against a float64 torch fold, by relative norm error within
  1e-12 (float64), 1e-6 (float32), 1e-3 (float16), 8e-3 (bfloat16); min/max exactly;
- copy for every common alignment of its pointers (16, 8, 4, 2, 1 bytes), with dst1;
- scale_avg bitwise against `_C._scale_avg`; a side stream; argument errors.

The tests that are not marked run everywhere: `cuda_built()` / `cuda_device_count()` behave,
and a kernel call without a usable device (forced with CUDA_VISIBLE_DEVICES="" in a subprocess)
raises "no CUDA device" (or "built without CUDA") instead of crashing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from pycollectives import _C

# name -> (dtype code in csrc/core/types.h, torch dtype)
DTYPES = {
    "float32": (0, torch.float32),
    "float64": (1, torch.float64),
    "float16": (2, torch.float16),
    "bfloat16": (3, torch.bfloat16),
    "int8": (4, torch.int8),
    "uint8": (5, torch.uint8),
    "int32": (6, torch.int32),
    "int64": (7, torch.int64),
}
FLOATS = ("float32", "float64", "float16", "bfloat16")
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}
NSRCS = (1, 2, 3, 8)
COUNTS = (0, 1, 7, 1000, (1 << 20) + 3)
LARGE = (1 << 20) + 3
LAYOUTS = ("aligned", "head+dst1", "mixed", "alias0", "alias_last")
KINDS = ("small", "uniform", "bits")
PAD = 8  # elements of guard before and after every buffer
TOLERANCE = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def cuda_ready() -> bool:
    return _C.cuda_built() and torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(
    not cuda_ready(), reason="needs a CUDA device, torch with CUDA and a CUDA build"
)


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


# --- data -------------------------------------------------------------------------------


def make(dtype: str, n: int, kind: str, gen: torch.Generator, op: str = "sum") -> torch.Tensor:
    """n random CPU elements of `dtype`: small integers, uniform values with specials, or
    random bit patterns."""
    tdt = DTYPES[dtype][1]
    if kind == "bits":
        size = torch.empty((), dtype=tdt).element_size()
        raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
        return raw.view(tdt)
    if kind == "small":
        lo, hi = (0, 4) if dtype == "uint8" else (-3, 4)
        return torch.randint(lo, hi, (n,), generator=gen).to(tdt)
    if dtype not in FLOATS:  # uniform over the whole range
        info = torch.iinfo(tdt)
        return torch.randint(info.min, info.max, (n,), dtype=tdt, generator=gen)
    if op == "prod":  # magnitudes in [0.5, 2]
        mag = torch.rand(n, dtype=torch.float64, generator=gen) * 1.5 + 0.5
        sign = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
        v = mag * sign
    else:
        v = torch.rand(n, dtype=torch.float64, generator=gen) * 8 - 4
    if n >= 16:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        idx = torch.randint(0, n, (5,), generator=gen)
        v[idx] = specials.to(torch.float64)
        v[int(torch.randint(0, n, (1,), generator=gen))] = 3e-6 if dtype == "float16" else 1e-40
    return v.to(tdt)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when bitwise equal, else where and what differs."""
    if torch.equal(as_bytes(got), as_bytes(want.to(got.device))):
        return ""
    a, b = as_bytes(got.cpu()), as_bytes(want.cpu())
    if torch.equal(a, b):
        return ""
    size = got.element_size()
    i = int(torch.nonzero(a != b)[0]) // size
    return f"element {i}: got {got.cpu()[i].item()!r}, expected {want.cpu()[i].item()!r}"


# --- one reduce case ----------------------------------------------------------------------


def layout_offsets(layout: str, nsrc: int) -> tuple[list[int], int, int | None]:
    """(element offset of each source, of dst0, of dst1 or None) before aliasing."""
    if layout == "aligned":
        return [0] * nsrc, 0, None
    if layout == "head+dst1":  # common misalignment: scalar head, vector body
        return [1] * nsrc, 1, 1
    if layout == "mixed":  # different misalignments: element-wise path
        return [k % 3 for k in range(nsrc)], 2, 1
    if layout == "alias0":
        return [3] * nsrc, 3, 3
    return [0] * nsrc, 0, 0  # alias_last


def run_reduce_case(
    dtype: str, op: str, nsrc: int, count: int, layout: str, kind: str, seed: int
) -> str:
    """Runs one case on the GPU and the CPU kernel; returns '' or a failure description."""
    gen = torch.Generator().manual_seed(seed)
    code = DTYPES[dtype][0]
    src_off, d0_off, d1_off = layout_offsets(layout, nsrc)
    total = count + 2 * PAD
    host = [make(dtype, total, kind, gen, op) for _ in range(nsrc + 2)]
    dev = [h.cuda() for h in host]
    srcs = [dev[k][PAD + src_off[k] : PAD + src_off[k] + count] for k in range(nsrc)]
    dst0_i, dst1_i = nsrc, (nsrc + 1 if d1_off is not None else None)
    if layout == "alias0":
        dst0_i = 0
    elif layout == "alias_last":
        dst0_i = nsrc - 1
        dst1_i = 0 if nsrc >= 2 else None
    dst0_off = src_off[dst0_i] if dst0_i < nsrc else d0_off
    dst0 = dev[dst0_i][PAD + dst0_off : PAD + dst0_off + count]
    dst1 = None
    if dst1_i is not None:
        dst1_off = src_off[dst1_i] if dst1_i < nsrc else d1_off
        dst1 = dev[dst1_i][PAD + dst1_off : PAD + dst1_off + count]
    inputs = [host[k][PAD + src_off[k] : PAD + src_off[k] + count] for k in range(nsrc)]
    expect = [d.clone() for d in dev]  # on the device: the checks below compare there

    want = torch.empty(count, dtype=DTYPES[dtype][1])
    _C._reduce(code, OPS[op], want.data_ptr(), 0, [s.data_ptr() for s in inputs], count)
    _C._cuda_reduce(
        code,
        OPS[op],
        dst0.data_ptr(),
        dst1.data_ptr() if dst1 is not None else 0,
        [s.data_ptr() for s in srcs],
        count,
        stream(),
    )
    torch.cuda.synchronize()
    if failure := first_difference(dst0, want):
        return "dst0 " + failure
    if dst1 is not None and (failure := first_difference(dst1, want)):
        return "dst1 " + failure
    # Nothing else changed: the guards of every allocation, the sources not written to.
    want_dev = want.cuda()
    expect[dst0_i][PAD + dst0_off : PAD + dst0_off + count] = want_dev
    if dst1_i is not None:
        expect[dst1_i][PAD + dst1_off : PAD + dst1_off + count] = want_dev
    for i, (d, e) in enumerate(zip(dev, expect, strict=True)):
        if not torch.equal(as_bytes(d), as_bytes(e)):
            what = "source" if i < nsrc else "destination"
            failure = first_difference(d, e)
            return f"{what} allocation {i} changed outside the destination: {failure}"
    return ""


def reduce_cases(dtype: str, op: str):
    """(nsrc, count, layout, kind) of one dtype x op: every kind below the large count, one kind
    per layout at the large count."""
    for nsrc in NSRCS:
        for count in COUNTS:
            for li, layout in enumerate(LAYOUTS):
                kinds = (KINDS[(li + nsrc) % len(KINDS)],) if count == LARGE else KINDS
                for kind in kinds:
                    yield nsrc, count, layout, kind


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reduce_matches_cpu_bitwise(dtype, op):
    failures = []
    for i, (nsrc, count, layout, kind) in enumerate(reduce_cases(dtype, op)):
        seed = zlib.crc32(repr((dtype, op, i)).encode())
        failure = run_reduce_case(dtype, op, nsrc, count, layout, kind, seed)
        if failure:
            failures.append(f"nsrc={nsrc} count={count} {layout} {kind}: {failure}")
    assert not failures, f"{len(failures)} cases differ:\n" + "\n".join(failures[:10])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("nsrc", (2, 3, 8))
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_against_float64_reference(dtype, nsrc):
    """Random values (no specials) folded by torch in float64 on the GPU."""
    gen = torch.Generator().manual_seed(nsrc * 31 + len(dtype))
    code, tdt = DTYPES[dtype]
    for op in OPS:
        for offset in (0, 1):
            srcs = [
                make(dtype, LARGE + 1, "uniform", gen, op).cuda()[offset : offset + LARGE]
                for _ in range(nsrc)
            ]
            for s in srcs:  # no specials here: replace them by ones
                s[~torch.isfinite(s) | (s == 0)] = 1
            out = torch.full((LARGE,), 7, dtype=tdt, device="cuda")  # poisoned
            _C._cuda_reduce(
                code, OPS[op], out.data_ptr(), 0, [s.data_ptr() for s in srcs], LARGE, stream()
            )
            fn = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[
                op
            ]
            ref = srcs[0].double()
            for s in srcs[1:]:
                ref = fn(ref, s.double())
            if op in ("min", "max"):
                assert torch.equal(out.double(), ref), f"{dtype} {op} nsrc={nsrc}: not exact"
                continue
            err = float(
                torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)
            )
            assert err < TOLERANCE[dtype], f"{dtype} {op} nsrc={nsrc} offset={offset}: {err:.3g}"


# --- copy -----------------------------------------------------------------------------------

# (src offset, dst0 offset, dst1 offset or None, dst1 is src): common alignments 16, 8, 4, 2, 1
COPY_LAYOUTS = (
    (0, 0, None, False),
    (3, 3, 3, False),
    (0, 8, 24, False),
    (1, 5, None, False),
    (0, 2, 6, False),
    (0, 1, None, False),
    (5, 2, 0, False),
    (4, 4, None, True),
)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("count", COUNTS)
def test_copy(count):
    gen = torch.Generator().manual_seed(count)
    for src_off, d0_off, d1_off, d1_is_src in COPY_LAYOUTS:
        host = [make("uint8", count + 64, "bits", gen) for _ in range(3)]
        dev = [h.cuda() for h in host]
        src = dev[0][src_off : src_off + count]
        dst0 = dev[1][d0_off : d0_off + count]
        dst1 = src if d1_is_src else None
        if d1_off is not None:
            dst1 = dev[2][d1_off : d1_off + count]
        _C._cuda_copy(
            dst0.data_ptr(),
            dst1.data_ptr() if dst1 is not None else 0,
            src.data_ptr(),
            count,
            stream(),
        )
        torch.cuda.synchronize()
        want = host[0][src_off : src_off + count]
        expect1 = host[1].clone()
        expect1[d0_off : d0_off + count] = want
        expect2 = host[2].clone()
        if d1_off is not None:
            expect2[d1_off : d1_off + count] = want
        layout = (src_off, d0_off, d1_off, d1_is_src)
        assert torch.equal(dev[0].cpu(), host[0]), f"{layout}: src modified"
        assert torch.equal(dev[1].cpu(), expect1), f"{layout}: dst0 wrong or written outside"
        assert torch.equal(dev[2].cpu(), expect2), f"{layout}: dst1 wrong or written outside"


# --- scale_avg ------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scale_avg_matches_cpu_bitwise(dtype):
    gen = torch.Generator().manual_seed(len(dtype))
    code = DTYPES[dtype][0]
    for count in COUNTS:
        for divisor in (1, 3, 7):
            for offset in (0, 1):
                for kind in ("uniform", "bits"):
                    host = make(dtype, count + 2 * PAD, kind, gen)
                    dev = host.cuda()
                    want = host.clone()
                    view = want[PAD + offset : PAD + offset + count]
                    _C._scale_avg(view.data_ptr(), code, count, divisor)
                    x = dev[PAD + offset : PAD + offset + count]
                    _C._cuda_scale_avg(x.data_ptr(), code, count, divisor, stream())
                    torch.cuda.synchronize()
                    failure = first_difference(dev, want)
                    assert not failure, (
                        f"count={count} /{divisor} offset={offset} {kind}: {failure}"
                    )


# --- streams and errors ---------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_side_stream_orders_work():
    """Work enqueued on a side stream runs after the stream's earlier work and before an event
    recorded after it."""
    side = torch.cuda.Stream()
    n = 1 << 24
    with torch.cuda.stream(side):
        a = torch.full((n,), 1.0, device="cuda")
        b = torch.full((n,), 2.0, device="cuda")
        out = torch.empty(n, device="cuda")
        a.mul_(3)  # in flight when the reduce is enqueued
        _C._cuda_reduce(
            0, OPS["sum"], out.data_ptr(), 0, [a.data_ptr(), b.data_ptr()], n, side.cuda_stream
        )
        _C._cuda_scale_avg(out.data_ptr(), 0, n, 5, side.cuda_stream)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    assert torch.equal(out.cpu(), torch.full((n,), 1.0))


@pytest.mark.cuda
@needs_cuda
def test_invalid_arguments_on_device():
    x = torch.zeros(64, device="cuda")
    p = x.data_ptr()
    s = stream()
    with pytest.raises(ValueError, match="not aligned"):
        _C._cuda_reduce(0, 0, p + 2, 0, [p + 64, p + 128], 4, s)
    with pytest.raises(ValueError, match="nsrc"):
        _C._cuda_reduce(0, 0, p, 0, [p] * 9, 4, s)
    with pytest.raises(ValueError, match="overlap"):
        _C._cuda_reduce(0, 0, p, 0, [p + 4, p + 128], 8, s)
    with pytest.raises(ValueError, match="overlap"):
        _C._cuda_copy(p, 0, p + 1, 16, s)
    with pytest.raises(ValueError, match="null"):
        _C._cuda_reduce(0, 0, 0, 0, [p, p], 4, s)
    with pytest.raises(ValueError, match="divisor"):
        _C._cuda_scale_avg(p, 0, 4, 0, s)
    torch.cuda.synchronize()  # nothing bad was enqueued


# --- without a GPU ---------------------------------------------------------------------------


def test_cuda_queries():
    assert isinstance(_C.cuda_built(), bool)
    n = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0
    if not _C.cuda_built():
        assert n == 0
    elif torch.cuda.is_available():
        assert n == torch.cuda.device_count()


def test_invalid_arguments_without_device():
    """Argument errors are ValueError before any device is needed (CUDA builds only)."""
    if not _C.cuda_built():
        pytest.skip("built without CUDA: every call raises 'built without CUDA'")
    with pytest.raises(ValueError, match="dtype"):
        _C._cuda_reduce(99, 0, 256, 0, [512, 768], 4, 0)
    with pytest.raises(ValueError, match="op"):
        _C._cuda_reduce(0, 4, 256, 0, [512, 768], 4, 0)  # avg is sum + scale_avg
    with pytest.raises(ValueError, match="srcs"):
        _C._cuda_reduce(0, 0, 256, 0, [], 4, 0)
    with pytest.raises(ValueError, match="nsrc"):
        _C._cuda_reduce(0, 0, 256, 0, [512] * 9, 4, 0)
    with pytest.raises(ValueError, match="divisor"):
        _C._cuda_scale_avg(256, 0, 4, 0, 0)


NO_DEVICE_SCRIPT = textwrap.dedent(
    """
    from pycollectives import _C
    from pycollectives.errors import PyCollectivesError
    calls = {
        "reduce": lambda: _C._cuda_reduce(0, 0, 256, 0, [512, 768], 4, 0),
        "scale_avg": lambda: _C._cuda_scale_avg(256, 0, 4, 2, 0),
        "copy": lambda: _C._cuda_copy(256, 0, 512, 16, 0),
    }
    print(_C.cuda_device_count())
    for name, call in calls.items():
        try:
            call()
        except PyCollectivesError as e:
            print(name, "|", e)
        else:
            print(name, "| no error")
    """
)


def test_kernel_call_without_device_raises_clearly():
    """With no usable device (none here, or hidden by CUDA_VISIBLE_DEVICES=""), each kernel
    entry point raises PyCollectivesError saying why; the process does not crash."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", NO_DEVICE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "0", f"cuda_device_count() with no visible device: {lines[0]}"
    expected = "no CUDA device" if _C.cuda_built() else "built without CUDA"
    assert len(lines) == 4
    for line in lines[1:]:
        name, _, message = line.partition(" | ")
        assert expected in message, f"{name}: {message}"
