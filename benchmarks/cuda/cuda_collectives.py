"""pycollectives on CUDA tensors against torch.distributed gloo (and NCCL where
it allows several ranks per GPU), 2 and 4 ranks on one GPU, with a roofline.

    python benchmarks/cuda/cuda_collectives.py [--ranks 2,4] [--out docs/benchmarks.md]

For each world size runs `pycollectives-bench --device cuda` for all-reduce,
reduce-scatter and all-gather: pycollectives' default (direct) path and its
staging ring (PYCOLL_ALGO=ring) from 16 KiB to 1 GiB by factors of 4, gloo on
the same CUDA tensors at 64 KiB, 4 MiB and 256 MiB (it is ~1000x slower at
large sizes), every row checked (-c 1). In the same run it
measures the device-to-device copy bandwidth (torch copy_ of 256 MiB, CUDA
events) and derives the roofline of each row: the fewest bytes each rank must
read and write, whatever the algorithm (each input byte read once, each output
byte written once),
    all_reduce      2 S                  (S: the buffer; read S, write S)
    reduce_scatter  S (n + 1) / n        (S: the input, n blocks; write one block)
    all_gather      S (n + 1) / n        (S: the output, n blocks; read one block)
times the number of ranks that share one GPU (they share its memory
bandwidth), divided by the copy bandwidth (bytes read + written per second).
The direct path moves exactly these bytes with 2 ranks; with n ranks its
all-reduce and all-gather read each pushed part ceil((n - 1) / 2) times.
Then it saves every run (--save, JSON: the machine, the copy bandwidth, each
bench's metadata and rows) and rewrites its section of docs/benchmarks.md
(between the cuda_collectives markers) with the commands, the device, the
date, every figure and the targets (>= 80 % of the roofline from 64 MiB,
>= 20x gloo) checked. `--render FILE` rewrites the section from a saved file
(no GPU needed).

NCCL: compared when torch's NCCL (or the one of an installed nvidia-nccl-cu12/
cu13 wheel, preloaded) is >= 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1; otherwise
the section says what was found. Without a GPU it exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from _doc import run_bench, write_section

COLLS = ["all_reduce", "reduce_scatter", "all_gather"]
BEGIN, END = "<!-- cuda_collectives:begin -->", "<!-- cuda_collectives:end -->"
ROOT = Path(__file__).resolve().parents[2]


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


SIZES = ["-b", "16K", "-e", "1G", "-f", "4"]
PEER_SIZES = ["-b", "64K", "-e", "256M", "-f", "64"]


def bench(nranks: int, backend: str, env: dict, label: str) -> dict:
    """One bench run (its JSON: metadata and rows, the rows' backend set to `label`)."""
    flags = ["--device", "cuda", "--coll", ",".join(COLLS), "--backend", backend, "-c", "1",
             "--timeout", "600"]  # fmt: skip
    if backend == "pycoll":
        flags += [*SIZES, "-n", "10", "-w", "2", "--trials", "3"]
    else:
        flags += [*PEER_SIZES, "-n", "2", "-w", "1", "--trials", "1"]
    data = run_bench(nranks, flags, env)
    data["rows"] = [dict(r, backend=label) for r in data["rows"]]
    if env:
        data["metadata"]["command"] = (
            " ".join(f"{k}={v}" for k, v in env.items())
            + " "
            + (data["metadata"].get("command", ""))
        )
    return data


def nccl_attempt(nranks: int, env: dict) -> str:
    """What NCCL does with `nranks` ranks on one GPU: one all-reduce of 1 MiB."""
    flags = ["--device", "cuda", "--backend", "nccl", "-b", "1M", "-e", "1M", "-n", "1", "-w", "0",
             "--trials", "1", "--timeout", "120"]  # fmt: skip
    try:
        rows = run_bench(nranks, flags, env)["rows"]
    except subprocess.CalledProcessError as e:
        return f"the {nranks}-rank NCCL run failed (exit {e.returncode}; its error is in the log)"
    note = rows[0].get("note") if rows else "no rows"
    return note or f"ran: {rows[0].get('time_us')} us"


def traffic(coll: str, size: int, n: int) -> float:
    """The fewest bytes one rank must read and write (see the module's docstring)."""
    return 2 * size if coll == "all_reduce" else size * (n + 1) / n


def fmt_size(b: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def cell(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "n/a"


def render(saved: dict) -> str:
    """The docs section for a saved measurement (see main)."""
    ngpu, bw = saved["ngpu"], saved["copy_bw"]
    lines = [
        BEGIN,
        "## CUDA collectives (pycollectives vs gloo vs NCCL, ranks sharing one GPU)",
        "",
        f"{saved['device']} ({ngpu} GPU visible), {saved['date']}, torch {saved['torch']}.",
        f"Device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s (bytes read + written per "
        f"second; {saved['copy_bw_note']}). Roofline: the fewest bytes each rank must read "
        "and write, times the ranks sharing the GPU, over that bandwidth (see the script). "
        "`pycoll`: the default (direct CUDA IPC) path; `ring`: the staging ring "
        "(`PYCOLL_ALGO=ring`). Times: median over trials of the slowest rank's time per call.",
        f"NCCL: {saved['nccl']}.",
        "",
        "Commands:",
        "",
        *[f"- `{r['metadata'].get('command', '?')}`" for r in saved["runs"]],
        "",
    ]
    runs: dict[int, list[dict]] = {}
    for r in saved["runs"]:
        runs.setdefault(r["metadata"]["nranks"], []).extend(r["rows"])
    verdicts = []
    for n, rows in sorted(runs.items()):
        share = max(1, -(-n // ngpu))
        by = {(r["backend"], r["collective"], r["size"]): r for r in rows}
        for coll in COLLS:
            lines += [
                f"### {coll}, {n} ranks ({share} per GPU)",
                "",
                "| size | pycoll us | busbw GB/s | roofline us | % of roofline | ring us "
                "| gloo us | x gloo | nccl us | wrong |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            worst_roof, worst_gloo = None, None

            def us(backend: str, size: int, by=by, coll=coll) -> float | None:
                r = by.get((backend, coll, size))
                return r["time_us"] if r and r.get("time_us") else None

            for size in sorted({s for b, c, s in by if c == coll}):
                own = by.get(("pycoll", coll, size))
                if own is None or not own.get("time_us"):
                    continue
                roof = share * traffic(coll, size, n) / bw * 1e6
                frac = roof / own["time_us"]
                gloo = us("gloo", size)
                xg = gloo / own["time_us"] if gloo else None
                if size >= 64 << 20:
                    worst_roof = frac if worst_roof is None else min(worst_roof, frac)
                if xg is not None:
                    worst_gloo = xg if worst_gloo is None else min(worst_gloo, xg)
                wrong = sum(
                    int(r.get("wrong") or 0)
                    for b in ("pycoll", "ring", "gloo", "nccl")
                    if (r := by.get((b, coll, size)))
                )
                lines.append(
                    f"| {fmt_size(size)} | {own['time_us']:.1f} | {own['busbw']:.2f} | {roof:.1f} "
                    f"| {100 * frac:.0f} | {cell(us('ring', size))} | {cell(gloo)} "
                    f"| {cell(xg)} | {cell(us('nccl', size))} | {wrong} |"
                )
            lines.append("")
            roof_ok = worst_roof is not None and worst_roof >= 0.8
            gloo_ok = worst_gloo is not None and worst_gloo >= 20
            verdicts.append(
                f"- {coll}, {n} ranks: from 64 MiB, at least "
                + (f"{100 * worst_roof:.0f} %" if worst_roof is not None else "n/a")
                + f" of the roofline ({'met' if roof_ok else 'NOT met'}, target 80 %); "
                + (
                    f"at least {worst_gloo:.1f}x gloo at every size measured "
                    f"({'met' if gloo_ok else 'NOT met'}, target 20x)"
                    if worst_gloo is not None
                    else "gloo not measured"
                )
            )
    lines += ["### Targets", "", *verdicts, "", END]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument(
        "--save",
        default=os.path.join(os.environ.get("OUT", "."), "cuda_collectives.json"),
        help="where the runs are saved (default $OUT/cuda_collectives.json, else ./)",
    )
    p.add_argument("--render", metavar="FILE", help="only rewrite the section from a saved file")
    p.add_argument(
        "--no-ring", action="store_true", help="skip the staging ring (PYCOLL_ALGO=ring) runs"
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the runs of other world sizes already saved in --save (one world size per "
        "device call: --ranks 2, then --ranks 4 --append)",
    )
    args = p.parse_args()
    if args.render:
        return write(json.loads(Path(args.render).read_text()), Path(args.out))
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
    saved = {
        "device": torch.cuda.get_device_name(0),
        "ngpu": torch.cuda.device_count(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "copy_bw": copy_bandwidth(),
        "copy_bw_note": "torch copy_ of 256 MiB, CUDA events, in the same run",
        "runs": [],
    }
    ranks = [int(x) for x in args.ranks.split(",")]
    if args.append and Path(args.save).exists():
        old = json.loads(Path(args.save).read_text())
        saved["runs"] = [r for r in old["runs"] if r["metadata"]["nranks"] not in ranks]
    print(
        f"# {saved['device']}: device-to-device copy {saved['copy_bw'] / 1e9:.0f} GB/s", flush=True
    )
    nccl_env, nccl_note = nccl_setup()
    prefix = "compared, " if nccl_env else "not compared: "
    for n in ranks:
        saved["runs"].append(bench(n, "pycoll", {}, "pycoll"))
        if not args.no_ring:
            saved["runs"].append(bench(n, "pycoll", {"PYCOLL_ALGO": "ring"}, "ring"))
        saved["runs"].append(bench(n, "gloo", {}, "gloo"))
        if nccl_env is not None:
            saved["runs"].append(bench(n, "nccl", nccl_env, "nccl"))
        else:
            nccl_note += f"; tried anyway with {n} ranks: " + nccl_attempt(n, {})
        saved["nccl"] = prefix + nccl_note
        Path(args.save).write_text(json.dumps(saved, indent=1))  # kept if a later n fails
    return write(saved, Path(args.out))


def write(saved: dict, out: Path) -> int:
    section = render(saved)
    write_section(section, BEGIN, END, out)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
