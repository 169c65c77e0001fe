"""The cost of buddy copies when nothing fails: step time and memory of ZeRO with
ElasticZero's redundancy (copy every k steps) against a plain ZeroOptimizer, and
of fully_shard with ElasticFSDP's against plain fully_shard.

    python benchmarks/data_parallel/redundancy_cost.py   # ZeRO-2/3 and fully_shard, 4 ranks, k = 1, 4
    python benchmarks/data_parallel/redundancy_cost.py --stages 3,fsdp --no-write

Per stage ("fsdp": fully_shard on every block and the root, a torch AdamW over
its shards), N fresh ranks each build the same GPT three times (the same initial
values): a plain ZeroOptimizer or fully_shard model ("off") and ElasticZero or
ElasticFSDP with copy_every = each k.
Every round runs one step of each, in an order rotated every round (paired,
alternating), each step started after a barrier; a step's time is the slowest
rank's. Reported: the median step time of each variant over the rounds, and
the median over rounds of each round's ratio to "off" (the paired ratio);
memory: the bytes a rank's ZeroOptimizer (or fully_shard engine and its
optimizer) holds (storage(), each storage once: parameters, shards,
gradients, optimizer state, reduce windows) and the host
bytes its BuddyCopy holds (HSDP: the replica group's ZeroOptimizer, no copy) (its own copy, the copy of its predecessor and the
staging buffer a refresh receives into: 3 x the packed shard state S), and
the time of a refresh with its agreement and commit alone. Writes
its section of docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
import _ranks  # noqa: E402
from _doc import emit_section  # noqa: E402

BEGIN, END = "<!-- redundancy_cost:begin -->", "<!-- redundancy_cost:end -->"


def job(rank: int, world: int, port: int, stage: int | str, args: argparse.Namespace) -> dict:
    """One rank: the variants, `args.rounds` paired rounds; times and bytes."""
    import torch

    import pycollectives as pc
    from pycollectives.strategies.data_parallel import (
        ElasticFSDP,
        ElasticZero,
        HybridZero,
        ZeroOptimizer,
    )
    from pycollectives.strategies.data_parallel.elastic_fsdp import shard_blocks
    from pycollectives.strategies.models.gpt import GPT, GPTConfig

    comm = pc.init(rank=rank, world_size=world, prefix=f"red{port}")
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
    )
    opt = {"lr": 1e-3}
    variants: dict[str, tuple] = {}
    elastic = (ElasticZero, ElasticFSDP)
    torch.manual_seed(0)
    m = GPT(cfg)
    if stage == "fsdp":
        shard_blocks(m, comm)
        variants["off"] = (m, torch.optim.AdamW(m.parameters(), **opt))
    else:
        variants["off"] = (m, ZeroOptimizer(m, torch.optim.AdamW, comm, stage, **opt))
    for k in args.every:
        torch.manual_seed(0)
        m = GPT(cfg)
        variants[f"k={k}"] = (
            m,
            ElasticFSDP(m, torch.optim.AdamW, comm, copy_every=k, **opt)
            if stage == "fsdp"
            else ElasticZero(m, torch.optim.AdamW, comm, stage, copy_every=k, **opt),
        )
    if args.hsdp and world % 2 == 0 and stage != "fsdp":  # replicas instead of copies
        torch.manual_seed(0)
        m = GPT(cfg)
        hz = HybridZero(
            m, torch.optim.AdamW, comm, stage, dp_replicate=2, dp_shard=world // 2, **opt
        )
        variants[f"HSDP 2x{world // 2}"] = (m, hz)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)

    def step(name: str) -> None:
        model, z = variants[name]
        if isinstance(z, elastic):
            if not z.step(lambda mod, r, n: mod(x, y)):
                raise RuntimeError(f"rank {rank}: a step was dropped with no failure")
        else:
            z.zero_grad()
            model(x, y).backward()
            z.step()

    names = list(variants)
    for name in names:  # warm up: the optimizer state exists, the first refresh sized
        step(name)
    times = {n: [] for n in names}
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            comm.barrier()
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    refresh = {}  # the copy's own cost: refresh, agreement, commit (no training step)
    for name, (_, z) in variants.items():
        if isinstance(z, elastic):
            refresh[name] = []
            for _ in range(args.rounds):
                comm.barrier()
                t0 = time.perf_counter()
                z.copy.refresh()
                if not z.comm.agree(True).value:
                    raise RuntimeError(f"rank {rank}: a refresh failed with no failure")
                z.copy.commit(z.steps)
                refresh[name].append(time.perf_counter() - t0)

    def held(model: torch.nn.Module, z: object) -> int:
        """Bytes the variant's model and optimizer hold (each storage once)."""
        if isinstance(z, (ElasticZero, HybridZero)):
            z = z.zero
        if isinstance(z, ZeroOptimizer):
            return sum(z.storage().values())
        optimizer = z.optimizer if isinstance(z, ElasticFSDP) else z
        return sum(model.sharding_unit.engine.storage(optimizer).values())

    storage = {n: held(m, z) for n, (m, z) in variants.items()}
    copies = {n: z.copy.nbytes for n, (_, z) in variants.items() if isinstance(z, elastic)}
    state = {n: z.copy.local.numel() for n, (_, z) in variants.items() if isinstance(z, elastic)}
    p = sum(q.numel() for q in GPT(cfg).parameters())
    comm.close()
    return {
        "times": times,
        "refresh": refresh,
        "storage": storage,
        "copies": copies,
        "state": state,
        "P": p,
    }


