"""pycollectives on CUDA tensors against torch.distributed gloo (and NCCL where
it allows several ranks per GPU), 2 and 4 ranks on one GPU, with a roofline.

    python benchmarks/cuda_collectives.py [--ranks 2,4] [--out docs/benchmarks.md]

For each world size runs `pycollectives-bench --device cuda --compare gloo[,nccl]`
for all-reduce, reduce-scatter and all-gather from 8 KiB to 1 GiB (8 KiB..512 MiB
by factors of 4, then 1 GiB), with every row checked (-c 1). In the same run it
measures the device-to-device copy bandwidth (torch copy_ of 256 MiB, CUDA
events) and derives the roofline of each row: the bytes that the ring schedule
makes each rank's kernels read and write,
    all_reduce      S (6n - 4) / n        (S: the buffer)
    reduce_scatter  S (3n - 1) / n        (S: the input, n blocks)
    all_gather      S (3n - 1) / n        (S: the output, n blocks)
times the number of ranks that share one GPU (they share its memory
bandwidth), divided by the copy bandwidth (bytes read + written per second).
Then it rewrites its section of docs/benchmarks.md (between the
cuda_collectives markers) with the command, the device, the date, every figure
and the targets (>= 80 % of the roofline from 64 MiB, >= 20x gloo) checked.

NCCL: compared when torch's NCCL (or the one of an installed nvidia-nccl-cu12/
cu13 wheel, preloaded) is >= 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1; otherwise
the section says what was found. Without a GPU it exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import subprocess
import sys
from pathlib import Path

from _doc import run_bench, write_section

COLLS = ["all_reduce", "reduce_scatter", "all_gather"]
BEGIN, END = "<!-- cuda_collectives:begin -->", "<!-- cuda_collectives:end -->"
ROOT = Path(__file__).resolve().parent.parent


def copy_bandwidth(nbytes: int = 256 << 20, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes (read + written) per second on cuda:0."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / iters
    return 2 * nbytes / seconds


def nccl_setup() -> tuple[dict[str, str] | None, str]:
    """(environment for the ranks, what was found) for an NCCL that allows
    several ranks per GPU; None when there is none."""
    import torch

    found = []
    candidates: list[dict[str, str]] = [{}]
    try:
        import nvidia.nccl  # the nvidia-nccl-cu12 / cu13 wheel

        for lib in glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so*")):
            candidates.append({"LD_PRELOAD": lib})
    except ImportError:
        found.append("no nvidia-nccl wheel installed")
    for extra in candidates:
        env = dict(os.environ, **extra)
        probe = "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))"
        r = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
        ver = r.stdout.strip() if r.returncode == 0 else f"error: {r.stderr.strip()[-200:]}"
        where = extra.get("LD_PRELOAD", f"torch {torch.__version__}'s own")
        found.append(f"{where}: NCCL {ver}")
        try:
            if tuple(int(x) for x in ver.split(".")[:2]) >= (2, 30):
                return dict(extra, NCCL_MULTI_RANK_GPU_ENABLE="1"), "; ".join(found)
        except ValueError:
            continue
    return None, "; ".join(found) + " (NCCL >= 2.30 is needed for several ranks per GPU)"


def bench(nranks: int, sizes: list[str], iters: list[str], backends: str, env: dict) -> dict:
    """Runs one comparison; returns the bench's JSON (metadata and rows)."""
    flags = ["--device", "cuda", "--coll", ",".join(COLLS), "--compare", backends, "-c", "1",
             "--timeout", "600", *sizes, *iters]  # fmt: skip
    return run_bench(nranks, flags, env)


def traffic(coll: str, size: int, n: int) -> float:
    """Bytes the ring schedule makes one rank's kernels read and write."""
    return size * (6 * n - 4) / n if coll == "all_reduce" else size * (3 * n - 1) / n


