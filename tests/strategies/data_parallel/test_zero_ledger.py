"""The communication ledger: the bytes each rank moves to or from its peers per
training step, from comm.stats(), asserted against the ZeRO paper's traffic:
2P(N-1)/N for DDP, ZeRO-1, ZeRO-2 (and FSDP keeping parameters after forward),
3P(N-1)/N for FSDP resharding every unit after forward, and (3P - R)(N-1)/N for
ZeRO-3 and FSDP's default (P: parameter bytes; R: the root's, gathered once per
step: its forward encloses the others' and its backward comes first).

comm.stats() counts a collective's bytes_sent / bytes_received by definition,
the same on every path (tests/core/test_traffic.py), so the ledger is asserted on
the paths the collectives take by default: windows, single copy, the ring.

Exactly, with P padded: each unit's flat parameter is padded to N aligned
shards, so a unit moves (N-1)/N of its padded size per all-gather or
reduce-scatter. The fingerprints the engine exchanges before every unit
collective travel as all-reduces and are asserted separately (one 64-byte row
per rank each). An all-reduce's rank owns elements [count*r/N, count*(r+1)/N)
of it, so DDP's bytes are exact over the ranks and within one element per
bucket of 2P(N-1)/N on each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zero_common import CFG, build, fsdp_kw, local_batch

import pycollectives as pc
from pycollectives.strategies.data_parallel.ddp import DistributedDataParallel
from pycollectives.strategies.models.gpt import GPT, GPTConfig

CASES = {  # label: (mode, kwargs, k, r in (kP - rR)(N-1)/N, R the root's bytes)
    "ddp": ("ddp", {}, 2, 0),
    "zero1": ("zero1", {}, 2, 0),
    "zero2": ("zero2", {}, 2, 0),
    "zero3": ("zero3", {}, 3, 1),
    "fsdp": ("fsdp", fsdp_kw(None, 2), 3, 1),
    "fsdp/reshard-root": ("fsdp", fsdp_kw(True, 2), 3, 0),
    "fsdp/keep": ("fsdp", fsdp_kw(False, 2), 2, 0),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _bytes(comm: pc.Communicator) -> dict[str, tuple[int, int, int]]:
    st = comm.stats()
    return {
        k: (st[k]["bytes_sent"], st[k]["bytes_received"], st[k]["calls"]) if k in st else (0, 0, 0)
        for k in KINDS
    }


def job_ledger(comm: pc.Communicator, cfg: GPTConfig) -> dict[str, Any]:
    """Per case: P, padded P, and each collective's (sent, received, calls) in the third step."""
    out: dict[str, Any] = {}
    for label, (mode, kw, _, _) in CASES.items():
        if mode == "ddp":
            model = GPT(cfg)
            wrapped = DistributedDataParallel(model, comm)
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            padded, root = sum(p.numel() * 4 for p in model.parameters()), 0
        else:
            wrapped, opt = build(comm, mode, GPT(cfg), **kw)
            padded = 0
        for _ in range(3):  # the last step is measured: the first ones set up and tune
            before = _bytes(comm)
            opt.zero_grad()
            wrapped(*local_batch(comm, 0)).backward()
            opt.step()
            after = _bytes(comm)
        if mode != "ddp":  # (FSDP builds its engine at the root's first forward)
            engine = opt.engine if hasattr(opt, "engine") else wrapped.sharding_unit.engine
            padded = sum(f.layout.padded_numel * 4 for u in engine.units for f in u.trainable)
            root = sum(f.layout.padded_numel * 4 for f in engine.root.trainable)
        out[label] = {
            "P": sum(p.numel() * 4 for p in GPT(cfg).parameters()),
            "padded": padded,
            "root": root,
            **{k: tuple(b - a for a, b in zip(before[k], after[k], strict=True)) for k in KINDS},
        }
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ledger_matches_zero_traffic(pool, world_size):
    n = world_size
    results = pool(n).run(job_ledger, CFG, timeout=240)
    for r, res in enumerate(results):
        # ZeRO-3 and fully_shard (FSDP2's default resharding) drive one engine over
        # the same units: the same collectives, calls and bytes, per step (nothing extra).
        assert {k: res["zero3"][k] for k in KINDS} == {k: res["fsdp"][k] for k in KINDS}, (r, res)
    for label, (mode, _, k, kr) in CASES.items():
        rows = [res[label] for res in results]
        p, padded, root = rows[0]["P"], rows[0]["padded"], rows[0]["root"]
        if mode == "ddp":
            sent = [row["all_reduce"][0] for row in rows]
            got = [row["all_reduce"][1] for row in rows]
            assert sum(sent) == sum(got) == k * p * (n - 1), (label, rows)
            buckets = rows[0]["all_reduce"][2]
            assert max(abs(s - k * p * (n - 1) / n) for s in sent + got) <= 2 * 4 * buckets, rows
            continue
        assert padded % n == 0 and 0 <= padded - p < 64 * 40 * n, (label, p, padded)
        assert 0 < root < padded, (label, root, padded)
        want = (k * padded - kr * root) * (n - 1) // n
        for r, row in enumerate(rows):
            moved = row["all_gather"][0] + row["reduce_scatter"][0]
            came = row["all_gather"][1] + row["reduce_scatter"][1]
            assert moved == came == want, (
                f"{label} rank {r}: sent {moved}, received {came}, expected {want} "
                f"(({k}P - {kr}R)(N-1)/N with P = {padded}, R = {root} padded bytes)"
            )
            # Fingerprints: one all-reduce of N 64-byte rows per unit collective.
            unit_collectives = row["all_gather"][2] + row["reduce_scatter"][2]
            assert (
                row["all_reduce"][0] == row["all_reduce"][1] == unit_collectives * 2 * 64 * (n - 1)
            ), (label, row)
