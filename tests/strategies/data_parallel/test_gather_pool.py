"""The sharding engine's GatherPool: a unit's freed full buffer (CPU) is handed
to the next gather of the same size instead of going back to malloc (the next
gather would fault fresh pages in), views into the buffer stay valid, at most
one buffer per size is kept, and nothing is kept between steps."""

from __future__ import annotations

import torch
from zero_common import CFG, OPT, local_batch

import pycollectives as pc
from pycollectives.strategies.data_parallel.sharding.flat_param import (
    FlatLayout,
    FlatParam,
    GatherPool,
)
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig


def _flat(pool: GatherPool | None) -> FlatParam:
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]
    layout = FlatLayout.build(
        [("w", (), (7, 5)), ("b", (), (11,))], torch.float32, True, world_size=2
    )
    flat = FlatParam(layout, params, 0, sharded=True)
    flat.pool = pool
    return flat


def test_freed_buffer_goes_to_the_next_gather_of_its_size():
    assert GatherPool.supported(torch.device("cpu"))
    pool = GatherPool()
    a, b, c = _flat(pool), _flat(pool), _flat(pool)
    n = a.layout.padded_numel * 4
    a.alloc_full()
    a.full.copy_(torch.arange(a.layout.padded_numel, dtype=torch.float32))
    view = a.full[3:9].view(2, 3)  # as autograd saves a parameter's view
    addr = a.full.untyped_storage().data_ptr()
    b.alloc_full()
    a.free_full()
    b.free_full()  # one buffer of this size is kept already: b's goes back to malloc
    assert a.full.untyped_storage().nbytes() == 0 and b.full.untyped_storage().nbytes() == 0
    assert pool.nbytes == n
    c.alloc_full()  # a's memory, not fresh pages
    assert c.full.untyped_storage().data_ptr() == addr and pool.nbytes == 0
    c.free_full()
    a.alloc_full()  # back into a's own storage object: its old view sees it again
    assert a.full.untyped_storage().data_ptr() == addr
    assert torch.equal(view, torch.arange(3, 9, dtype=torch.float32).view(2, 3))
    a.free_full()
    pool.clear()
    assert pool.nbytes == 0


def job_step_reuses_buffers(comm: pc.Communicator) -> dict:
    """ZeRO-3 on six blocks: how many gathers took a kept buffer in the third
    step, how many gathers there were, and what the pool keeps after backward."""
    deep = GPTConfig(**{**CFG.__dict__, "n_layer": 6})
    model = GPT(deep)
    zero = ZeroOptimizer(model, torch.optim.AdamW, comm, stage=3, **OPT)
    engine = zero.engine
    hits = [0]
    take = engine.gather_pool.take

    def counting(storage: torch.UntypedStorage, nbytes: int) -> bool:
        got = take(storage, nbytes)
        hits[0] += got
        return got

    engine.gather_pool.take = counting
    for _ in range(3):
        hits[0] = 0
        engine.meter.reset()
        zero.zero_grad()
        model(*local_batch(comm, 0)).backward()
        kept_after_backward = engine.gather_pool.nbytes
        zero.step()
    return {"hits": hits[0], "gathers": engine.meter.gathers, "kept": kept_after_backward}


def test_a_step_reuses_freed_buffers_and_keeps_none_after(pool):
    for r, got in enumerate(pool(2).run(job_step_reuses_buffers, timeout=120)):
        # 7 units (root kept through backward): 7 forward + 6 backward gathers; the
        # root and the first blocks of each pass find nothing freed yet
        assert got["gathers"] == 13, (r, got)
        assert got["hits"] >= got["gathers"] - 6, (r, got)
        assert got["kept"] == 0, (r, got)
