"""DeepSpeed's ZeRO memory estimators beside the planner's and beside what this project's
ZeroOptimizer holds, on the same GPT and rank counts (bf16 compute, fp32 master, Adam).

    DS_BUILD_OPS=0 pip install deepspeed   # once; the script says so if it is missing
    python benchmarks/plan/plan_deepspeed.py [--no-write]

Per rank count (2, 4) and stage (2, 3): DeepSpeed's estimate_zero{2,3}_model_states_mem_needs
without offload (what estimate_zero3_model_states_mem_needs_all_live prints for the model,
its "per GPU" column), the planner's paper accounting (Rajbhandari et al.: 2P + 14P/N,
16P/N) and its accounting of this project (strategies/plan/memory.py: storage_per_rank),
and the storage ZeroOptimizer holds after one step (benchmarks/data_parallel/_zero_setups.py,
the busiest rank). Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))
sys.path.insert(0, str(ROOT / "benchmarks" / "data_parallel"))
from _doc import emit_section  # noqa: E402
from spawn import RankPool  # noqa: E402

from pycollectives.strategies.plan import ModelSpec  # noqa: E402
from pycollectives.strategies.plan.memory import model_states, storage_per_rank  # noqa: E402

BEGIN, END = "<!-- plan_deepspeed:begin -->", "<!-- plan_deepspeed:end -->"
SPEC = ModelSpec(layers=4, hidden=256, heads=8, vocab=1024, seq=64)


def _cfg():  # noqa: ANN202
    from pycollectives.strategies.models.gpt import GPTConfig

    return GPTConfig(vocab_size=SPEC.vocab, seq_len=SPEC.seq, n_layer=SPEC.layers,
                     n_head=SPEC.heads, d_model=SPEC.hidden)  # fmt: skip


def job(comm) -> dict:  # noqa: ANN001
    """This rank's storage under ZeRO-2 and ZeRO-3 (bf16 on fp32 master), one step each."""
    import torch
    from _zero_setups import build

    out = {}
    for mode in ("zero2", "zero3"):
        setup = build(mode, _cfg(), comm, mixed=True)
        x = torch.randint(SPEC.vocab, (2, SPEC.seq))
        setup.step(x, x)
        out[mode] = sum(setup.storage().values())
        del setup
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        import deepspeed
        from deepspeed.runtime.zero.stage3 import (
            estimate_zero3_model_states_mem_needs,
            estimate_zero3_model_states_mem_needs_all_live,
            model_to_params,
        )
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError as e:
        raise SystemExit(
            f"deepspeed is not installed ({e}): DS_BUILD_OPS=0 pip install deepspeed"
        ) from None
    from pycollectives.strategies.models.gpt import GPT

    load0, t0 = os.getloadavg(), time.perf_counter()
    model = GPT(_cfg())
    total, largest = model_to_params(model)
    assert total == SPEC.params(), (total, SPEC.params())
    table = [
        "| N | stage | DeepSpeed MB | paper MB | planner (this project) MB | measured MB | nearest |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    printed = []
    for n in (2, 4):
        pool = RankPool(n)
        try:
            res = pool.run(job, timeout=300)
        finally:
            pool.close()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=n)
        printed.append(f"N={n}: " + " / ".join(ln.strip() for ln in buf.getvalue().splitlines() if "offload_optimizer=none" in ln))  # fmt: skip
        for stage, mode in ((2, "zero2"), (3, "zero3")):
            if stage == 2:
                _, ds = estimate_zero2_model_states_mem_needs(total, n, 1, cpu_offload=False)
            else:
                _, ds, _ = estimate_zero3_model_states_mem_needs(
                    total, largest, n, 1, cpu_offload=False, cpu_offload_params=False
                )
            paper = model_states(total, n, mode, "bf16-mixed", "paper").total
            ours = sum(storage_per_rank(SPEC, n, mode, "bf16-mixed").values())
            measured = max(r[mode] for r in res)
            cands = {"DeepSpeed": ds, "paper": paper, "planner": ours}
            near = min(cands, key=lambda k: abs(cands[k] - measured))
            table.append(f"| {n} | ZeRO-{stage} | {ds / 1e6:.2f} | {paper / 1e6:.2f} | "
                         f"{ours / 1e6:.2f} | {measured / 1e6:.2f} | {near} |")  # fmt: skip
    load1 = os.getloadavg()
    notes = [
        f"Model {SPEC}: {total:,} parameters, largest layer {largest:,} (DeepSpeed's count); "
        f"deepspeed {deepspeed.__version__}.",
        "DeepSpeed counts 18 bytes per parameter sharded (16-bit and fp32 gradients, fp32 "
        "master, momentum, variance) plus 2P unsharded (ZeRO-2) or 4 bytes x the largest layer "
        "(ZeRO-3); the paper 16; this project's ZeroOptimizer reduces straight into fp32 "
        "shards and at stage 3 keeps no 16-bit shard (14P/N), plus its reduce windows.",
        *[f"estimate_zero3_model_states_mem_needs_all_live, {p}" for p in printed],
        f"Load average at start {', '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load1)}; {time.perf_counter() - t0:.0f} s in all.",
    ]
    argv = " ".join(sys.argv[1:])
    emit_section(BEGIN, END, "Planner: DeepSpeed's ZeRO estimators beside the planner and measured",
                 f"`DS_BUILD_OPS=0 pip install deepspeed; python benchmarks/plan/plan_deepspeed.py"
                 f"{' ' + argv if argv else ''}`", notes, table, not args.no_write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
