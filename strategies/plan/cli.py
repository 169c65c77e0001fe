"""pycollectives-plan: the best layouts of the reference GPT on a cluster.

    pycollectives-plan --layers 32 --hidden 4096 --heads 32 --vocab 50304 --seq 2048 \\
        --global-batch 512 --hosts 8 --devices-per-host 8 --memory-per-device 80GB \\
        --intra-host 300GB/s,3us --inter-host 25GB/s,10us --flops 312TFLOP/s

prints the inputs as understood, the best layouts by predicted step time (memory and time
itemized) and the rejected ones with their reason; --json FILE writes all of it.
--bench-json FILE fits the intra-host link to a `pycollectives-bench --json` run
(strategies/plan/shm_model.py), --inter-bench-json FILE the inter-host link to one run
across hosts (TCP: strategies/plan/tcp_model.py, per algorithm; --inter-model paths: the
per-path alpha/beta of strategies/plan/fitted.py). --cores-per-host N, where the ranks of
a host outnumber its cores (CPU training), bounds the step by the host's CPU work over its
cores and prices --collective-cpu and --collective-wait per synchronizing collective;
--block-call and
--optimizer-per-param add CPU costs per block call and per parameter stepped
(strategies/plan/host.py; examples/train_gpt.py --plan measures all of them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

from .costs import LinkCost, load_bench_json, ring_vs_hierarchical
from .fitted import CostModel, fit_model
from .inputs import Request, parse_request
from .layout import Layout, Priced, Rejected, price
from .shm_fit import fit_shm
from .shm_model import ShmModel, agreement_text
from .tcp_model import TcpModel, fit_tcp
from .units import PlanInputError

__all__ = ["main", "plan"]


def _links(
    req: Request, bench: str | None, inter_bench: str | None = None, inter_model: str = "algorithms"
) -> dict[str, LinkCost | CostModel | ShmModel | TcpModel]:
    """The given links, the intra-host one fitted to `bench` and the inter-host one to
    `inter_bench` (pycollectives-bench --json runs) where given: by tcp_model (inter_model
    "algorithms", with the intra-host fit's copy and reduction rates where there is one)
    or fitted.fit_model ("paths"). Raises PlanInputError for another inter_model."""
    if inter_model not in ("algorithms", "paths"):
        raise PlanInputError(f"--inter-model {inter_model!r} is not 'algorithms' or 'paths'")
    c = req.cluster
    links = {
        "intra": LinkCost(c.intra.latency, 1 / c.intra.bandwidth, f"given {c.intra.text}"),
        "inter": LinkCost(c.inter.latency, 1 / c.inter.bandwidth, f"given {c.inter.text}"),
    }
    if bench:
        links["intra"] = fit_shm(load_bench_json(bench), None, source=bench)
    if inter_bench:
        rows = load_bench_json(inter_bench)
        if inter_model == "paths":
            links["inter"] = fit_model(rows, "tcp", source=inter_bench)
        else:
            shm = links["intra"] if isinstance(links["intra"], ShmModel) else None
            links["inter"] = fit_tcp(rows, shm, None, source=inter_bench)
    return links


def plan(
    req: Request, links: dict[str, LinkCost | CostModel | ShmModel | TcpModel]
) -> tuple[list[Priced], list[Rejected]]:
    """Every allowed layout of req priced: (those that fit, fastest first; the rejected)."""
    a, n = req.allowed, req.cluster.devices
    fits: list[Priced] = []
    rejected: list[Rejected] = []
    for dp, tp, pp in itertools.product(a.dp, a.tp, a.pp):
        if dp * tp * pp != n:
            continue
        for sharding, sched, m, rc in itertools.product(
            a.sharding, a.schedules if pp > 1 else ("none",), a.microbatches, a.recompute
        ):
            if sharding != "none" and dp == 1 and sharding != "zero1":
                continue  # nothing to shard over: the same as zero1 / none
            r = price(req, Layout(dp, tp, pp, sharding, sched, m, rc), links)
            (fits if isinstance(r, Priced) else rejected).append(r)
    fits.sort(key=Priced.order)
    return fits, rejected


def _row(p: Priced) -> str:
    gb = lambda x: f"{x / 1e9:8.2f}"  # noqa: E731
    ms = lambda x: f"{x * 1e3:9.2f}"  # noqa: E731
    mem, t = p.memory, p.time
    states = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer"]
    buffers = mem["reduce_windows"] + mem["gathered_units"] + mem["library_pools"]
    return (
        f"{p.layout.name():42} {gb(p.memory_total)} {gb(states)} {gb(mem['activations'] + mem['logits'])} "
        f"{gb(buffers)} {ms(p.step_s)} {ms(t['compute'])} {ms(t['tp_collectives'])} "
        f"{ms(t['pipeline_bubble'])} {ms(t['dp_exposed'])} {ms(t['dp_overlapped'])} "
        f"{ms(t['optimizer'])} {ms(t['shared_cores'])} {ms(t['collective_waits'])}"
    )


def report(
    req: Request,
    links: dict[str, LinkCost | CostModel | ShmModel | TcpModel],
    fits: list[Priced],
    rejected: list[Rejected],
    top: int,
) -> str:
    """The text report: inputs as understood, the best `top` layouts, the rejected ones."""
    lines = ["# inputs as understood"] + [f"#   {k}: {v}" for k, v in req.echo().items()]
    for k, v in links.items():
        lines.append(
            f"#   link {k}: alpha {v.alpha * 1e6:.2f} us, {v.bandwidth / 1e9:.2f} GB/s ({v.source})"
        )
        if agreed := agreement_text(getattr(v, "agreement", None)):
            lines.append(f"#     priced against the rows it was fitted to: {agreed}")
    size = req.model.params() * 2.0  # a 16-bit gradient all-reduce of the whole model
    per_host = req.cluster.devices_per_host
    alg = ring_vs_hierarchical("all_reduce", size, per_host, links["intra"], links["inter"],
                               tuple(per_host * k for k in (1, 2, 8, 64, 512)))  # fmt: skip
    lines.append(
        f"#   all-reduce of {size / 1e9:.2f} GB, ring vs hierarchical: "
        + ", ".join(
            f"{a['ranks']} ranks {a['ring_s'] * 1e3:.1f} / {a['hierarchical_s'] * 1e3:.1f} ms"
            for a in alg
        )
        + " (across hosts the communicator runs hierarchical; PYCOLL_ALGO=ring, the ring)"
    )
    lines.append(
        f"{'layout':42} {'mem GB':>8} {'states':>8} {'activ':>8} {'buffers':>8} {'step ms':>9} "
        f"{'compute':>9} {'tp comm':>9} {'bubble':>9} {'dp expo':>9} {'dp ovlp':>9} "
        f"{'optim':>9} {'cores':>9} {'waits':>9}"
    )
    lines += [_row(p) for p in fits[:top]]
    if not fits:
        lines.append(
            "# nothing fits: see the reasons below (more devices, memory, tp/pp, ZeRO-3, recompute)"
        )
    lines.append(f"# rejected: {len(rejected)} (all of them in --json), by reason:")
    groups: dict[str, list[Rejected]] = {}
    for r in rejected:
        key = "does not fit" if r.over_bytes else r.reason
        groups.setdefault(f"dp{r.layout.dp} tp{r.layout.tp} pp{r.layout.pp}: {key}", []).append(r)
    for key, rs in list(groups.items())[: top * 3]:
        best = min(rs, key=lambda r: r.over_bytes)  # the closest to fitting
        lines.append(f"{key} ({len(rs)} layouts; closest {best.layout.name()}: {best.reason})")
    if len(groups) > top * 3:
        lines.append(f"# ... {len(groups) - top * 3} more groups in --json")
    return "\n".join(lines)


def _link_json(link: LinkCost | CostModel | ShmModel | TcpModel) -> dict[str, Any]:
    if isinstance(link, ShmModel | TcpModel):
        return {"transport": link.transport, "cache_bytes": getattr(link, "cache_bytes", None), "alpha": link.alpha,
                "beta": link.beta, "source": link.source, "fitted": link.describe(),
                "agreement": link.agreement}  # fmt: skip
    if isinstance(link, CostModel):
        return {"transport": link.transport, "cache_bytes": link.cache_bytes,
                **link.overall.__dict__, "fitted": link.describe()}  # fmt: skip
    return dict(link.__dict__)


def as_json(
    req: Request,
    links: dict[str, LinkCost | CostModel | ShmModel | TcpModel],
    fits: list[Priced],
    rejected: list[Rejected],
) -> dict[str, Any]:
    """Everything, JSON-ready (bytes and seconds)."""
    return {
        "inputs": req.echo(),
        "links": {k: _link_json(v) for k, v in links.items()},
        "layouts": [
            {
                "layout": p.layout.__dict__,
                "name": p.layout.name(),
                "memory_bytes": p.memory,
                "memory_total_bytes": p.memory_total,
                "time_s": p.time,
                "step_s": p.step_s,
                "host_cpu_s": p.host_cpu_s,
                "notes": p.notes,
            }
            for p in fits
        ],  # fmt: skip
        "rejected": [
            {
                "layout": r.layout.__dict__,
                "name": r.layout.name(),
                "reason": r.reason,
                "over_bytes": r.over_bytes,
            }
            for r in rejected
        ],
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pycollectives-plan", description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    strs = lambda s: s.split(",")  # noqa: E731
    for name in (
        "layers",
        "hidden",
        "heads",
        "vocab",
        "seq",
        "ffn",
        "global-batch",
        "hosts",
        "devices-per-host",
        "cores-per-host",
    ):
        ap.add_argument(f"--{name}", type=int)
    for name in ("memory-per-device", "intra-host", "inter-host", "flops", "dtype",
                 "block-call", "optimizer-per-param", "collective-cpu", "collective-wait"):  # fmt: skip
        ap.add_argument(f"--{name}")
    for name in ("dp", "tp", "pp", "microbatches"):
        ap.add_argument(f"--{name}", type=ints)
    for name in ("sharding", "schedules", "recompute"):
        ap.add_argument(f"--{name}", type=strs)
    ap.add_argument("--config", help="a JSON file of the same inputs (flags override it)")
    ap.add_argument(
        "--bench-json", help="fit the intra-host link to this pycollectives-bench --json file"
    )
    ap.add_argument(
        "--inter-bench-json",
        help="fit the inter-host link to this pycollectives-bench --json file, run across "
        "hosts (one rank per host: benchmarks/plan/plan_costs_hosts.py writes one)",
    )
    ap.add_argument(
        "--inter-model",
        choices=("algorithms", "paths"),
        default="algorithms",
        help="the inter-host fit: algorithms (tcp_model.py, default) or paths (fitted.py)",
    )
    ap.add_argument("--top", type=int, default=10, help="how many layouts to print (default 10)")
    ap.add_argument(
        "--json", metavar="FILE", help="write the inputs, every layout and the rejected ones"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns 0, 1 when nothing fits, 2 on bad input (the message says what to change)."""
    args = _parser().parse_args(argv)
    d: dict[str, Any] = {}
    try:
        if args.config:
            try:
                with open(args.config) as f:
                    d = json.load(f)
            except (OSError, ValueError) as e:
                raise PlanInputError(f"--config {args.config}: {e}") from None
            if not isinstance(d, dict):
                raise PlanInputError(f"--config {args.config}: not a JSON object")
        skip = {"config", "bench_json", "inter_bench_json", "inter_model", "top", "json"}
        d.update({k: v for k, v in vars(args).items() if v is not None and k not in skip})
        req = parse_request(d)
        links = _links(req, args.bench_json, args.inter_bench_json, args.inter_model)
        fits, rejected = plan(req, links)
    except PlanInputError as e:
        print(f"pycollectives-plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(req, links, fits, rejected), f, indent=1)
            f.write("\n")
    try:
        print(report(req, links, fits, rejected, args.top))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`| head`): exit quietly, as cat does, instead of a traceback
        # here and another at interpreter exit when Python flushes stdout again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
