"""The command line: :func:`build_parser` (nccl-tests' flags, the launcher's and the comparisons')
and :func:`main`, which checks the flags and runs a rank (under torchrun or mpirun) or the
launcher (:mod:`pycollectives.bench.launch`).

This module imports neither torch nor the modules that do until the flags have been checked:
``--help`` and a bad flag answer at once (torch takes seconds to import, more on a cold disk)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from pycollectives.bench.report import check_matplotlib
from pycollectives.bench.specs import BACKENDS, COLLECTIVES, DTYPES, JOINT_ENV, OPS, parse_size


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return conv


def _coll_arg(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if names == ["all"]:
        return list(COLLECTIVES)
    bad = [c for c in names if c not in COLLECTIVES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown collective {', '.join(bad) or text!r}; choose from {', '.join(COLLECTIVES)} or all"
        )
    return list(dict.fromkeys(names))


def _compare_arg(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(bad)}; choose from gloo, mpi, nccl (--device cuda)"
        )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (nccl-tests flags plus launcher / comparison options)."""
    p = argparse.ArgumentParser(
        prog="pycollectives-bench",
        description="nccl-tests style collective benchmark for pycollectives "
        "(run under torchrun, or with --nproc N to spawn local ranks)",
    )
    p.add_argument(
        "-b",
        "--minbytes",
        type=_size_arg,
        default=8,
        help="smallest size (default 8; K/M/G suffixes)",
    )
    p.add_argument(
        "-e", "--maxbytes", type=_size_arg, default=64 << 20, help="largest size (default 64M)"
    )
    p.add_argument(
        "-f", "--stepfactor", type=_int_at_least(2), default=2, help="size multiplier (default 2)"
    )
    p.add_argument(
        "-n", "--iters", type=_int_at_least(1), default=20, help="iterations per trial (default 20)"
    )
    p.add_argument(
        "-w",
        "--warmup_iters",
        type=_int_at_least(0),
        default=5,
        help="warmup iterations (default 5)",
    )
    p.add_argument(
        "-c", "--check", type=int, choices=(0, 1), default=1, help="check results (default 1)"
    )
    p.add_argument("-o", "--op", choices=OPS, default="sum", help="reduction op (default sum)")
    p.add_argument(
        "-d",
        "--datatype",
        choices=list(DTYPES),
        default="float32",
        metavar="DTYPE",
        help=f"data type (default float32): {', '.join(DTYPES)}",
    )
    p.add_argument(
        "-r",
        "--root",
        type=_int_at_least(0),
        default=0,
        help="root of broadcast / reduce (default 0)",
    )
    p.add_argument(
        "--coll",
        type=_coll_arg,
        default=["all_reduce"],
        metavar="NAME[,NAME]",
        help=f"collectives: {', '.join(COLLECTIVES)} or all (default all_reduce)",
    )
    p.add_argument(
        "--trials", type=_int_at_least(1), default=5, help="timed trials per size (default 5)"
    )
    p.add_argument(
        "--nproc",
        type=_int_at_least(1),
        default=None,
        help="spawn this many local ranks (default 2; ignored under torchrun)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="overall timeout in seconds, also each operation's timeout (default 3600)",
    )
    p.add_argument(
        "--compare",
        type=_compare_arg,
        default=[],
        metavar="gloo[,mpi]",
        help="also run the same sizes on torch.distributed gloo (in the same ranks, after "
        "pycollectives) and/or MPI (mpi4py, a separate mpirun job afterwards; with --interleave 1 "
        "all in the same ranks under mpirun)",
    )
    p.add_argument(
        "--interleave",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: run --trials rounds, each of which goes over every size and runs one trial "
        "of pycollectives (and, with --compare, of each peer) at each size (-w warmup iterations "
        "before the first trial of a size, 1 before each later one), in the same ranks (run by "
        "mpirun when MPI is compared), instead of one sweep after the other with the trials of a "
        "size back to back: a slowdown of the machine spoils a trial or two of a size, which "
        "the median rejects, and a slow drift weighs on all alike; the buffers of all sizes "
        "stay allocated together, and a peer's threads may slow the microsecond sizes of "
        "pycollectives that follow them",
    )
    p.add_argument(
        "--bind",
        choices=("auto", "core", "none"),
        default="auto",
        help="with --nproc: core pins rank r to the r-th usable CPU (round robin), none leaves "
        "the ranks to the scheduler, auto (default) pins when there are at least as many CPUs as "
        "ranks, as mpirun binds 2 ranks to cores by default; mpirun jobs (MPI) get the same "
        "choice (--bind-to core, with more ranks than CPUs --map-by core:OVERSUBSCRIBE "
        "--bind-to core:overload-allowed; or none). Unpinned ranks that wake each other may be "
        "stacked on one CPU by the scheduler for a whole run",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the buffers live (default cpu); cuda: rank r uses cuda:(LOCAL_RANK %% "
        "device count), times are taken after torch.cuda.synchronize(), and --compare gloo "
        "runs on the same CUDA tensors",
    )
    p.add_argument(
        "-R",
        "--registered",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: pycollectives' buffers come from comm.alloc_shared (symmetric shared-memory "
        "windows, as nccl-tests -R with registered buffers), so all_reduce, reduce_scatter "
        "and all_gather run in place across the ranks' buffers; peers keep plain buffers "
        "(default 0)",
    )
    p.add_argument("--json", metavar="FILE", help="write every row and the run's metadata as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="pycoll",
        help="(advanced) backend run by the rank processes (default pycoll)",
    )
    return p


def _check_root(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a usage error (status 2) when --root is not one of the ranks to launch."""
    nproc = args.nproc or 2
    if args.root >= nproc:
        parser.error(f"--root {args.root} is not a rank (--nproc {nproc})")


def _under_mpirun() -> bool:
    """Whether this process is a rank of an mpirun job (MPI's launchers set these variables)."""
    return any(
        k in os.environ
        for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    )


def _cuda_unavailable() -> str | None:
    """Why --device cuda cannot run here, or None."""
    import torch

    from pycollectives import _C

    if not getattr(_C, "cuda_built", lambda: False)():
        return "pycollectives was built without CUDA"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pycollectives-bench`` / ``python -m pycollectives.bench``: parses `argv`
    (default ``sys.argv[1:]``) and runs a rank (under torchrun or mpirun) or the launcher.
    Returns the exit status (130 on Ctrl-C, 1 after an error, which it prints); a bad flag
    exits with status 2 (SystemExit, from argparse)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minbytes > args.maxbytes:
        parser.error(f"--minbytes {args.minbytes} is larger than --maxbytes {args.maxbytes}")
    if args.registered and args.device == "cuda":
        parser.error("-R 1: registered buffers are shared-memory windows, CPU only")
    if args.plot and (msg := check_matplotlib()):
        parser.error(msg)
    if "nccl" in args.compare + [args.backend] and args.device != "cuda":
        parser.error("nccl runs on CUDA tensors only: add --device cuda")
    if "mpi" in args.compare + [args.backend] and args.device == "cuda":
        parser.error("--device cuda: the mpi comparison runs on CPU buffers only")
    # A rank of a job (torchrun's, the launcher's or mpirun's), or the launcher of one.
    in_job = bool(os.environ.get(JOINT_ENV)) or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )
    runs_a_rank = in_job if args.backend != "mpi" else _under_mpirun()
    if not runs_a_rank:
        _check_root(parser, args)
    # The flags are good: now the modules that run (a rank imports torch; the launcher does not).
    from pycollectives.bench import launch

    if args.device == "cuda" and (msg := _cuda_unavailable()):
        print(f"pycollectives-bench: --device cuda: {msg}", file=sys.stderr)
        return 2
    if (
        "mpi" in args.compare + [args.backend]
        and not _under_mpirun()
        and (missing := launch.mpi_missing())
    ):
        parser.error(
            f"--compare mpi needs {' and '.join(missing)}, not found: {launch.MPI_INSTALL} "
            "(or leave mpi out of --compare)"
        )
    try:
        if runs_a_rank:
            from pycollectives.bench.rank import rank_main

            return rank_main(args)
        if args.backend == "mpi":
            return launch.launch_mpi(args)
        return launch.launch_ranks(args, argv)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        traceback.print_exc()
        print(
            f"pycollectives-bench: rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return 1
