"""One layout (dp x tp x pp, sharding, schedule, micro-batches, recomputation) priced:
memory per rank itemized, step time itemized, or the reason it is rejected.

Ranks are numbered tp fastest, then dp, then pp (Megatron's order): a tp group is tp
consecutive ranks, a dp group has stride tp, a pp group stride tp * dp. A group that
spans hosts is priced as the communicator runs it (costs.across_hosts_time): hierarchically
where each host holds as many of its ranks, else one flat ring paced by the inter-host link.
Where a host's ranks outnumber its cores (Cluster.cpu, host.py) the step is also bounded by
the host's CPU work over its cores, and pays a wait per synchronizing collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pycollectives.strategies.pipeline import build, simulate

from .costs import LinkCost, across_hosts_time, ring_time
from .host import host_bound, sync_points
from .inputs import DTYPES, ModelSpec, Request
from .memory import activation_bytes_per_layer, model_states, reduce_window_bytes
from .trainer import stage_params

if TYPE_CHECKING:
    from .fitted import CostModel

__all__ = ["SLOT_BYTES", "Layout", "Priced", "Rejected", "price"]

SLOT_BYTES = 4 * 256 * 1024  # the communicator's shared slots per connection (4 x 256 KiB)
PREFETCH = 2  # ZeroOptimizer's and fully_shard's default: units gathered ahead
INTERLEAVE = 2  # stages per rank of the interleaved schedule


@dataclass(frozen=True)
class Layout:
    """What is chosen for one candidate."""

    dp: int
    tp: int
    pp: int
    sharding: str
    schedule: str
    microbatches: int
    recompute: str

    def name(self) -> str:
        sched = f" {self.schedule}" if self.pp > 1 else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} {self.sharding}{sched} m{self.microbatches} "
            f"rc-{self.recompute}"
        )


@dataclass
class Priced:
    """A layout that fits: bytes per rank by item, seconds per step by item."""

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    step_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    host_cpu_s: float = 0.0  # CPU seconds of the busiest host's ranks a step (host.py); 0: unpriced

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    def order(self) -> tuple[float, float, float]:
        """The planner's order of layouts (smallest first): the step, then the pipeline's
        bubble, then the memory. The bubble breaks ties where ranks outnumber the cores: the
        step is then the host's CPU work over its cores, which prices a rank idle in the
        bubble as free (host.py), and the pp schedules of a layout come out equal; measured,
        the schedule with the least bubble is ahead (train_gpt.py's 4 ranks on 2 cores,
        2026-12-07: pp 4 ZB-H1 357 ms, 1F1B 422, GPipe 440; docs/benchmarks.md)."""
        return self.step_s, self.time.get("pipeline_bubble", 0.0), self.memory_total


@dataclass
class Rejected:
    """A layout that cannot run, and why."""

    layout: Layout
    reason: str
    over_bytes: float = 0.0  # for "does not fit": by how much


def _crosses(size: int, stride: int, per_host: int) -> bool:
    """Whether ranks 0, stride, ..., (size-1)*stride sit on more than one host."""
    return size > 1 and (size - 1) * stride >= per_host


def _collective(req: Request, coll: str, n: int, stride: int, size: float, links: dict) -> float:
    """Seconds of `coll` over a group of n ranks of the given stride."""
    if n <= 1:
        return 0.0
    dph = req.cluster.devices_per_host
    if not _crosses(n, stride, dph):
        return ring_time(coll, n, size, links["intra"])
    per_host = max(1, dph // stride) if stride < dph else 1
    hosts = [per_host] * (n // per_host) + ([n % per_host] if n % per_host else [])
    return across_hosts_time(coll, hosts, size, links["intra"], links["inter"])[0]


def _check(req: Request, lo: Layout) -> str | None:
    m, c = req.model, req.cluster
    v = INTERLEAVE if lo.schedule == "interleaved" and lo.pp > 1 else 1
    if m.heads % lo.tp:
        return f"heads={m.heads} not divisible by tp={lo.tp}"
    if m.ffn_size % lo.tp or m.vocab % lo.tp:
        return f"ffn={m.ffn_size} or vocab={m.vocab} not divisible by tp={lo.tp}"
    if lo.tp > c.devices_per_host or c.devices_per_host % lo.tp:
        return f"tp={lo.tp} crosses hosts ({c.devices_per_host} devices per host)"
    if lo.pp > 1 and lo.sharding in ("zero2", "zero3"):
        return (
            f"{lo.sharding} with pp={lo.pp}: this project's pipeline refuses it (use fsdp or zero1)"
        )
    if lo.pp > 1 and lo.sharding == "fsdp" and lo.schedule == "zb-h1":
        return "fsdp with the zb-h1 schedule: this project's pipeline refuses it"
    if m.layers < lo.pp * v:
        return f"layers={m.layers} fewer than pp={lo.pp} x {v} stage(s) per rank"
    if req.global_batch % (lo.dp * lo.microbatches):
        return (
            f"global_batch={req.global_batch} not divisible by dp={lo.dp} x "
            f"microbatches={lo.microbatches}"
        )
    return None


def _stage_total(st: dict[str, int]) -> int:
    """Parameters a stage holds (stage_params' entry)."""
    return st["blocks"] * st["block"] + st["embed"] + st["head"] + st["tied"]


def _stage_flop_params(m: ModelSpec, st: dict[str, int]) -> int:
    """A whole stage's (tp = 1) parameters as 6PT counts them: the blocks, the
    embeddings on the first stage, the head on the last; a tied output weight counted
    once, on the last stage (its matmul runs there), not on the first (a lookup)."""
    tied = m.vocab * m.hidden if m.tied else 0
    embed = st["embed"] - tied if st["embed"] else 0
    head = st["head"] + tied if st["head"] else 0
    return st["blocks"] * st["block"] + embed + head


def price(req: Request, lo: Layout, links: dict[str, LinkCost | CostModel]) -> Priced | Rejected:
    """Memory and step time of `lo` under `req`, or why it is rejected (see the module
    docstring for the rank order; links: {"intra": LinkCost, "inter": LinkCost})."""
    why = _check(req, lo)
    if why:
        return Rejected(lo, why)
    m, c = req.model, req.cluster
    width, mixed = DTYPES[req.allowed.dtype]
    v = INTERLEAVE if lo.schedule == "interleaved" and lo.pp > 1 else 1
    b = req.global_batch // (lo.dp * lo.microbatches)  # micro-batch size
    # The stages as the pipeline cuts them (pipeline.balance: the first also holds the
    # embeddings, the last the head), and the busiest rank: the most parameters (a tp
    # rank's share, the last stage's tied copy of the embedding included) and blocks.
    sched = build(lo.schedule, lo.pp, lo.microbatches, v) if lo.pp > 1 else None
    held = [sched.stages_of(r) for r in range(lo.pp)] if sched else [(0,)]
    stages = stage_params(m, lo.pp * v, lo.tp)
    p_rank = max(sum(_stage_total(stages[s]) for s in mine) for mine in held)
    layers = max(sum(stages[s]["blocks"] for s in mine) for mine in held)
    in_flight = max(simulate(sched).peak_activations) if sched else v
    # Memory per rank.
    states = model_states(p_rank, lo.dp, lo.sharding, req.allowed.dtype, "pycollectives")
    act_layer = activation_bytes_per_layer(
        m.seq, b, m.hidden, m.heads, lo.tp, recompute=lo.recompute
    )
    act_layer *= width / 2  # Table 2 counts 16-bit activations
    units = [m.block_params() // lo.tp, (m.embed_params() + m.head_params()) // lo.tp]
    memory = {
        **states.as_dict(),
        "activations": act_layer * layers / v * in_flight,
        "logits": 4.0 * m.seq * b * m.vocab / lo.tp,  # fp32 logits for the loss, one micro-batch
        "reduce_windows": float(reduce_window_bytes(units, lo.dp, lo.sharding, req.allowed.dtype)),
        "gathered_units": (
            float((PREFETCH + 1) * max(units) * width)
            if lo.sharding in ("zero3", "fsdp") and lo.dp > 1
            else 0.0
        ),
        "library_pools": float(SLOT_BYTES * (min(c.devices, c.devices_per_host) - 1)),
    }
    if lo.recompute == "full":  # one layer's activations live while it is recomputed
        memory["activations"] += (
            activation_bytes_per_layer(m.seq, b, m.hidden, m.heads, lo.tp) * width / 2
        )
    if sum(memory.values()) > c.memory:
        over = sum(memory.values()) - c.memory
        return Rejected(
            lo,
            f"does not fit: needs {sum(memory.values()) / 1e9:.2f} GB of {c.memory_text} "
            f"({c.memory / 1e9:.2f} GB), over by {over / 1e9:.2f} GB",
            over,
        )
    # Step time: compute per micro-batch per stage, tp collectives in the critical path,
    # each block's call cost (host.HostCPU.block_call_s, 0 unless given) a third forward.
    cpu = c.cpu
    tokens_mb = b * m.seq
    act_bytes = tokens_mb * m.hidden * width
    tp_ar = _collective(req, "all_reduce", lo.tp, 1, act_bytes, links)
    whole = stage_params(m, lo.pp * v, 1)  # FLOPs: 2 per parameter and token, forward
    fwd, bwd = [], []
    for st in whole:
        flops = (2 * _stage_flop_params(m, st) + 4 * st["blocks"] * m.hidden * m.seq) * tokens_mb
        attention = 4 * st["blocks"] * m.hidden * m.seq * tokens_mb
        extra = {"none": 0.0, "selective": attention, "full": flops}[lo.recompute]
        calls = st["blocks"] * cpu.block_call_s
        fwd.append(flops / lo.tp / c.flops + calls / 3 + 2 * st["blocks"] * tp_ar)
        bwd.append((2 * flops + extra) / lo.tp / c.flops + 2 * calls / 3 + 2 * st["blocks"] * tp_ar)
    busiest = max(held, key=lambda mine: sum(fwd[s] + bwd[s] for s in mine))
    t_f, t_b = sum(fwd[s] for s in busiest), sum(bwd[s] for s in busiest)
    layers_busy = sum(whole[s]["blocks"] for s in busiest)
    p2p = 0.0
    if sched:
        link = (
            links["inter"] if _crosses(lo.pp, lo.tp * lo.dp, c.devices_per_host) else links["intra"]
        )
        p2p = link.alpha + act_bytes * link.beta
        if lo.schedule == "zb-h1":  # B split into I and W, half each
            res = simulate(sched, fwd, [x / 2 for x in bwd], [x / 2 for x in bwd], p2p)
        else:
            res = simulate(sched, fwd, bwd, 0.0, p2p)
        pipeline = res.makespan
        bubble = res.bubble_fraction * pipeline
    else:
        pipeline, bubble = lo.microbatches * (t_f + t_b), 0.0
    # Data parallelism: what each sharding sends, and what of it the backward hides.
    sync, after, gathers = _dp_times(req, lo, p_rank, links)
    compute_total = lo.microbatches * (t_f + t_b)
    hidden_sync = min(sync, t_b * (lo.microbatches if lo.sharding in ("zero3", "fsdp") else 1))
    hidden_gathers = min(gathers, compute_total - hidden_sync)
    # The optimizer's step (host.HostCPU.optimizer_param_s, 0 unless given) on the
    # parameters each rank steps: its shard where the sharding splits the optimizer.
    shards = lo.dp if lo.sharding != "none" and lo.dp > 1 else 1
    ranks_p = [sum(_stage_total(stages[s]) for s in mine) for mine in held]
    optimizer = [p / shards * cpu.optimizer_param_s for p in ranks_p]
    time = {
        "compute": lo.microbatches * (t_f + t_b - 4 * layers_busy * tp_ar),
        "tp_collectives": lo.microbatches * 4 * layers_busy * tp_ar,
        "pipeline_bubble": bubble,
        "dp_exposed": (sync - hidden_sync) + (gathers - hidden_gathers) + after,
        "dp_overlapped": hidden_sync + hidden_gathers,
        "optimizer": max(optimizer),
        "shared_cores": 0.0,
        "collective_waits": 0.0,
    }
    step = pipeline + time["dp_exposed"] + time["optimizer"]
    notes = [f"micro-batch {b}", f"in flight {in_flight}"] + (
        [f"p2p {p2p * 1e6:.1f} us"] if p2p else []
    )
    host_cpu = 0.0
    if cpu.shared(c.devices_per_host):
        # Ranks outnumber the cores (host.py): the host's CPU work over its cores bounds
        # the step too, and every synchronizing collective waits for descheduled peers.
        syncs = [
            sync_points(
                dp=lo.dp, tp=lo.tp, pp=lo.pp, sharding=lo.sharding,
                microbatches=lo.microbatches, blocks=sum(whole[s]["blocks"] for s in mine),
                stages=len(mine), first=0 in mine, last=lo.pp * v - 1 in mine,
            )
            for mine in held
        ]  # fmt: skip
        busy = []
        for mine, p, opt, n in zip(held, ranks_p, optimizer, syncs, strict=True):
            dp_cpu = sum(_dp_times(req, lo, p, links))
            messages = 2 * lo.microbatches * len(mine) * p2p if sched else 0.0
            compute = lo.microbatches * sum(fwd[s] + bwd[s] for s in mine)
            busy.append(compute + dp_cpu + opt + messages + n * cpu.sync_cpu_s)
        per_rank = [busy[g // (lo.tp * lo.dp)] for g in range(lo.dp * lo.tp * lo.pp)]
        bound = host_bound(per_rank, c.devices_per_host, cpu.cores)
        n_sync = syncs[held.index(busiest)]
        dph = c.devices_per_host
        host_cpu = max(sum(per_rank[i : i + dph]) for i in range(0, len(per_rank), dph))
        time["shared_cores"] = max(0.0, bound - step)
        time["collective_waits"] = n_sync * cpu.wait_s
        step = max(step, bound) + time["collective_waits"]
        notes.append(
            f"{dph} ranks on {cpu.cores} cores: busiest host {host_cpu * 1e3:.1f} ms of CPU, "
            f"{n_sync} sync points"
        )
    return Priced(lo, memory, time, step, notes, host_cpu)


def _dp_times(
    req: Request, lo: Layout, p: float, links: dict[str, LinkCost | CostModel]
) -> tuple[float, float, float]:
    """Seconds of what the dp sharding sends in a step for a rank holding `p` parameters:
    (the gradient sync the backward may hide, what comes after the step, the parameter
    gathers of ZeRO-3 and FSDP)."""
    width, mixed = DTYPES[req.allowed.dtype]
    g = p * (width if not mixed or lo.sharding != "fsdp" else 4)
    coll = lambda kind, size: _collective(req, kind, lo.dp, lo.tp, size, links)  # noqa: E731
    if lo.sharding == "none":
        return coll("all_reduce", g), 0.0, 0.0
    if lo.sharding in ("zero1", "zero2"):
        kind = "all_reduce" if lo.sharding == "zero1" else "reduce_scatter"
        return coll(kind, g), coll("all_gather", p * width), 0.0
    return (
        coll("reduce_scatter", g) * lo.microbatches,
        0.0,
        2 * lo.microbatches * coll("all_gather", p * width),
    )
