"""The backends a rank process runs, behind one interface (:class:`Runner`): bind a collective to
its buffers, a barrier, the maximum of each trial's time over the ranks, the sum of the wrong
counts. :class:`PycollRunner` (pycollectives), :class:`GlooRunner` and :class:`NcclRunner`
(torch.distributed) meet at the launcher's TCPStore; :class:`MpiRunner` (mpi4py) at mpirun's."""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Sequence

import torch

from pycollectives.bench.meta import base_metadata, mpi_version, pycoll_version
from pycollectives.bench.specs import OPS, CollSpec


class Runner:
    """One backend on one rank: binds collectives to buffers, barriers, cross-rank reductions."""

    name = "?"
    check_nonroot_reduce = True  #: whether reduce() promises to leave non-root buffers unchanged
    probe_first_call = False  #: run the first call of each collective in try/except (n/a on error)

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def unsupported(self, spec: CollSpec, dtype: str, op: str) -> str | None:
        """A reason why this backend cannot run (spec, dtype, op), or None."""
        return None

    def bind(
        self, coll: str, inp: torch.Tensor, out: torch.Tensor | None, op: str, root: int
    ) -> Callable[[], None]:
        """A no-argument callable running one collective call on these buffers."""
        raise NotImplementedError

    def buffers(
        self, spec: CollSpec, count: int, dtype: torch.dtype, device: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input, output) of one call on `device` (None: CPU); output is None for the
        in-place collectives."""
        n, empty = self.world_size, self.empty
        if spec.inplace:
            return empty(count, dtype, device), None
        if spec.name == "all_gather":
            return empty(count, dtype, device), empty(n * count, dtype, device)
        if spec.name == "reduce_scatter":
            return empty(n * count, dtype, device), empty(count, dtype, device)
        if spec.name == "sendrecv":
            return empty(count, dtype, device), empty(count, dtype, device)
        return empty(n * count, dtype, device), empty(n * count, dtype, device)  # all_to_all

    def empty(self, numel: int, dtype: torch.dtype, device: str | None) -> torch.Tensor:
        """An uninitialized buffer for `buffers`."""
        return torch.empty(numel, dtype=dtype, device=device)

    def barrier(self) -> None:
        """Barrier over all ranks."""
        raise NotImplementedError

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        raise NotImplementedError

    def sum_over_ranks(self, value: int) -> int:
        """Sum of an integer over ranks."""
        raise NotImplementedError

    def paths(self, coll: str) -> dict[str, int]:
        """This rank's calls of `coll` so far by the path they took (empty where the backend
        does not say)."""
        return {}

    def describe(self) -> list[str]:
        """Header lines describing the backend."""
        return []

    def close(self) -> None:
        """Release the backend."""


class PycollRunner(Runner):
    """pycollectives Communicator."""

    name = "pycoll"

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: object,
        timeout: float,
        registered: int = 0,
        cuda: bool = False,
    ) -> None:
        super().__init__(rank, world_size)
        self.cuda = cuda
        import torch.distributed as dist

        import pycollectives as pc

        self.registered = bool(registered)

        self.pc = pc
        self.comm = pc.init(
            rank=rank,
            world_size=world_size,
            store=dist.PrefixStore("bench/pycoll", store),
            timeout=timeout,
        )
        self.ops = {o: getattr(pc.ReduceOp, o.upper()) for o in OPS}

    def unsupported(self, spec, dtype, op):  # noqa: D102
        if spec.name == "sendrecv" and self.cuda:
            return "pycollectives' batch_p2p takes CPU buffers only"
        return None

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        c, o = self.comm, self.ops[op]
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        return {
            "sendrecv": lambda: c.batch_p2p([("send", inp, nxt), ("recv", out, prv)]),
            "all_reduce": lambda: c.all_reduce(inp, o),
            "reduce_scatter": lambda: c.reduce_scatter(out, inp, o),
            "all_gather": lambda: c.all_gather(out, inp),
            "broadcast": lambda: c.broadcast(inp, root),
            "reduce": lambda: c.reduce(inp, root, o),
            "all_to_all": lambda: c.all_to_all(out, inp),
        }[coll]

    def empty(self, numel, dtype, device):  # noqa: D102
        if self.registered and device is None:
            return self.comm.alloc_shared(numel, dtype)  # collective: same order on every rank
        return super().empty(numel, dtype, device)

    def barrier(self):  # noqa: D102
        self.comm.barrier()

    def max_over_ranks(self, values):  # noqa: D102
        t = torch.tensor(list(values), dtype=torch.float64)
        self.comm.all_reduce(t, self.ops["max"])
        return t.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        t = torch.tensor([value], dtype=torch.int64)
        self.comm.all_reduce(t, self.ops["sum"])
        return int(t.item())

    def paths(self, coll):  # noqa: D102
        return dict(self.comm.stats().get(coll, {}).get("paths", {}))

    def describe(self):  # noqa: D102
        simd = self.pc.simd_level() if hasattr(self.pc, "simd_level") else "?"
        env = " ".join(f"{k}={v}" for k, v in base_metadata()["env"].items())
        return [
            f"# backend pycoll: pycollectives {pycoll_version()}  simd_level: {simd}",
            f"# algorithm env: {env}",
            f"# buffers: {'registered (comm.alloc_shared windows)' if self.registered else 'plain'}",
            f"# single copy (CMA) between ranks: {'yes' if self.comm.single_copy else 'no'}",
        ]

    def close(self):  # noqa: D102
        self.comm.close()


class GlooRunner(Runner):
    """torch.distributed ProcessGroupGloo."""

    name = "gloo"
    check_nonroot_reduce = False  # torch does not promise anything about non-root reduce buffers
    probe_first_call = True
    device = torch.device("cpu")  # of the ranks' helper tensors (max/sum over ranks)

    def __init__(self, rank: int, world_size: int, store: object, timeout: float) -> None:
        super().__init__(rank, world_size)
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        self.dist = dist
        dist.init_process_group(
            self.name,
            store=dist.PrefixStore(f"bench/{self.name}", store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        ops = dist.ReduceOp
        self.ops = {
            "sum": ops.SUM,
            "prod": ops.PRODUCT,
            "min": ops.MIN,
            "max": ops.MAX,
            "avg": ops.AVG,
        }

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        d, o = self.dist, self.ops[op]
        reduce_scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        all_gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size

        def sendrecv() -> None:
            ops = [d.P2POp(d.isend, inp, nxt), d.P2POp(d.irecv, out, prv)]
            for w in d.batch_isend_irecv(ops):
                w.wait()

        return {
            "sendrecv": sendrecv,
            "all_reduce": lambda: d.all_reduce(inp, o),
            "reduce_scatter": lambda: reduce_scatter(out, inp, o),
            "all_gather": lambda: all_gather(out, inp),
            "broadcast": lambda: d.broadcast(inp, src=root),
            "reduce": lambda: d.reduce(inp, dst=root, op=o),
            "all_to_all": lambda: d.all_to_all_single(out, inp),
        }[coll]

    def barrier(self):  # noqa: D102
        self.dist.barrier()

    def max_over_ranks(self, values):  # noqa: D102
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, self.ops["max"])
        return t.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, self.ops["sum"])
        return int(t.item())

    def describe(self):  # noqa: D102
        return [f"# backend gloo: torch.distributed ProcessGroupGloo (torch {torch.__version__})"]

    def close(self):  # noqa: D102
        self.dist.destroy_process_group()


class NcclRunner(GlooRunner):
    """torch.distributed ProcessGroupNCCL on CUDA tensors (--device cuda). Several
    ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1; an
    NCCL that refuses them fails at the first call, reported as n/a."""

    name = "nccl"

    def __init__(self, rank: int, world_size: int, store: object, timeout: float) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, world_size, store, timeout)

    def barrier(self):  # noqa: D102
        t = torch.zeros(1, device=self.device)
        self.dist.all_reduce(t)
        torch.cuda.synchronize(self.device)

    def describe(self):  # noqa: D102
        v = ".".join(str(x) for x in torch.cuda.nccl.version())
        return [
            f"# backend nccl: torch.distributed ProcessGroupNCCL, NCCL {v} (torch "
            f"{torch.__version__}), NCCL_MULTI_RANK_GPU_ENABLE="
            f"{os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE', '(unset)')}"
        ]


class MpiRunner(Runner):
    """mpi4py buffer methods on MPI.COMM_WORLD (numpy views of the same torch buffers)."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def unsupported(self, spec, dtype, op):  # noqa: D102
        if dtype in ("float16", "bfloat16"):
            return f"MPI has no standard {dtype} type"
        if spec.reduces and op not in self.ops:
            return f"MPI has no {op} reduction"
        return None

    def bind(self, coll, inp, out, op, root):  # noqa: D102
        c, o, inplace = self.comm, self.ops.get(op), self.MPI.IN_PLACE
        a = inp.numpy()
        b = out.numpy() if out is not None else None
        if coll == "reduce":
            if self.rank == root:
                return lambda: c.Reduce(inplace, a, o, root)
            return lambda: c.Reduce(a, None, o, root)
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        return {
            "sendrecv": lambda: c.Sendrecv(a, nxt, 0, b, prv, 0),
            "all_reduce": lambda: c.Allreduce(inplace, a, o),
            "reduce_scatter": lambda: c.Reduce_scatter_block(a, b, o),
            "all_gather": lambda: c.Allgather(a, b),
            "broadcast": lambda: c.Bcast(a, root),
            "all_to_all": lambda: c.Alltoall(a, b),
        }[coll]

    def barrier(self):  # noqa: D102
        self.comm.Barrier()

    def max_over_ranks(self, values):  # noqa: D102
        import numpy as np

        a = np.array(values, dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, a, self.MPI.MAX)
        return a.tolist()

    def sum_over_ranks(self, value):  # noqa: D102
        return int(self.comm.allreduce(int(value), self.MPI.SUM))

    def describe(self):  # noqa: D102
        return [f"# backend mpi: {mpi_version()} (mpi4py buffer methods)"]
