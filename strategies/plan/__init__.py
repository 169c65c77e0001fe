"""A planner: how to lay out the reference GPT's training on a cluster.

    from pycollectives.strategies.plan import parse_request, plan
    req = parse_request({"layers": 32, "hidden": 4096, "heads": 32, "vocab": 50304,
                         "seq": 2048, "global_batch": 512, "hosts": 8,
                         "devices_per_host": 8, "memory_per_device": "80GB",
                         "intra_host": "300GB/s,3us", "inter_host": "25GB/s,10us",
                         "flops": "312TFLOP/s"})
    fits, rejected = plan(req, links)  # links: {"intra": LinkCost, "inter": LinkCost}

or from a shell, `pycollectives-plan --help` (strategies/plan/cli.py).

Memory per rank is itemized after the ZeRO paper (Rajbhandari et al. 2020) and the
activation memory of Korthikanti et al. 2022; both are checked in tests against the
published figures, and the model states against what this project's strategies store.
Where a host's ranks outnumber its CPU cores (training on CPUs), host.py bounds the step by
the host's CPU work over its cores and prices the collectives' waits for descheduled ranks.
"""

from .cli import plan
from .costs import (
    LinkCost,
    fit,
    hierarchical_time,
    load_bench_json,
    ring_time,
    ring_vs_hierarchical,
)
from .host import HostCPU, host_bound, sync_points
from .inputs import Allowed, Cluster, Link, ModelSpec, Request, parse_request
from .layout import Layout, Priced, Rejected, price
from .memory import activation_bytes_per_layer, model_states, storage_per_rank
from .units import PlanInputError, format_bytes, parse_bandwidth, parse_bytes, parse_time

__all__ = [
    "Allowed",
    "Cluster",
    "HostCPU",
    "Layout",
    "Link",
    "LinkCost",
    "ModelSpec",
    "PlanInputError",
    "Priced",
    "Rejected",
    "Request",
    "activation_bytes_per_layer",
    "fit",
    "format_bytes",
    "hierarchical_time",
    "host_bound",
    "load_bench_json",
    "model_states",
    "parse_bandwidth",
    "parse_bytes",
    "parse_request",
    "parse_time",
    "plan",
    "price",
    "ring_time",
    "ring_vs_hierarchical",
    "storage_per_rank",
    "sync_points",
]
