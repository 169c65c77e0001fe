"""The CPU reduction and copy kernels (csrc/reduce), called directly through pycollectives._C.

Copies (_copy): byte counts around the register and unrolled widths, destinations at every
alignment, one or two destinations, cached or streaming stores; exact, nothing written outside.

Every dtype x op x nsrc in 1..4 x count, with buffers offset by one element from their
allocation, the destination aliasing the first source or not, and a second destination or not;
and _scale_avg. The reference for float32/float64/integers is the same left-to-right fold done by
NumPy in the dtype itself (integers wrap), so results must match exactly; float16/bfloat16 must
equal the float32 fold rounded once to nearest even, and must also be within one 16-bit rounding
(plus the float32 accumulation error bound) of the float64 sum rounded to the dtype. NaN equals
NaN in these checks; bits are compared across SIMD paths instead: every path the CPU allows
(generic, avx2, avx512) runs all cases, the default one in this process and the others in
subprocesses with PYCOLL_SIMD set, and all must produce identical bytes. `python
test_reduce_kernels.py --worker` prints one path's results as JSON.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pycollectives import _C

try:
    import torch
except ImportError:  # bfloat16 needs torch's conversions for its reference
    torch = None

# name -> (dtype code in csrc/core/types.h, NumPy storage type; bfloat16 is stored as its bits)
DTYPES = {
    "float32": (0, np.float32),
    "float64": (1, np.float64),
    "float16": (2, np.float16),
    "bfloat16": (3, np.uint16),
    "int8": (4, np.int8),
    "uint8": (5, np.uint8),
    "int32": (6, np.int32),
    "int64": (7, np.int64),
}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}
NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
NSRCS = (1, 2, 3, 4)
COUNTS = (0, 1, 7, 31, 1000, 4099)
# (element offset of every buffer, second destination given, dst0 is srcs[0])
LAYOUTS = ((0, False, False), (1, True, False), (1, False, True), (0, True, True))
DIVISORS = (1, 3, 7)
LEVELS = ("generic", "avx2", "avx512")
SPECIALS = (np.nan, np.inf, -np.inf, 0.0, -0.0)
# 16-bit float formats: (mantissa bits, minimum normal exponent)
FORMAT_16 = {"float16": (10, -14), "bfloat16": (7, -126)}


def dtypes_available() -> list[str]:
    return [d for d in DTYPES if d != "bfloat16" or torch is not None]


# --- conversions for the 16-bit reference -------------------------------------------------


def to_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 or float64 values rounded to nearest even in the dtype's storage type."""
    if dtype == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16)
        return bits.numpy().view(np.uint16)
    return x.astype(np.float16)


def values(x: np.ndarray, dtype: str) -> np.ndarray:
    """Element values as float64 (floats) or the array itself (integers)."""
    if dtype in FORMAT_16:
        return to_f32(x, dtype).astype(np.float64)
    return x


# --- cases --------------------------------------------------------------------------------


def random_values(rng: np.random.Generator, dtype: str, op: str, n: int) -> np.ndarray:
    store = DTYPES[dtype][1]
    if np.issubdtype(store, np.integer) and dtype != "bfloat16":
        info = np.iinfo(store)
        return rng.integers(info.min, info.max, size=n, dtype=store, endpoint=True)
    if op == "prod":  # magnitudes in [0.5, 2]: no overflow or underflow even in float16
        v = rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)
    else:
        v = rng.uniform(-4.0, 4.0, n)
    if n >= 7:  # a random special value at each of the first five positions, a subnormal after
        v[:5] = rng.choice(SPECIALS, 5)
        v[5] = 3e-6 if dtype == "float16" else 1e-40
    if dtype in FORMAT_16:
        return round_to(v.astype(np.float32), dtype)
    return v.astype(store)


