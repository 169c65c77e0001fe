"""Collectives on registered buffers: tensors in symmetric shared-memory windows.

torchrun --nproc-per-node 2 examples/windows.py

comm.alloc_shared allocates a tensor that every peer maps, so an all-reduce of
it, a reduce-scatter from it and an all-gather into it run in place across the
ranks' buffers. The example checks the results and compares the bytes each
rank pushed through the shared slots, with plain tensors and with windows.
"""

import torch

import pycollectives as pc


def slot_bytes(comm: pc.Communicator) -> int:
    """Bytes this rank sent through the slots (or published on the windows) so far."""
    return int(sum(v["bytes_sent"] for v in comm.stats().values()))


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

    before = slot_bytes(comm)
    run(comm, torch.empty(numel))
    plain = slot_bytes(comm) - before

    window = comm.alloc_shared(numel)  # collective: every rank, same size, same order
    before = slot_bytes(comm)
    run(comm, window)
    shared = slot_bytes(comm) - before

    if comm.rank == 0:
        print(f"world {n}: bytes sent per rank, plain tensors {plain}, window tensors {shared}")
    comm.close()


if __name__ == "__main__":
    main()