def fmt_size(b: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def render(runs: dict[int, list[dict]], bw: float, device: str, command: str, nccl: str) -> str:
    import torch

    ngpu = max(1, torch.cuda.device_count())
    lines = [
        BEGIN,
        "## CUDA collectives (pycollectives vs gloo vs NCCL, ranks sharing one GPU)",
        "",
        f"`{command}` on {device} ({ngpu} GPU visible), "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}.",
        f"Device-to-device copy bandwidth measured in the same run: {bw / 1e9:.0f} GB/s "
        "(bytes read + written per second). Roofline: the bytes the ring makes each rank read "
        "and write, times the ranks sharing the GPU, over that bandwidth (see the script).",
        f"NCCL: {nccl}.",
        "",
    ]
    verdicts = []
    for n, rows in sorted(runs.items()):
        share = max(1, -(-n // ngpu))
        by = {(r["backend"], r["collective"], r["size"]): r for r in rows}
        for coll in COLLS:
            lines += [
                f"### {coll}, {n} ranks ({share} per GPU)",
                "",
                "| size | pycoll us | busbw GB/s | roofline us | % of roofline | gloo us "
                "| x gloo | nccl us | wrong |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            worst_roof, worst_gloo = None, None
            for size in sorted({s for b, c, s in by if c == coll}):
                own = by.get(("pycoll", coll, size))
                if own is None or not own.get("time_us"):
                    continue
                gloo = by.get(("gloo", coll, size))
                nc = by.get(("nccl", coll, size))
                roof = share * traffic(coll, size, n) / bw * 1e6
                frac = roof / own["time_us"]
                xg = gloo["time_us"] / own["time_us"] if gloo and gloo.get("time_us") else None
                if size >= 64 << 20:
                    worst_roof = frac if worst_roof is None else min(worst_roof, frac)
                if xg is not None:
                    worst_gloo = xg if worst_gloo is None else min(worst_gloo, xg)
                lines.append(
                    f"| {fmt_size(size)} | {own['time_us']:.1f} | {own['busbw']:.2f} | {roof:.1f} "
                    f"| {100 * frac:.0f} | "
                    + (f"{gloo['time_us']:.1f}" if gloo and gloo.get("time_us") else "n/a")
                    + f" | {xg:.1f}" * (xg is not None)
                    + " | n/a" * (xg is None)
                    + " | "
                    + (f"{nc['time_us']:.1f}" if nc and nc.get("time_us") else "n/a")
                    + f" | {own.get('wrong', 'n/a')} |"
                )
            lines.append("")
            roof_ok = worst_roof is not None and worst_roof >= 0.8
            gloo_ok = worst_gloo is not None and worst_gloo >= 20
            verdicts.append(
                f"- {coll}, {n} ranks: from 64 MiB, at least "
                + (f"{100 * worst_roof:.0f} %" if worst_roof is not None else "n/a")
                + f" of the roofline ({'met' if roof_ok else 'NOT met'}, target 80 %); "
                + "at least "
                + (f"{worst_gloo:.1f}x" if worst_gloo is not None else "n/a")
                + f" gloo over all sizes ({'met' if gloo_ok else 'NOT met'}, target 20x)"
            )
    lines += ["### Targets", "", *verdicts, "", END]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--iters", type=int, default=10, help="-n of the bench (default 10)")
    args = p.parse_args()
    try:
        import torch

        from pycollectives import _C
    except ImportError as e:
        print(f"cuda_collectives: cannot import torch / pycollectives: {e}", file=sys.stderr)
        return 2
    if not getattr(_C, "cuda_built", lambda: False)():
        print("cuda_collectives: pycollectives was built without CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "cuda_collectives: no CUDA device here (torch.cuda.is_available() is False); "
            "run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    device = torch.cuda.get_device_name(0)
    bw = copy_bandwidth()
    print(f"# {device}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    nccl_env, nccl_note = nccl_setup()
    backends = "gloo,nccl" if nccl_env is not None else "gloo"
    nccl = ("compared, " if nccl_env else "not compared: ") + nccl_note
    it = ["-n", str(args.iters), "-w", "2", "--trials", "3"]
    big = ["-n", "3", "-w", "1", "--trials", "2"]
    runs: dict[int, list[dict]] = {}
    for n in [int(x) for x in args.ranks.split(",")]:
        rows = bench(n, ["-b", "8K", "-e", "512M", "-f", "4"], it, backends, nccl_env or {})["rows"]
        rows += bench(n, ["-b", "1G", "-e", "1G"], big, backends, nccl_env or {})["rows"]
        runs[n] = rows
    command = "python benchmarks/cuda_collectives.py " + " ".join(sys.argv[1:])
    section = render(runs, bw, device, command.strip(), nccl)
    write_section(section, BEGIN, END, Path(args.out))
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