def expected_fold(srcs: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """The kernel's definition: a left-to-right fold in the accumulation type, rounded once."""
    fn = NUMPY_OPS[op]
    if dtype in FORMAT_16:
        acc = to_f32(srcs[0], dtype)
        for s in srcs[1:]:
            acc = fn(acc, to_f32(s, dtype))
        return round_to(acc, dtype)
    acc = srcs[0].copy()
    for s in srcs[1:]:
        acc = fn(acc, s)
    return acc


def check_16bit_tolerance(srcs: list[np.ndarray], got: np.ndarray, dtype: str, op: str) -> str:
    """got vs the float64 fold rounded to the dtype, at positions where everything is finite.

    Allowed: one 16-bit rounding (one ulp at the larger magnitude: the exact and the float32
    sums can round to neighbours) plus the float32 accumulation error, (nsrc - 1) * 2^-24 times
    the sum of magnitudes (sum) or the product of magnitudes (prod).
    """
    if op not in ("sum", "prod") or len(srcs) < 2:
        return ""
    x = np.stack([values(s, dtype) for s in srcs])
    exact = x.sum(0) if op == "sum" else x.prod(0)
    ref = values(round_to(exact, dtype), dtype)
    res = values(got, dtype)
    bound = np.abs(x).sum(0) if op == "sum" else np.abs(x).prod(0)
    ok = np.isfinite(x).all(0) & np.isfinite(ref) & np.isfinite(res)
    mant, emin = FORMAT_16[dtype]
    mag = np.maximum(np.abs(ref), np.abs(res))
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    ulp = 2.0 ** (np.maximum(exp, emin) - mant)
    tol = ulp + (len(srcs) - 1) * 2.0**-24 * bound
    bad = ok & (np.abs(res - ref) > tol)
    if bad.any():
        i = int(np.argmax(bad))
        return f"element {i}: {res[i]!r} vs float64 reference {ref[i]!r} (tolerance {tol[i]:.3g})"
    return ""


def mismatch(got: np.ndarray, want: np.ndarray, dtype: str) -> str:
    """'' when equal (NaN == NaN), else a description of the first difference."""
    a, b = values(got, dtype), values(want, dtype)
    same = a == b
    if np.issubdtype(a.dtype, np.floating):
        same |= np.isnan(a) & np.isnan(b)
    if same.all():
        return ""
    i = int(np.argmin(same))
    return f"element {i}: got {a[i]!r}, expected {b[i]!r}"


def run_reduce_case(rng, dtype: str, op: str, nsrc: int, count: int, layout) -> tuple[bytes, str]:
    """Runs one case; returns (result bytes, failure description or '')."""
    offset, with_dst1, alias = layout
    allocs = [random_values(rng, dtype, op, count + 2) for _ in range(nsrc + 2)]
    guards = [a.copy() for a in allocs]
    views = [a[offset : offset + count] for a in allocs]
    srcs, dst0, dst1 = views[:nsrc], views[nsrc], views[nsrc + 1]
    if alias:
        dst0 = srcs[0]
    inputs = [s.copy() for s in srcs]
    _C._reduce(
        DTYPES[dtype][0],
        OPS[op],
        dst0.ctypes.data,
        dst1.ctypes.data if with_dst1 else 0,
        [s.ctypes.data for s in srcs],
        count,
    )
    result = dst0.copy()
    if nsrc == 1:
        want = inputs[0]
        failure = "" if result.tobytes() == want.tobytes() else "copy changed the bits"
    else:
        failure = mismatch(result, expected_fold(inputs, dtype, op), dtype)
        if not failure and dtype in FORMAT_16:
            failure = check_16bit_tolerance(inputs, result, dtype, op)
    if not failure and with_dst1 and dst1.tobytes() != result.tobytes():
        failure = "dst1 differs from dst0"
    for k, (a, g) in enumerate(zip(allocs, guards, strict=True)):
        outside = np.ones(count + 2, bool)
        outside[offset : offset + count] = False
        if not failure and a[outside].tobytes() != g[outside].tobytes():
            failure = f"buffer {k} written outside [offset, offset + count)"
    if not failure and not alias:
        for k, (s, i) in enumerate(zip(srcs, inputs, strict=True)):
            if s.tobytes() != i.tobytes():
                failure = f"source {k} modified"
    return result.tobytes(), failure


def expected_scale(x: np.ndarray, dtype: str, divisor: int) -> np.ndarray:
    if dtype in FORMAT_16:
        return round_to(to_f32(x, dtype) / np.float32(divisor), dtype)
    if np.issubdtype(x.dtype, np.floating):
        return x / x.dtype.type(divisor)
    q = x // divisor  # floor; C truncates toward zero
    return np.where((x % divisor != 0) & (x < 0), q + 1, q).astype(x.dtype)


def run_scale_case(rng, dtype: str, count: int, divisor: int) -> tuple[bytes, str]:
    buf = random_values(rng, dtype, "sum", count + 1)
    x = buf[1:]
    before = x.copy()
    _C._scale_avg(x.ctypes.data, DTYPES[dtype][0], count, divisor)
    failure = mismatch(x, expected_scale(before, dtype, divisor), dtype)
    return x.tobytes(), failure


# copy: byte counts around the 64-byte register and the 4 x 64-byte unrolled step, and byte
# offsets of the destinations that leave none, some or all of dst0 unaligned
COPY_BYTES = (0, 1, 63, 64, 65, 255, 256, 257, 1000, 4099, 65536 + 13)
COPY_OFFSETS = (0, 1, 31, 63)
GUARD = 64  # bytes on either side of a destination that must stay untouched


def run_copy_case(
    rng, nbytes: int, offset: int, second: bool, streaming: bool
) -> tuple[bytes, str]:
    """_copy of nbytes into destinations `offset` bytes past 64-byte alignment (and the
    source one byte further): (dst0 + dst1 bytes, failure or "")."""
    src_buf = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    src = src_buf[offset + 1 : offset + 1 + nbytes]
    bufs = [np.full(nbytes + 2 * GUARD + 64, 0xA5, np.uint8) for _ in range(2 if second else 1)]
    dsts = []
    for b in bufs:
        start = GUARD + (-b.ctypes.data - GUARD) % 64 + offset  # 64-aligned + offset
        dsts.append((b, start))
    addr = [b.ctypes.data + s for b, s in dsts]
    _C._copy(addr[0], addr[1] if second else 0, src.ctypes.data, nbytes, streaming)
    out = b""
    for b, s in dsts:
        got = b[s : s + nbytes]
        if not np.array_equal(got, src):
            return b"", f"copy differs at byte {int(np.argmax(got != src))}"
        outside = np.concatenate([b[:s], b[s + nbytes :]])
        if (outside != 0xA5).any():
            return b"", "copy wrote outside its destination"
        out += got.tobytes()
    return out, ""


def case_rng(*key) -> np.random.Generator:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


@np.errstate(invalid="ignore", over="ignore")
def run_all() -> tuple[dict[str, str], list[str]]:
    """Every case on the current path: ({case: sha256 of result}, [failures])."""
    digests, failures = {}, []
    for nbytes, offset, second, streaming in itertools.product(
        COPY_BYTES, COPY_OFFSETS, (False, True), (False, True)
    ):
        key = ("copy", nbytes, offset, second, streaming)
        data, failure = run_copy_case(case_rng(*key), nbytes, offset, second, streaming)
        digests[repr(key)] = hashlib.sha256(data).hexdigest()
        if failure:
            failures.append(f"{key}: {failure}")
    for dtype in dtypes_available():
        for op in OPS:
            for nsrc, count, layout in itertools.product(NSRCS, COUNTS, LAYOUTS):
                key = (dtype, op, nsrc, count, layout)
                data, failure = run_reduce_case(case_rng(*key), dtype, op, nsrc, count, layout)
                digests[repr(key)] = hashlib.sha256(data).hexdigest()
                if failure:
                    failures.append(f"{key}: {failure}")
        for count in COUNTS:
            for divisor in DIVISORS:
                key = (dtype, "scale_avg", count, divisor)
                data, failure = run_scale_case(case_rng(*key), dtype, count, divisor)
                digests[repr(key)] = hashlib.sha256(data).hexdigest()
                if failure:
                    failures.append(f"{key}: {failure}")
    return digests, failures


# --- tests ------------------------------------------------------------------------------


def supported_levels() -> list[str]:
    """The default path and every lower one (PYCOLL_SIMD can only lower the choice)."""
    return list(LEVELS[: LEVELS.index(_C.simd_level()) + 1])


@pytest.fixture(scope="module")
def path_results():
    """{level: {"level": the path that ran, "digests": ..., "failures": ...}}: the default path
    in this process, each lower one in a subprocess with PYCOLL_SIMD set, concurrently."""
    default = _C.simd_level()
    procs = {}
    for level in supported_levels():
        if level != default:
            procs[level] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                env=dict(os.environ, PYCOLL_SIMD=level),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    digests, failures = run_all()
    results = {default: {"level": default, "digests": digests, "failures": failures}}
    for level, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"PYCOLL_SIMD={level} worker failed:\n{err}"
        results[level] = json.loads(out)
    return results


@pytest.mark.parametrize("level", LEVELS)
def test_path_matches_reference(level, path_results):
    if level not in path_results:
        pytest.skip(f"this CPU (or PYCOLL_SIMD) does not allow {level}")
    result = path_results[level]
    assert result["level"] == level
    assert not result["failures"], f"{level}: " + "\n".join(result["failures"][:10])


def test_paths_agree_bitwise(path_results):
    levels = list(path_results)
    if len(levels) < 2:
        pytest.skip("only one SIMD path available")
    base = path_results[levels[0]]["digests"]
    for level in levels[1:]:
        other = path_results[level]["digests"]
        assert other.keys() == base.keys()
        differ = [k for k in base if base[k] != other[k]]
        assert not differ, f"{level} vs {levels[0]}: {len(differ)} cases differ, e.g. {differ[:5]}"


def test_invalid_arguments():
    x = np.zeros(4, np.float32)
    p = x.ctypes.data
    with pytest.raises(ValueError, match="dtype"):
        _C._reduce(99, 0, p, 0, [p, p], 4)
    with pytest.raises(ValueError, match="op"):
        _C._reduce(0, 4, p, 0, [p, p], 4)  # avg is sum + _scale_avg
    with pytest.raises(ValueError, match="op"):
        _C._reduce(0, -1, p, 0, [p, p], 4)
    with pytest.raises(ValueError, match="source"):
        _C._reduce(0, 0, p, 0, [], 4)
    with pytest.raises(ValueError, match="divisor"):
        _C._scale_avg(p, 0, 4, 0)
    with pytest.raises(ValueError, match="dtype"):
        _C._scale_avg(p, -1, 4, 2)
    with pytest.raises(ValueError, match="null"):
        _C._copy(0, 0, p, 4, True)


def test_simd_level_names_a_path():
    assert _C.simd_level() in LEVELS


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    digests, failures = run_all()
    print(json.dumps({"level": _C.simd_level(), "digests": digests, "failures": failures}))
