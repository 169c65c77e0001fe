"""Bandwidth of the CUDA copy and reduce kernels against the device's copy and torch.add.

    python benchmarks/cuda/cuda_kernels.py [--sizes-mib 1,4,16,64,256,1024] [--reps 30]
        [--json out.json] [--doc docs/benchmarks.md | --no-doc]

For each buffer size S (one input's bytes) and dtype (float32, bfloat16), in one run on the current
CUDA device, times with CUDA events (warm-up first, median of --reps single-operation timings):

- memcpy: `dst.copy_(src)` (cudaMemcpyAsync device to device), 2S bytes moved;
- copy: pycollectives' copy kernel (`_C._cuda_copy`), 2S;
- torch.add: `torch.add(a, b, out=c)`, 3S;
- reduce: pycollectives' two-source sum (`_C._cuda_reduce`), 3S;
- reduce+copy: the same with a second destination (NCCL's recvReduceCopySend), 4S;

GB/s count bytes read plus bytes written, and the reduce is reported as a percentage of the memcpy
bandwidth (target: at least 90% at 256 MiB). Before each batch of timed operations a sleep kernel
holds the stream while the host enqueues the batch, so host launch overhead does not show in the
device times. When the buffers of one operation fit in the L2 cache, successive operations rotate
over enough buffer sets (at least 4x the L2 size) that each one reads from device memory.

Rewrites the section of --doc between `<!-- cuda_kernels:begin -->` and
`<!-- cuda_kernels:end -->` (appended at the end if missing) with the command, the device name, the
date and the table. Exits with status 2 and a message when there is no CUDA device or the build has
no CUDA kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import write_section

from pycollectives import _C

BEGIN, END = "<!-- cuda_kernels:begin -->", "<!-- cuda_kernels:end -->"
DTYPES = {"float32": 0, "bfloat16": 3}  # name -> dtype code (csrc/core/types.h)
SUM = 0
TARGET_MIB, TARGET_PCT = 256, 90.0
METHODS = ("memcpy", "copy", "torch.add", "reduce", "reduce+copy")
BYTES_MOVED = {"memcpy": 2, "copy": 2, "torch.add": 3, "reduce": 3, "reduce+copy": 4}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes-mib", default="1,4,16,64,256,1024", help="buffer sizes in MiB")
    p.add_argument("--dtypes", default="float32,bfloat16", help="subset of float32,bfloat16")
    p.add_argument("--reps", type=int, default=30, help="timed operations per figure (>= 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed operations before each figure")
    p.add_argument("--json", help="also write every figure to this JSON file")
    p.add_argument("--doc", default=str(Path(__file__).resolve().parents[2] / "docs/benchmarks.md"))
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the docs section")
    args = p.parse_args(argv)
    if args.reps < 20:
        p.error("--reps must be at least 20")
    args.sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    args.dtype_list = [d for d in args.dtypes.split(",") if d]
    for d in args.dtype_list:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    return args


def require_cuda() -> None:
    """Exits with status 2, saying what is missing, without a CUDA build and device."""
    why = None
    if not _C.cuda_built():
        why = "pycollectives was built without CUDA (rebuild with PYCOLL_CUDA=1)"
    elif not torch.cuda.is_available() or _C.cuda_device_count() == 0:
        why = "no CUDA device (torch.cuda.is_available() is False or no device is visible)"
    if why:
        print(f"cuda_kernels: {why}; nothing measured", file=sys.stderr)
        sys.exit(2)


def time_ops(ops: list[Callable[[], None]], warmup: int) -> list[float]:
    """Device milliseconds of each op in `ops`, run back to back on the current stream."""
    for op in ops[:warmup]:
        op()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(ops) + 1)]
    # Hold the stream while the host enqueues everything (~1.5 ms at ~1.7 GHz, longer than the
    # enqueueing), so that each op starts right after the previous one.
    torch.cuda._sleep(3_000_000)
    for i, op in enumerate(ops):
        events[i].record()
        op()
    events[-1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(len(ops))]


def measure(dtype: str, size: int, reps: int, warmup: int, l2: int) -> dict:
    """All methods at one size and dtype: {method: {"ms": median, "gbps": ...}, "ok": ...}."""
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    n = size // torch.empty((), dtype=tdt).element_size()
    nsets = max(1, math.ceil(4 * l2 / (4 * size)))
    sets = []
    for _ in range(nsets):
        a = torch.randn(n, device="cuda").to(tdt)
        b = torch.randn(n, device="cuda").to(tdt)
        sets.append((a, b, torch.empty_like(a), torch.empty_like(a)))
    stream = torch.cuda.current_stream().cuda_stream
    code = DTYPES[dtype]

    def op_for(method: str, s: tuple) -> Callable[[], None]:
        a, b, c, d = s
        if method == "memcpy":
            return lambda: c.copy_(a)
        if method == "copy":
            return lambda: _C._cuda_copy(c.data_ptr(), 0, a.data_ptr(), size, stream)
        if method == "torch.add":
            return lambda: torch.add(a, b, out=c)
        dst1 = d.data_ptr() if method == "reduce+copy" else 0
        return lambda: _C._cuda_reduce(
            code, SUM, c.data_ptr(), dst1, [a.data_ptr(), b.data_ptr()], n, stream
        )

    row: dict = {"dtype": dtype, "bytes": size, "buffer_sets": nsets}
    for method in METHODS:
        ops = [op_for(method, sets[i % nsets]) for i in range(warmup + reps)]
        times = time_ops(ops, warmup)[warmup:]
        ms = statistics.median(times)
        row[method] = {
            "ms": ms,
            "gbps": BYTES_MOVED[method] * size / (ms * 1e-3) / 1e9,
            "spread_ms": [min(times), max(times)],
        }
    # The reduce wrote a + b into c of the last set used; torch.add must agree bit for bit.
    a, b, c, d = sets[(warmup + reps - 1) % nsets]
    _C._cuda_reduce(code, SUM, c.data_ptr(), d.data_ptr(), [a.data_ptr(), b.data_ptr()], n, stream)
    ref = torch.add(a, b)
    row["matches_torch_add"] = bool(torch.equal(c, ref) and torch.equal(d, ref))
    base = row["memcpy"]["gbps"]
    row["reduce_pct_memcpy"] = 100.0 * row["reduce"]["gbps"] / base
    row["reduce_pct_copy"] = 100.0 * row["reduce"]["gbps"] / row["copy"]["gbps"]
    row["reduce_pct_torch_add"] = 100.0 * row["reduce"]["gbps"] / row["torch.add"]["gbps"]
    del sets
    torch.cuda.empty_cache()
    return row


def fmt_size(b: int) -> str:
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB"


def table(rows: list[dict]) -> list[str]:
    head = "| size | dtype | " + " | ".join(f"{m} GB/s" for m in METHODS)
    head += " | reduce / memcpy | reduce / torch.add | reduce == torch.add |"
    out = [head, "|" + "---|" * (len(METHODS) + 5)]
    for r in rows:
        cells = [fmt_size(r["bytes"]), r["dtype"]] + [f"{r[m]['gbps']:.0f}" for m in METHODS]
        cells += [
            f"{r['reduce_pct_memcpy']:.1f}%",
            f"{r['reduce_pct_torch_add']:.1f}%",
            "yes" if r["matches_torch_add"] else "NO",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def verdict(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["bytes"] == TARGET_MIB << 20:
            pct = r["reduce_pct_memcpy"]
            ok = "met" if pct >= TARGET_PCT else "NOT met"
            lines.append(
                f"- Target (reduce >= {TARGET_PCT:.0f}% of memcpy bandwidth at {TARGET_MIB} MiB), "
                f"{r['dtype']}: {pct:.1f}%, {ok}."
            )
    return lines


def write_doc(path: Path, command: str, device: str, rows: list[dict]) -> None:
    """Replaces (or appends) the cuda_kernels section of the markdown file at `path`."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    body = [
        BEGIN,
        "## CUDA kernels: copy and reduce bandwidth",
        "",
        f"- Command: `{command}`",
        f"- Device: {device}",
        f"- Date: {date}",
        "- GB/s count bytes read + written (memcpy and copy 2S, torch.add and reduce 3S,",
        "  reduce+copy 4S for buffers of S bytes); medians of single operations timed with CUDA",
        "  events, the stream held by a sleep kernel while the batch is enqueued.",
        *verdict(rows),
        "",
        *table(rows),
        END,
    ]
    write_section("\n".join(body), BEGIN, END, path)


