"""The CUDA side of zero_step.py's notes: the GPU, its driver and torch's,
CUDA's and NCCL's versions, and what a --device cuda run measured how."""

from __future__ import annotations

import argparse
import subprocess


def gpu_versions() -> str:
    """The GPU (name, memory, count), its driver, and torch's, CUDA's and NCCL's versions."""
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        import torch.cuda.nccl

        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001 - said in the notes
        nccl = f"unknown ({type(e).__name__})"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        driver = smi.stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return (
        f"GPU: {torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB), "
        f"driver {driver}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}."
    )


def cuda_notes(
    args: argparse.Namespace, params: int, load0: tuple, load1: tuple, secs: float
) -> list[str]:
    """The notes of a --device cuda run."""
    return [
        gpu_versions(),
        f"Model: GPT vocab {args.vocab}, seq {args.seq}, {args.layers} blocks, d_model "
        f"{args.d_model}, {args.heads} heads, tied head: {params / 1e6:.1f}M fp32 parameters "
        f"(torch's default matmul precision); {args.ranks} ranks, rank r on cuda:(r % GPUs), so "
        f"ranks share a GPU; batch {args.batch} x {args.seq} tokens per rank; AdamW (torch's, "
        f"every setup); model, batch and optimizer state on the GPU. {args.rounds} rounds of "
        f"(each setup in ranks of its own: started, built, {args.warmup} warm-up and "
        f"{args.steps} timed steps), the order reversed every other round; the clocks read "
        "after torch.cuda.synchronize() before the step, after forward + backward and after "
        "the update; step = median over the timed steps of the slowest rank. compute: every "
        "rank's own step with no communication, the ranks sharing the GPU at the same time.",
        "On CUDA the meter's exposed columns are the time the host was blocked in those waits "
        "(a CUDA collective's wait returns once its last kernel is queued, the stream then "
        "waits on the GPU). not run: the cell's ranks failed or passed --cell-timeout "
        f"({args.cell_timeout:.0f} s): the first line of the error and, where it has more, "
        "its last.",
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {secs:.0f} s in all.",
    ]
