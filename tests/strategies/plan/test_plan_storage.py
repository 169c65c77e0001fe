"""The planner's model states against what this project's strategies store (2 and 4 ranks).

Each rank trains a small GPT one step with strategies.DDP, ZeroOptimizer stages 1-3 and
fully_shard (the setups of benchmarks/data_parallel/zero_memory.py, which also count the storage), in
fp32 and in bf16 with fp32 master weights; the planner's prediction must be within 5%."""

from __future__ import annotations

import sys

import paths
import pytest

from pycollectives.strategies.plan import ModelSpec
from pycollectives.strategies.plan.memory import storage_per_rank

BENCH = str(paths.BENCH / "data_parallel")
SPEC = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq=16)
MODES = ("dp", "zero1", "zero2", "zero3", "fsdp")


def _measure(comm, mixed: bool) -> dict:
    """On each rank: every mode, one step, the storage by role (the worst rank is compared)."""
    import torch

    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    from _zero_setups import build

    from pycollectives.strategies.models.gpt import GPTConfig

    cfg = GPTConfig(
        vocab_size=SPEC.vocab, seq_len=SPEC.seq, n_layer=SPEC.layers, n_head=SPEC.heads,
        d_model=SPEC.hidden,
    )  # fmt: skip
    out = {}
    for mode in MODES:
        setup = build(mode, cfg, comm, mixed=mixed)
        x = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
        setup.step(x, x)
        out[mode] = setup.storage()
        del setup
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mixed", [False, True])
def test_predicted_storage_within_5_percent(pool, world, mixed):
    results = pool(world).run(_measure, mixed, timeout=240)
    dtype = "bf16-mixed" if mixed else "fp32"
    for mode in MODES:
        measured = max(sum(r[mode].values()) for r in results)
        sharding = "none" if mode == "dp" else mode
        predicted = sum(storage_per_rank(SPEC, world, sharding, dtype).values())
        assert abs(predicted - measured) <= 0.05 * measured, (
            f"{mode} {dtype} N={world}: predicted {predicted:.0f} B, measured {measured} B "
            f"{[r[mode] for r in results]}"
        )
