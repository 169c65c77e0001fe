"""The rank side of the ZeRO step-time benchmarks (zero_step.py,
zero_prefetch.py): every training setup as a "cell" that one rank can build,
step and drop, and the loop that times them in interleaved rounds.

Each rank holds three communication stacks side by side: a pycollectives
communicator (strategies.DDP, ZeroOptimizer, fully_shard), the default
torch.distributed group over gloo (torch FSDP2, DeepSpeed) and a second group
over the "pycoll" torch.distributed backend (torch FSDP2), and with a cell
fsdp2-nccl a third over NCCL. With args.device "cuda", rank r works on
cuda:(r % GPUs): model, batch and optimizer state there, the clocks read
after torch.cuda.synchronize(). Cells:

    compute        one process's step on the same per-rank batch, no communication
    dp             strategies.DDP (defaults) + torch AdamW
    zero1..zero3   ZeroOptimizer(AdamW, stage), prefetch 2
    fsdp           fully_shard per block and root (reshard_after_forward) + AdamW
    zero3-pK, fsdp-pK   the same with prefetch K
    fsdp2-gloo, fsdp2-pycoll, fsdp2-nccl   torch.distributed.fsdp.fully_shard per block and root
    ds2, ds3       DeepSpeed ZeRO-2 / ZeRO-3 on the gloo group (where it imports)
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

Step = Callable[[], None]
Cell = tuple[Step, Step, Any, list]  # backward (with zero_grad, forward), update, setup, keep


CELL_FAILED = "cell failed: "  # rank_isolated's mark before the one-line error


def _ours(
    mode: str, cfg: Any, comm: Any, batch: tuple, prefetch: int, dev: torch.device, mixed: bool
) -> Cell:
    from _zero_setups import build, fresh_gpt

    model = fresh_gpt(cfg).to(dev)
    setup = build(mode, cfg, comm, prefetch=prefetch, model=model, mixed=mixed)
    return (lambda: setup.backward(*batch)), setup.update, setup, [setup]


def _compute(cfg: Any, batch: tuple, dev: torch.device, mixed: bool = False) -> Cell:
    """One process, no communication; mixed: the model in bf16 computing, fp32
    master copies that AdamW steps and copies back (as the "dp" setup)."""
    from _zero_setups import fresh_gpt

    model = fresh_gpt(cfg).to(dev)
    if mixed:
        master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        model.to(torch.bfloat16)
        params = list(model.parameters())
        inner = torch.optim.AdamW(master, lr=1e-4)

        def step() -> None:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()
            inner.step()
            with torch.no_grad():
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
                    m.grad = None

        def mixed_backward() -> None:
            for p in params:
                p.grad = None
            model(*batch).backward()

        return mixed_backward, step, None, [model, inner]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def backward() -> None:
        opt.zero_grad()
        model(*batch).backward()

    return backward, opt.step, None, [model, opt]


def _fsdp2(cfg: Any, pg: Any, batch: tuple, dev: torch.device, mixed: bool = False) -> Cell:
    from _zero_setups import fresh_gpt
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(pg, dev.type)
    model = fresh_gpt(cfg).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def backward() -> None:
        opt.zero_grad()
        model(*batch).backward()

    return backward, opt.step, None, [model, opt]


def _deepspeed(stage: int, cfg: Any, batch: tuple, mixed: bool = False) -> Cell:
    import deepspeed
    from _zero_setups import fresh_gpt

    model = fresh_gpt(cfg)
    config = {
        "train_micro_batch_size_per_gpu": batch[0].shape[0],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": mixed},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )

    def backward() -> None:
        engine.backward(engine(*batch))

    return backward, engine.step, None, [engine]


def deepspeed_status() -> str:
    """'' when DeepSpeed imports, else why not (the exception's text)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {e}"
    return ""


def _stats_total(comm: Any) -> tuple[float, int]:
    """Seconds and bytes (sent) of every collective so far on `comm`."""
    st = comm.stats()
    return sum(v["time_s"] for v in st.values()), sum(v["bytes_sent"] for v in st.values())


def rank_main(
    rank: int, world: int, port: int, cells: list[str], cfg: Any, args: Any, rnd: int, init: str
) -> dict[str, Any]:
    """Round `rnd` on this rank (fresh processes per round: torch FSDP2 and
    DeepSpeed do not give all their memory back, nor do the windows before the
    communicator closes): builds the groups, then builds every cell in turn
    (the order reversed in odd rounds; GPT's initial values loaded from the
    file `init`), runs `args.warmup` untimed and
    `args.steps` timed steps, and drops it. Returns per cell the list of
    per-step records: seconds (in all, forward + backward, update), and for pycollectives cells the engine meter
    and the communicator's collective seconds and bytes in that step.
    args.device "cuda" (else the CPU): everything on cuda:(rank % GPUs)."""
    import torch.distributed as dist

    import pycollectives as pc

    if getattr(args, "device", "cpu") == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        sync: Step = torch.cuda.synchronize
    else:
        dev, sync = torch.device("cpu"), (lambda: None)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(300))
    comm = pc.init(rank=rank, world_size=world, store=dist.PrefixStore("ours", store))
    if dev.type == "cuda":
        comm.all_reduce(torch.zeros(1, device=dev))  # sets up the CUDA transport
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world
    )
    pycoll_pg = dist.new_group(backend="pycoll")
    nccl_pg = dist.new_group(backend="nccl") if "fsdp2-nccl" in cells else None
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(dev)
    batch = (x, torch.roll(x, -1, 1))
    records: dict[str, list[dict]] = {c: [] for c in cells}
    from _zero_setups import preload_initial

    preload_initial(cfg, init)
    groups = {"fsdp2-gloo": dist.group.WORLD, "fsdp2-pycoll": pycoll_pg, "fsdp2-nccl": nccl_pg}
    mixed = getattr(args, "bf16", False)  # bf16 compute on fp32 master weights, every cell
    for _ in (rnd,):
        for cell in cells if rnd % 2 == 0 else list(reversed(cells)):
            if cell == "compute":
                backward, update, setup, keep = _compute(cfg, batch, dev, mixed)
            elif cell in groups:
                backward, update, setup, keep = _fsdp2(cfg, groups[cell], batch, dev, mixed)
            elif cell.startswith("ds"):
                backward, update, setup, keep = _deepspeed(int(cell[2]), cfg, batch, mixed)
            else:
                mode, _, pf = cell.partition("-p")
                pf_n = int(pf or 2)
                backward, update, setup, keep = _ours(mode, cfg, comm, batch, pf_n, dev, mixed)
            for i in range(args.warmup + args.steps):
                comm.barrier()
                dist.barrier()
                sync()
                s0 = _stats_total(comm)
                if setup is not None and setup.meter is not None:
                    setup.meter.reset()
                t0 = time.perf_counter()
                backward()
                sync()
                t1 = time.perf_counter()
                update()
                sync()
                t2 = time.perf_counter()
                s1 = _stats_total(comm)
                if i < args.warmup:
                    continue
                rec: dict[str, Any] = {"s": t2 - t0, "fb": t1 - t0, "opt": t2 - t1}
                rec.update(comm_s=s1[0] - s0[0], bytes=s1[1] - s0[1])
                if setup is not None and setup.meter is not None:
                    rec["meter"] = setup.meter.as_dict()
                records[cell].append(rec)
            del backward, update, setup, keep
            gc.collect()
    dist.destroy_process_group()
    comm.close()
    return records


