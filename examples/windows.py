"""Collectives on registered buffers: tensors in symmetric shared-memory windows.

torchrun --nproc-per-node 2 examples/windows.py

comm.alloc_shared allocates a tensor that every peer maps, so an all-reduce of
it, a reduce-scatter from it and an all-gather into it run in place across the
ranks' buffers. The example checks the results and prints the path each
collective took (comm.stats()), with plain tensors and with windows: plain
tensors go through the slots or, where the kernel allows it, single copy (cma).
"""

import torch

import pycollectives as pc

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def paths(comm: pc.Communicator) -> dict[str, dict[str, int]]:
    """Calls so far by collective and path."""
    return {c: dict(comm.stats().get(c, {}).get("paths", {})) for c in COLLECTIVES}


def taken(comm: pc.Communicator, before: dict[str, dict[str, int]]) -> str:
    """The paths the collectives took since `before`, e.g. 'all_reduce: direct, ...'."""
    now = paths(comm)
    return ", ".join(
        f"{c}: " + "+".join(p for p, k in now[c].items() if k != before[c].get(p, 0))
        for c in COLLECTIVES
    )


def run(comm: pc.Communicator, buf: torch.Tensor) -> None:
    """All-reduce, reduce-scatter and all-gather of `buf`, checked exactly."""
    r, n = comm.rank, comm.world_size
    k = buf.numel() // n
    buf.copy_(torch.arange(buf.numel()) % 7 + r)
    comm.all_reduce(buf)
    assert torch.equal(buf, (torch.arange(buf.numel()) % 7) * n + n * (n - 1) / 2)
    shard = torch.empty(k)
    comm.reduce_scatter(shard, buf)  # block r of the sum of every rank's buf
    assert torch.equal(shard, buf[r * k : (r + 1) * k] * n)
    comm.all_gather(buf, shard)
    assert torch.equal(buf[r * k : (r + 1) * k], shard)


def main() -> None:
    comm = pc.init()
    n = comm.world_size
    numel = n * (1 << 18)  # 1 MiB of float32 per rank and block

    before = paths(comm)
    run(comm, torch.empty(numel))
    plain = taken(comm, before)

    window = comm.alloc_shared(numel)  # collective: every rank, same size, same order
    before = paths(comm)
    run(comm, window)
    shared = taken(comm, before)

    if comm.rank == 0:
        print(f"world {n}: plain tensors: {plain}")
        print(f"world {n}: window tensors: {shared}")
    comm.close()


if __name__ == "__main__":
    main()