def render(stage: int | str, n: int, res: list[dict]) -> list[str]:
    """One table: per variant, the median step, the paired ratio and the bytes."""
    names = list(res[0]["times"])
    rounds = len(res[0]["times"]["off"])
    slowest = {k: [max(r["times"][k][i] for r in res) for i in range(rounds)] for k in names}
    mib = 2**20
    out = [
        f"{'fully_shard' if stage == 'fsdp' else f'ZeRO-{stage}'}, {n} ranks:",
        "",
        "| variant | median step (ms) | paired ratio to off | model + optimizer storage MiB "
        "| shard state S MiB | BuddyCopy host MiB | copies / storage | refresh + agree (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in names:
        ratio = statistics.median(a / b for a, b in zip(slowest[k], slowest["off"], strict=True))
        store = max(r["storage"][k] for r in res)
        copies = max(r["copies"].get(k, 0) for r in res)
        state = max(r["state"].get(k, 0) for r in res)
        ref = "-"
        if k in res[0]["refresh"]:
            worst = [max(r["refresh"][k][i] for r in res) for i in range(rounds)]
            ref = f"{statistics.median(worst) * 1e3:.2f}"
        out.append(
            f"| {k} | {statistics.median(slowest[k]) * 1e3:.1f} | {ratio:.3f} | "
            f"{store / mib:.1f} | {state / mib:.1f} | {copies / mib:.1f} | {copies / store:.2f} "
            f"| {ref} |"
        )
    return [*out, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stages", default="2,3,fsdp", help="ZeRO stages and/or fsdp")
    ap.add_argument("--every", default="1,4", help="copy_every values (k)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-hsdp", dest="hsdp", action="store_false", help="leave out HybridZero")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.every = [int(k) for k in args.every.split(",")]
    load0, t0 = os.getloadavg(), time.perf_counter()
    tables, p = [], 0
    for stage in (s if s == "fsdp" else int(s) for s in args.stages.split(",")):
        res = _ranks.run(job, args.ranks, stage, args)
        p = res[0]["P"]
        table = render(stage, args.ranks, res)
        print("\n".join(table), flush=True)
        tables += table
    load1 = os.getloadavg()
    notes = [
        f"Model: GPT vocab {args.vocab}, seq {args.seq}, {args.layers} blocks, d_model "
        f"{args.d_model}, {args.heads} heads: P = {p:,} parameters; batch {args.batch} x "
        f"{args.seq} tokens per rank, fp32 AdamW; {args.rounds} paired rounds after one warm-up "
        "step of each variant.",
        "k=1 refreshes the copies after every step (one copy of the rank's shard state into "
        "host memory, one send of it to the buddy and one receive from the predecessor), k=4 "
        "after every 4th; both end every step in comm.agree. S: this rank's packed shard state "
        "(master shards and AdamW's two moments: 12 bytes a parameter of its shard; fully_shard: "
        "its AdamW's `step` per parameter besides, each entry 64-byte aligned). HSDP 2xN/2: "
        "HybridZero, ZeRO within 2 groups of N/2 ranks and an all-reduce of the gradient shards "
        "across them: the redundancy is the replica (each rank holds twice the shard of "
        "ZeRO over N), no copies; ElasticHSDP adds one agreement a step to it.",
        "Refresh + agree: one refresh, the agreement and the commit alone (no training step), "
        "the slowest rank, median over as many repetitions as rounds: what a refresh adds to "
        "a step, measured apart from the step-time noise. With the load above the 2 cores, the "
        "paired step ratios carry the scheduler's noise (a few percent either way) and all "
        "times need a quiet rerun.",
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all.",
    ]
    argv = " ".join(sys.argv[1:])
    emit_section(
        BEGIN,
        END,
        "Buddy copies of sharded state (ZeRO, fully_shard): cost when nothing fails",
        f"`python benchmarks/data_parallel/redundancy_cost.py{' ' + argv if argv else ''}`",
        notes,
        tables,
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
