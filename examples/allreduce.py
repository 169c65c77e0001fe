"""All-reduce, all-gather, an asynchronous all-reduce and a sub-communicator.

torchrun --nproc-per-node 4 examples/allreduce.py
"""

import torch

import pycollectives as pc


def main() -> None:
    comm = pc.init()
    r, n = comm.rank, comm.world_size

    t = torch.full((1000,), float(r))
    comm.all_reduce(t)
    assert torch.all(t == n * (n - 1) / 2)

    out = torch.empty(n * 3)
    comm.all_gather(out, torch.arange(3.0) + 10 * r)

    grads = [torch.randn(1 << 16) for _ in range(4)]
    works = [comm.all_reduce(g, op=pc.ReduceOp.AVG, async_op=True) for g in grads]
    x = torch.randn(512, 512)
    y = x @ x  # computed while the all-reduces run on the progress thread
    for w in works:
        w.wait()

    pairs = comm.split(color=r // 2)  # ranks {0,1}, {2,3}, ...
    s = torch.tensor([float(r)])
    pairs.all_reduce(s)

    if r == 0:
        print(
            f"world {n}: all_reduce {t[0].item()}, all_gather {out.tolist()}, pair sum {s.item()}"
        )
        print(f"stats: {comm.stats()['all_reduce']}")
    del y
    pairs.close()
    comm.close()


if __name__ == "__main__":
    main()
