"""Memory per rank, itemized.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3 and 5): with Adam in
mixed precision a parameter costs 2 bytes (16-bit parameter) + 2 (16-bit gradient) + K = 12
(fp32 master copy 4, momentum 4, variance 4); ZeRO-1 shards the K bytes over the N data-
parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the parameters:

    baseline (2 + 2 + K) P, ZeRO-1 4P + KP/N, ZeRO-2 2P + (2 + K)P/N, ZeRO-3 (4 + K)P/N.

`accounting="pycollectives"` counts what this project's strategies hold instead (see
benchmarks/data_parallel/zero_memory.py): in bf16, ZeroOptimizer's stage 3 keeps no 16-bit parameter
shard (14P/N) and fully_shard keeps fp32 gradient shards (16P/N); ZeRO-2/3 and FSDP add a
pool of reduce-scatter windows (3 of the largest unit, padded to N).

Activations per transformer layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2), in bytes for 16-bit activations with
dropout masks: s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inputs import DTYPES, ModelSpec
from .units import PlanInputError

__all__ = [
    "REDUCE_WINDOWS",
    "ModelStates",
    "activation_bytes_per_layer",
    "model_states",
    "reduce_window_bytes",
    "storage_per_rank",
]

REDUCE_WINDOWS = 3  # ZeroOptimizer's and fully_shard's reduce_buffers default
ADAM_STATE = 8  # momentum and variance, fp32


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of the model states, by role."""

    params: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "master": self.master,
            "optimizer": self.optimizer,
        }


def model_states(
    p: float, n: int, sharding: str, dtype: str, accounting: str = "paper"
) -> ModelStates:
    """Bytes per rank of `p` parameters (this rank's part of the model, before data-
    parallel sharding) with Adam, sharded over `n` data-parallel ranks by `sharding`
    (none, zero1, zero2, zero3, fsdp) in the dtype policy `dtype` (fp32: 4-byte parameters
    and gradients, no master; bf16-/fp16-mixed: 2-byte ones and a 4-byte master copy).
    accounting: "paper" (the ZeRO paper's) or "pycollectives" (what this project stores).
    Raises PlanInputError for an unknown sharding, dtype or accounting, or n < 1."""
    if dtype not in DTYPES:
        raise PlanInputError(f"model_states: dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if accounting not in ("paper", "pycollectives"):
        raise PlanInputError(f"model_states: accounting={accounting!r}: 'paper' or 'pycollectives'")
    if n < 1:
        raise PlanInputError(f"model_states: n={n} must be >= 1")
    width, mixed = DTYPES[dtype]
    stage = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(sharding)
    if stage is None:
        raise PlanInputError(f"model_states: sharding={sharding!r} is unknown")
    params = width * p / (n if stage >= 3 else 1)
    grads = width * p / (n if stage >= 2 else 1)
    master = (4 * p if mixed else 0.0) / (n if stage >= 1 else 1)
    optimizer = ADAM_STATE * p / (n if stage >= 1 else 1)
    if accounting == "pycollectives" and mixed and stage == 3:
        # Gathers cast the fp32 master shard; no 16-bit parameter shard is kept.
        params = 0.0
        if sharding == "fsdp":  # fp32 gradient shards, as torch FSDP2
            grads = 4 * p / n
    return ModelStates(params, grads, master, optimizer)


def reduce_window_bytes(units: list[int], n: int, sharding: str, dtype: str) -> int:
    """The reduce-scatter window pool ZeRO-2/3 and FSDP allocate in this project:
    REDUCE_WINDOWS windows as large as the largest of `units` (parameter counts of the
    sharding units), padded to `n` shards, in the gradient dtype; 0 for none and zero1."""
    if sharding not in ("zero2", "zero3", "fsdp"):
        return 0
    largest = -(-max(units) // n) * n
    return REDUCE_WINDOWS * largest * DTYPES[dtype][0]


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes of activations one transformer layer keeps for backward (Korthikanti et al.
    2022, Table 2):

        no parallelism                      sbh(34 + 5as/h)
        tensor parallel                     sbh(10 + 24/t + 5as/(ht))
        tensor + sequence parallel          sbh(34/t + 5as/(ht))
        tensor parallel + selective         sbh(10 + 24/t)
        tensor + sequence + selective       sbh(34/t)
        full recomputation                  sbh * 2 (the layer's input only)

    (t = 1 gives the first line.) Raises PlanInputError for an unknown `recompute`
    (none, selective, full) or a size below 1."""
    if min(s, b, h, a, t) < 1:
        raise PlanInputError(
            f"activation_bytes_per_layer: sizes {s=}, {b=}, {h=}, {a=}, {t=} must be >= 1"
        )
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise PlanInputError(f"recompute={recompute!r} is not one of none, selective, full")
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return sbh * (34 / t + attention)
    return sbh * (10 + 24 / t + attention)


def storage_per_rank(spec: ModelSpec, n: int, sharding: str, dtype: str) -> dict[str, float]:
    """Bytes of tensor storage one of `n` data-parallel ranks holds between steps for the
    whole `spec` model, as this project's strategies count it (the roles of
    benchmarks/data_parallel/_zero_setups.py: parameters, master copies / shards, gradients, optimizer
    state, reduce-scatter windows). Sharding units are the blocks and the root
    (embeddings, final LN, tied head), as ZeroOptimizer and fully_shard group them."""
    states = model_states(spec.params(), n, sharding, dtype, "pycollectives")
    units = [spec.block_params(), spec.embed_params() + spec.head_params()]
    return {**states.as_dict(), "reduce_buffers": reduce_window_bytes(units, n, sharding, dtype)}
