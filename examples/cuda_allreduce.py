"""Collectives on CUDA tensors: a synchronous all-reduce, an asynchronous
all-gather overlapped with a matrix product on another stream, and the path
each took. Several ranks may share one GPU (rank r uses cuda:(r % devices)).

torchrun --nproc-per-node 2 examples/cuda_allreduce.py

Exits with status 2 and says why where there is no CUDA device or the
extension was built without CUDA.
"""

import sys

import torch

import pycollectives as pc
from pycollectives import _C


def main() -> int:
    if not _C.cuda_built() or not torch.cuda.is_available():
        why = "built without CUDA" if not _C.cuda_built() else "no CUDA device"
        print(f"cuda_allreduce: needs a GPU ({why})", file=sys.stderr)
        return 2
    comm = pc.init()
    r, n = comm.rank, comm.world_size
    dev = torch.device("cuda", r % torch.cuda.device_count())
    torch.cuda.set_device(dev)

    t = torch.full((1 << 20,), float(r + 1), device=dev)
    comm.all_reduce(t)  # the current stream waits for it: t is ready for the next kernel
    assert bool((t == n * (n + 1) / 2).all())

    side = torch.cuda.Stream(dev)
    x = torch.randn(2048, 2048, device=dev)
    with torch.cuda.stream(side):
        y = x @ x  # compute on another stream, not waited for by the collective
    out = torch.empty(n * 4, device=dev)
    work = comm.all_gather(out, torch.arange(4.0, device=dev) + 10 * r, async_op=True)
    work.wait()  # orders the current stream after the all-gather
    torch.cuda.current_stream(dev).wait_stream(side)
    gathered = out.cpu().tolist()
    del y

    paths = {op: comm.stats()[op]["paths"] for op in ("all_reduce", "all_gather")}
    if r == 0:
        print(f"world {n} on {torch.cuda.get_device_name(dev)}: all_reduce {t[0].item()}")
        print(f"all_gather {gathered}")
        print(f"paths: {paths}")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