def main(argv: list[str] | None = None) -> int:
    """Runs the measurements, prints the table, writes --json and the docs section."""
    args = parse_args(argv)
    require_cuda()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 64 << 20) or (64 << 20)
    device = (
        f"{torch.cuda.get_device_name()} ({props.multi_processor_count} SMs, {l2 >> 20} MiB L2)"
    )
    print(f"device: {device}", flush=True)
    rows = []
    for dtype in args.dtype_list:
        for mib in args.sizes:
            row = measure(dtype, mib << 20, args.reps, args.warmup, l2)
            rows.append(row)
            print(
                f"{fmt_size(row['bytes']):>8} {dtype:>8} "
                + " ".join(f"{m}={row[m]['gbps']:.0f}" for m in METHODS)
                + f" reduce/memcpy={row['reduce_pct_memcpy']:.1f}% ok={row['matches_torch_add']}",
                flush=True,
            )
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--json" in argv:  # where this run's JSON went is not part of the command to repeat
        k = argv.index("--json")
        del argv[k : k + 2]
    command = " ".join(["python benchmarks/cuda/cuda_kernels.py", *argv])
    print("\n".join(table(rows)))
    print("\n".join(verdict(rows)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "command": command, "rows": rows}, indent=1)
        )
    if not args.no_doc:
        write_doc(Path(args.doc), command, device, rows)
        print(f"wrote the cuda_kernels section of {args.doc}")
    return 0 if all(r["matches_torch_add"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
