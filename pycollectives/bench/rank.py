"""The body of one rank process, started by torchrun, by the ``--nproc`` launcher
(:mod:`pycollectives.bench.launch`) or by mpirun: it meets the other ranks (a TCPStore, or MPI's
world), starts each backend's :class:`~pycollectives.bench.runners.Runner`, runs the sweeps, and
on rank 0 hands the rows to the launcher (``PYCOLL_BENCH_RESULT``) or reports them itself.

The launcher talks to its ranks through the environment variables of
:mod:`~pycollectives.bench.specs` (``RESULT_ENV``, ``JOINT_ENV``, ``CPU_ENV``)."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time

import torch

from pycollectives.bench.meta import base_metadata, command_line, mpi_version, pycoll_version
from pycollectives.bench.report import Row, finalize, write_json
from pycollectives.bench.runners import GlooRunner, MpiRunner, NcclRunner, PycollRunner, Runner
from pycollectives.bench.specs import CPU_ENV, DTYPES, JOINT_ENV, RESULT_ENV, SPECS
from pycollectives.bench.sweep import bench_collective


def _make_store(rank: int, world_size: int, timeout: float) -> object:
    """The TCPStore the ranks meet at (MASTER_ADDR, MASTER_PORT; rank 0 serves it unless torchrun's
    agent does), under the prefix ``pycoll-bench``."""
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun already serves it
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=(rank == 0 and not agent),
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dist.PrefixStore("pycoll-bench", store)


def _run_header(runner: Runner, args: argparse.Namespace, ranks_info: list[str]) -> str:
    """The header of one backend's run: the flags, how times are taken, the backend's own lines
    and one line per rank (pid, CPUs, device)."""
    dname, tname = DTYPES[args.datatype]
    lines = [
        f"# pycollectives-bench  backend: {runner.name}  nranks: {runner.world_size}  "
        f"collectives: {','.join(args.coll)}",
        f"# minBytes {args.minbytes} maxBytes {args.maxbytes} step: {args.stepfactor}(factor) "
        f"warmup iters: {args.warmup_iters} iters: {args.iters} trials: {args.trials} "
        f"validation: {args.check}",
        f"# dtype: {dname} ({tname})  op: {args.op}  root: {args.root}",
        f"# time: median over {args.trials} trials of (max over ranks of the time per iteration); "
        "algbw = size / time; busbw = algbw * factor",
        *runner.describe(),
        "#",
        *ranks_info,
        "#",
    ]
    return "\n".join(lines)


def rank_main(args: argparse.Namespace) -> int:
    """Body of one rank process (torchrun, the --nproc launcher, or mpirun for --backend mpi).
    Returns the exit status: 2 when --root is not a rank; 0 when the launcher collects the rows
    (PYCOLL_BENCH_RESULT); else 1 if any value was wrong, 0 if none. A backend's errors
    propagate."""
    joint = bool(os.environ.get(JOINT_ENV))  # under mpirun, MPI beside the others
    if args.backend == "mpi" or joint:
        mpi = MpiRunner()
        rank, world = mpi.rank, mpi.world_size
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "mpi":
        runners_todo: list[str] = ["mpi"]
        store = None
    else:
        runners_todo = [args.backend] + [b for b in args.compare if b not in (args.backend, "mpi")]
        runners_todo += ["mpi"] if joint else []
        store = _make_store(rank, world, args.timeout)

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    if args.root >= world:
        if rank == 0:
            print(
                f"pycollectives-bench: error: --root {args.root} is not a rank (nranks {world})",
                file=sys.stderr,
            )
        return 2
    if args.nproc is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        say("# --nproc is ignored under torchrun (one process per rank)")
    if "mpi" in args.compare and args.backend != "mpi" and not os.environ.get(RESULT_ENV):
        say(
            "# --compare mpi: only available when the benchmark spawns the ranks itself (--nproc); skipped"
        )

    info = f"#  Rank {rank:2d} Pid {os.getpid():6d} on {socket.gethostname()}"
    if (cpu := os.environ.get(CPU_ENV)) is not None:
        os.sched_setaffinity(0, {int(cpu)})
    if hasattr(os, "sched_getaffinity"):
        info += f" cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}"
    args.cuda_device = None
    if getattr(args, "device", "cpu") == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        args.cuda_device = f"cuda:{local % torch.cuda.device_count()}"  # a str: JSON metadata
        torch.cuda.set_device(args.cuda_device)
        info += f" device {args.cuda_device} {torch.cuda.get_device_name(args.cuda_device)}"
    if store is not None:
        store.set(f"info/{rank}", info)
        ranks_info = [store.get(f"info/{r}").decode() for r in range(world)] if rank == 0 else []
    else:
        ranks_info = mpi.comm.gather(info, root=0) or []

    rows: list[Row] = []
    extra_meta: dict[str, str] = {}
    runners: list[Runner] = []
    for backend in runners_todo:
        if backend == "pycoll":
            cuda = args.cuda_device is not None
            runner: Runner = PycollRunner(
                rank, world, store, args.timeout, args.registered, cuda=cuda
            )
            extra_meta["pycollectives"] = pycoll_version()
            extra_meta["simd_level"] = (
                runner.pc.simd_level() if hasattr(runner.pc, "simd_level") else "?"
            )
            extra_meta["buffers"] = "registered" if args.registered else "plain"
            extra_meta["single_copy"] = "yes" if runner.comm.single_copy else "no"
        elif backend == "gloo":
            runner = GlooRunner(rank, world, store, args.timeout)
        elif backend == "nccl":
            runner = NcclRunner(rank, world, store, args.timeout)
        else:
            runner = mpi
            extra_meta["mpi"] = mpi_version()
            extra_meta["mpi4py"] = __import__("mpi4py").__version__
        say(_run_header(runner, args, ranks_info))
        runners.append(runner)
    for coll in args.coll:
        rows += bench_collective(runners, SPECS[coll], args, say)
    for runner in runners:
        runner.close()

    if store is not None:  # rank 0 serves the store: let it leave last
        store.add("done", 1)
        if rank == 0:
            deadline = time.monotonic() + 60
            while store.add("done", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)

    wrong = sum(r.wrong or 0 for r in rows)
    if rank == 0:
        meta = base_metadata()
        meta["command"] = command_line(sys.argv[1:])
        meta["versions"].update(extra_meta)
        meta.update(nranks=world, backends=runners_todo, args=dict(vars(args)))
        result = os.environ.get(RESULT_ENV)
        if result:
            write_json(result, meta, rows)
            return 0
        return finalize(args, meta, rows, runners_todo)
    if os.environ.get(RESULT_ENV):
        return 0
    return 1 if wrong else 0