def one_line(e: BaseException) -> str:
    """`Type: first line` of an exception's message, and ` [...] last line`
    where it has more (NCCL's errors say what went wrong on their last line)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    if len(lines) > 1:
        text += f" [...] {lines[-1]}"
    return text


def rank_isolated(
    rank: int, world: int, port: int, cells: list[str], cfg: Any, args: Any, rnd: int, init: str
) -> dict[str, Any]:
    """rank_main for cells run in ranks of their own (zero_step.py --device
    cuda, --isolate): an error is raised again as one line after CELL_FAILED
    (without its chain), which failure_line finds in the traceback the parent
    gets. Raises RuntimeError."""
    try:
        return rank_main(rank, world, port, cells, cfg, args, rnd, init)
    except Exception as e:  # noqa: BLE001 - reported in the table
        raise RuntimeError(f"{CELL_FAILED}rank {rank}: {one_line(e)}") from None


def failure_line(err: str) -> str:
    """What the table says of a cell whose ranks failed, from the text of
    _ranks.run's RuntimeError: rank_isolated's one line where a rank raised,
    else the first line (a timeout, a rank that exited)."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if CELL_FAILED in ln:
            return ln.split(CELL_FAILED, 1)[1]
    return lines[0] if lines else "no error text"


def medians(per_rank: list[dict[str, list[dict]]], rounds: int) -> dict[str, dict[str, Any]]:
    """Per cell: the median over steps of the slowest rank's step time, the
    same per round ("rounds": a list), and the medians (over steps, rank 0)
    of its forward + backward and optimizer update times, the meter's and the
    stats' figures."""
    out: dict[str, dict[str, Any]] = {}
    for cell, recs in per_rank[0].items():
        if not recs:
            continue
        slow = [max(r[cell][i]["s"] for r in per_rank) for i in range(len(recs))]
        per = len(slow) // rounds  # the records are in round order
        row = {
            "step": statistics.median(slow),
            "fb": statistics.median(r["fb"] for r in recs),
            "opt": statistics.median(r["opt"] for r in recs),
            "comm_s": statistics.median(r["comm_s"] for r in recs),
            "bytes": statistics.median(r["bytes"] for r in recs),
            "n": len(slow),
            "rounds": [statistics.median(slow[k * per : (k + 1) * per]) for k in range(rounds)],
        }
        if "meter" in recs[0]:
            for k in recs[0]["meter"]:
                row[k] = statistics.median(r["meter"][k] for r in recs)
            row["max_in_flight"] = max(r["meter"]["max_in_flight"] for r in recs)
        out[cell] = row
    return out
