"""What the planner is asked: a model, a global batch, a cluster and what is allowed.

`parse_request(dict)` checks every field strictly and returns a `Request`; an unknown
key, a missing unit, a layout list that cannot be used raises PlanInputError naming
the field and what to change. The dict is what `pycollectives-plan` builds from its
flags (and what a JSON file given to --config holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .host import HostCPU
from .units import PlanInputError, parse_bandwidth, parse_bytes, parse_flops, parse_time

__all__ = [
    "DTYPES",
    "RECOMPUTE",
    "SHARDING",
    "Allowed",
    "Cluster",
    "Link",
    "ModelSpec",
    "Request",
    "parse_request",
]

SHARDING = ("none", "zero1", "zero2", "zero3", "fsdp")
RECOMPUTE = ("none", "selective", "full")
#: dtype policy -> (bytes of a compute parameter / gradient / activation, fp32 master kept)
DTYPES = {"fp32": (4, False), "bf16-mixed": (2, True), "fp16-mixed": (2, True)}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class ModelSpec:
    """The reference GPT's shape (strategies.models.gpt: learned positions, pre-LN blocks
    with biases, GELU MLP of `ffn` features, final LN, head tied to the token embedding)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0  # 0: 4 * hidden
    tied: bool = True

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_params(self) -> int:
        """Parameters of one block: two LNs, qkv and proj, fc and proj (weights and biases)."""
        h, f = self.hidden, self.ffn_size
        return 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    def embed_params(self) -> int:
        """Token and position embeddings."""
        return self.vocab * self.hidden + self.seq * self.hidden

    def head_params(self) -> int:
        """Final LN, and the output weight when it is not tied."""
        return 2 * self.hidden + (0 if self.tied else self.vocab * self.hidden)

    def params(self) -> int:
        """Total parameters P (each shared parameter once)."""
        return self.embed_params() + self.layers * self.block_params() + self.head_params()


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s) and latency (s), with the text they were read from."""

    bandwidth: float
    latency: float
    text: str


@dataclass(frozen=True)
class Cluster:
    """Hosts x devices per host, memory per device (bytes, and as typed), links, throughput
    (per device: the rate of one rank alone on it), and the hosts' CPU cores and per-call
    CPU costs (host.HostCPU: none given by default)."""

    hosts: int
    devices_per_host: int
    memory: int
    memory_text: str
    intra: Link
    inter: Link
    flops: float
    cpu: HostCPU = HostCPU()

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


@dataclass(frozen=True)
class Allowed:
    """The layouts and options to consider."""

    dp: tuple[int, ...]
    tp: tuple[int, ...]
    pp: tuple[int, ...]
    sharding: tuple[str, ...]
    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    recompute: tuple[str, ...]
    dtype: str


@dataclass(frozen=True)
class Request:
    """Everything the planner was asked."""

    model: ModelSpec
    global_batch: int
    cluster: Cluster
    allowed: Allowed

    def echo(self) -> dict[str, Any]:
        """The inputs as understood (units converted, and the text they were read from)."""
        c = self.cluster
        return {
            "model": {**self.model.__dict__, "params": self.model.params()},
            "global_batch": self.global_batch,
            "cluster": {
                "hosts": c.hosts,
                "devices_per_host": c.devices_per_host,
                "memory_per_device": f"{c.memory_text} = {c.memory} bytes",
                "intra_host": c.intra.text,
                "inter_host": c.inter.text,
                "flops_per_device": c.flops,
                "cores_per_host": c.cpu.cores or None,
                "block_call_s": c.cpu.block_call_s,
                "optimizer_per_param_s": c.cpu.optimizer_param_s,
                "collective_cpu_s": c.cpu.sync_cpu_s,
                "collective_wait_s": c.cpu.wait_s,
            },
            "allowed": self.allowed.__dict__,
        }


def _int(d: dict, key: str, lo: int = 1) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise PlanInputError(f"{key}={v!r}: must be an integer >= {lo}")
    return v


def _ints(d: dict, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    v = d.get(key, default)
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v,)
    if (
        not isinstance(v, list | tuple)
        or not v
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)
    ):
        raise PlanInputError(f"{key}={v!r}: must be a non-empty list of integers >= 1")
    return tuple(sorted(set(v)))


def _choices(
    d: dict, key: str, allowed: tuple[str, ...], default: tuple[str, ...]
) -> tuple[str, ...]:
    v = d.get(key, default)
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, list | tuple) or not v:
        raise PlanInputError(f"{key}={v!r}: must be a non-empty list of {', '.join(allowed)}")
    for x in v:
        if x not in allowed:
            raise PlanInputError(f"{key}: {x!r} is not one of {', '.join(allowed)}")
    return tuple(dict.fromkeys(v))


def _link(d: dict, key: str) -> Link:
    v = d.get(key)
    if not isinstance(v, str) or "," not in v:
        raise PlanInputError(
            f"{key}={v!r}: write 'BANDWIDTH,LATENCY' such as '100GB/s,5us' (bytes per second)"
        )
    bw, lat = (s.strip() for s in v.split(",", 1))
    return Link(parse_bandwidth(bw, key), parse_time(lat, key), v)


def _seconds(d: dict, key: str) -> float:
    """An optional time ('120us'), 0 when absent."""
    return parse_time(d[key], key) if key in d else 0.0


_KEYS = {
    "layers", "hidden", "heads", "vocab", "seq", "ffn", "global_batch", "hosts",
    "devices_per_host", "memory_per_device", "intra_host", "inter_host", "flops", "dp", "tp",
    "pp", "sharding", "schedules", "microbatches", "recompute", "dtype", "cores_per_host",
    "block_call", "optimizer_per_param", "collective_cpu", "collective_wait",
}  # fmt: skip


def parse_request(d: dict[str, Any]) -> Request:
    """A Request from `d` (keys: layers, hidden, heads, vocab, seq, [ffn], global_batch,
    hosts, devices_per_host, memory_per_device ('80GB'), intra_host / inter_host
    ('100GB/s,5us'), flops ('312TFLOP/s'), [dp, tp, pp, sharding, schedules, microbatches,
    recompute, dtype, cores_per_host, block_call ('120us'), optimizer_per_param ('5ns'),
    collective_cpu ('50us'), collective_wait ('1ms')]: the last five for CPU ranks,
    strategies/plan/host.py).
    Raises PlanInputError naming the field to change."""
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise PlanInputError(
            f"unknown input(s) {', '.join(unknown)}: known are {', '.join(sorted(_KEYS))}"
        )
    model = ModelSpec(
        layers=_int(d, "layers"),
        hidden=_int(d, "hidden"),
        heads=_int(d, "heads"),
        vocab=_int(d, "vocab"),
        seq=_int(d, "seq"),
        ffn=_int({"ffn": d.get("ffn", 0)}, "ffn", 0),
    )
    if model.hidden % model.heads:
        raise PlanInputError(f"hidden={model.hidden} is not divisible by heads={model.heads}")
    if "memory_per_device" not in d:
        raise PlanInputError("memory_per_device is missing: write it with its unit, e.g. '80GB'")
    mem_text = d["memory_per_device"]
    cluster = Cluster(
        hosts=_int(d, "hosts"),
        devices_per_host=_int(d, "devices_per_host"),
        memory=parse_bytes(mem_text, "memory_per_device"),
        memory_text=mem_text,
        intra=_link(d, "intra_host"),
        inter=_link(d, "inter_host"),
        flops=parse_flops(d.get("flops"), "flops"),
        cpu=HostCPU(
            cores=_int(d, "cores_per_host") if "cores_per_host" in d else 0,
            block_call_s=_seconds(d, "block_call"),
            optimizer_param_s=_seconds(d, "optimizer_per_param"),
            sync_cpu_s=_seconds(d, "collective_cpu"),
            wait_s=_seconds(d, "collective_wait"),
        ),
    )
    n = cluster.devices
    divisors = tuple(k for k in range(1, n + 1) if n % k == 0)
    allowed = Allowed(
        dp=_ints(d, "dp", divisors),
        tp=_ints(d, "tp", divisors),
        pp=_ints(d, "pp", divisors),
        sharding=_choices(d, "sharding", SHARDING, SHARDING),
        schedules=_choices(d, "schedules", SCHEDULES, ("1f1b",)),
        microbatches=_ints(d, "microbatches", (1, 2, 4, 8)),
        recompute=_choices(d, "recompute", RECOMPUTE, ("none", "selective", "full")),
        dtype=_choices(d, "dtype", tuple(DTYPES), ("bf16-mixed",))[0],
    )
    if isinstance(d.get("dtype"), list | tuple) and len(d["dtype"]) > 1:
        raise PlanInputError(f"dtype={d['dtype']!r}: give one dtype policy")
    if not any(dp * tp * pp == n for dp in allowed.dp for tp in allowed.tp for pp in allowed.pp):
        raise PlanInputError(
            f"dp={list(allowed.dp)}, tp={list(allowed.tp)}, pp={list(allowed.pp)}: no product "
            f"dp*tp*pp equals the {n} devices (hosts {cluster.hosts} x devices_per_host "
            f"{cluster.devices_per_host}); allow sizes whose product is {n}"
        )
    return Request(model, _int(d, "global_batch"), cluster, allowed)
