"""Tensor storage per rank of a 3D layout as strategies.parallel3d.Trainer3D (what
examples/train_gpt.py runs) holds it, predicted from the model's shape alone.

Where the parameters go (the rules of the code, not its objects):
- pipeline: the blocks cut into pp x v stages by `pipeline.balance` on parameter counts
  (the first stage also pays the embeddings, the last the final LN and its copy of the
  tied weight), v = 2 stages per rank for the interleaved schedule; stage s on rank
  s mod pp; the last stage's tied weight is a storage of its own unless that rank holds
  the first stage too;
- tensor parallelism (Megatron's split, strategies/tensor_parallel/parallelize.py): qkv,
  the attention output's weight, fc and the MLP output's weight split t ways, qkv's and
  fc's biases too; layer norms, row-parallel biases and the position embedding
  replicated; the token embedding (and the head that shares it) split by vocabulary.

Then per dp mode (fp32 parameters, AdamW's two moments): --zero 0 keeps parameters,
gradients, the moments and, with dp > 1, StepGradAverager's buckets (a copy of the
gradients); ZeRO-1 shards the moments; ZeRO-2 the gradients too and adds a pool of
reduce-scatter windows; ZeRO-3 and FSDP shard the parameters as well, FSDP with one pool
per stage a rank holds (each stage is an FSDP root). Shard padding is left out.
"""

from __future__ import annotations

from pycollectives.strategies.pipeline import build
from pycollectives.strategies.pipeline.gpt_stage import balance

from .inputs import ModelSpec
from .memory import ADAM_STATE, REDUCE_WINDOWS
from .units import PlanInputError

__all__ = [
    "MODES",
    "block_params_tp",
    "peer_window_bytes",
    "rank_stages",
    "stage_params",
    "step_transient_bytes",
    "trainer_storage",
]

MODES = ("zero0", "zero1", "zero2", "zero3", "fsdp")


def block_params_tp(spec: ModelSpec, t: int) -> int:
    """Parameters of one block on one of `t` tensor-parallel ranks."""
    h, f = spec.hidden, spec.ffn_size
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h  # qkv, out weight, fc, MLP out weight
    return 4 * h + 2 * h + split // t  # 2 LNs and the two row-parallel biases replicated


def stage_params(spec: ModelSpec, num_stages: int, t: int = 1) -> list[dict[str, int]]:
    """Per pipeline stage: blocks (its count), block (parameters of one on a tp rank),
    embed (token + position embedding, first stage), head (final LN, last stage) and
    tied (the last stage's copy of the token embedding, tied model with > 1 stage)."""
    if num_stages < 1 or spec.layers < num_stages:
        raise PlanInputError(f"stage_params: {spec.layers} layers cannot fill {num_stages} stages")
    embed_full = spec.embed_params()
    sizes = balance(
        [spec.block_params()] * spec.layers,
        num_stages,
        first=embed_full,
        last=spec.head_params() + (spec.vocab * spec.hidden if spec.tied else 0),
    )
    tok_tp = spec.vocab * spec.hidden // t
    out = []
    for s, n in enumerate(sizes):
        last = s == num_stages - 1
        out.append({
            "blocks": n,
            "block": block_params_tp(spec, t),
            "embed": tok_tp + spec.seq * spec.hidden if s == 0 else 0,
            "head": 2 * spec.hidden + (0 if spec.tied else tok_tp) if last else 0,
            "tied": tok_tp if last and spec.tied and num_stages > 1 else 0,
        })  # fmt: skip
    return out


def rank_stages(schedule: str, pp: int, microbatches: int = 4) -> list[tuple[int, ...]]:
    """The stages each pipeline rank holds under `schedule` (a pipeline.build name)."""
    v = 2 if schedule == "interleaved" and pp > 1 else 1
    sched = build(schedule, pp, microbatches, v)
    return [sched.stages_of(r) for r in range(pp)]


def trainer_storage(
    spec: ModelSpec,
    dp: int,
    tp: int,
    pp: int,
    mode: str,
    schedule: str = "1f1b",
    width: int = 4,
) -> list[dict[str, float]]:
    """Predicted bytes of tensor storage by role (params, param_shards, grads, optimizer,
    reduce_buffers) on each pipeline rank (index = pp rank; every dp and tp rank of it the
    same) of Trainer3D with `mode` (MODES) on the dp axis and `schedule` (a pipeline.build
    name) with pp > 1; `width` bytes per parameter (4: float32). Raises PlanInputError
    for a mode or layout Trainer3D refuses."""
    _check_layout("trainer_storage", spec, dp, tp, pp, mode)
    out = []
    for p, windows in _rank_params(spec, dp, tp, pp, mode, schedule):
        windows *= width
        shard = p / dp
        sharded = dp > 1 and mode != "zero0"
        out.append({
            "params": width * (shard if mode in ("zero3", "fsdp") and dp > 1 else p),
            "param_shards": 0.0,  # fp32: the optimizer steps the shards themselves
            "grads": width * (shard if dp > 1 and mode in ("zero2", "zero3", "fsdp") else p),
            "optimizer": ADAM_STATE / 4 * width * (shard if sharded else p),
            "reduce_buffers": float(windows + (width * p if mode == "zero0" and dp > 1 else 0)),
        })  # fmt: skip
    return out


def peer_window_bytes(
    spec: ModelSpec,
    dp: int,
    tp: int,
    pp: int,
    mode: str,
    schedule: str = "1f1b",
    width: int = 4,
) -> list[float]:
    """Bytes of the dp peers' symmetric windows (`comm.alloc_shared`) that each pipeline
    rank's in-place collectives touch in a step: pages that count in the rank's resident
    set (RSS) although they are the peers' memory, held once on the machine (its PSS
    counts them shared). A reduce-scatter reads this rank's block of every peer's window,
    an all-gather every peer's own block, an all-reduce both: (dp-1)/dp of a window, or
    2(dp-1)/dp. --zero 0 all-reduces its gradient buckets; ZeRO-1 reduce-scatters its
    full gradient window and all-gathers its parameter window; ZeRO-2 all-gathers the
    parameter window and reduce-scatters through its window pool; ZeRO-3 and FSDP only
    the pool. Raises PlanInputError as trainer_storage does."""
    _check_layout("peer_window_bytes", spec, dp, tp, pp, mode)
    peers = (dp - 1) / dp
    touched = {"zero0": lambda p, w: 2 * p, "zero1": lambda p, w: 2 * p,
               "zero2": lambda p, w: p + w}  # fmt: skip
    return [
        width * peers * touched.get(mode, lambda p, w: w)(p, windows)
        for p, windows in _rank_params(spec, dp, tp, pp, mode, schedule)
    ]


def step_transient_bytes(
    spec: ModelSpec,
    dp: int,
    tp: int,
    pp: int,
    mode: str,
    schedule: str = "1f1b",
    microbatches: int = 4,
    prefetch: int = 2,
    width: int = 4,
) -> list[dict[str, float]]:
    """Predicted bytes of tensors each pipeline rank holds during a step beyond its
    storage between steps (trainer_storage), by origin, at the step's peak (the last
    micro-batch's backward begins), for Trainer3D with `microbatches` per step:

    - unreduced_grads: gradients not yet reduced. ZeRO-1 keeps autograd's .grad of
      every parameter (p) through the pipeline step; they go into its gradient
      window after it. ZeRO-2/3 and FSDP accumulate the micro-batches but the last
      unsynced (no_sync, as FSDP2's): the engine's unsharded buffer of every unit (p);
      FSDP with pp > 1 every micro-batch. With those, the .grad of the unit whose
      backward runs (a block) and the root's (complete only when the embeddings'
      gradients arrive, last) before the engine copies them out. --zero 0 counts its .grad
      between steps already.
    - gathered_params: ZeRO-3 and FSDP (pp = 1): the root, gathered from its forward
      to the end of backward, and the unit computing with the `prefetch` ones
      gathered ahead (a unit freed hands its buffer to the next gather); FSDP with
      pp > 1 keeps every unit of its stages gathered through the step (p).
    - grad_shards (negative): ZeRO-2/3 and FSDP drop their reduced gradient shards
      (p / dp) at the step's start (zero_grad) and rebuild them as that backward
      reduces: trainer_storage counts them, the peak has none.

    `width` bytes per element (4: float32); shard padding left out. Raises
    PlanInputError as trainer_storage does, or for microbatches or prefetch < 1 / 0."""
    _check_layout("step_transient_bytes", spec, dp, tp, pp, mode)
    if microbatches < 1 or prefetch < 0:
        raise PlanInputError(
            f"step_transient_bytes: microbatches={microbatches} must be >= 1 and "
            f"prefetch={prefetch} >= 0"
        )
    held = rank_stages(schedule if pp > 1 else "1f1b", pp)
    stages = stage_params(spec, sum(len(h) for h in held), tp)
    out = []
    for (p, _), mine in zip(_rank_params(spec, dp, tp, pp, mode, schedule), held, strict=True):
        ss = [stages[s] for s in mine]
        block = max(s["block"] for s in ss)
        root = sum(s["embed"] + s["head"] + s["tied"] for s in ss)
        blocks = sum(s["blocks"] for s in ss)
        grads = gathered = shards = 0.0
        if dp > 1 and mode == "zero1":
            grads = p
        elif dp > 1 and mode in ("zero2", "zero3", "fsdp"):
            unsynced = pp > 1 or microbatches > 1  # FSDP with pp > 1: every backward
            grads = (p if unsynced else 0) + block + root
            shards = p / dp
            if mode == "fsdp" and pp > 1:
                gathered = p
            elif mode in ("zero3", "fsdp"):
                gathered = root + min(blocks, 1 + prefetch) * block
        out.append({"unreduced_grads": width * grads, "gathered_params": width * gathered,
                    "grad_shards": -width * shards})  # fmt: skip
    return out


def _check_layout(what: str, spec: ModelSpec, dp: int, tp: int, pp: int, mode: str) -> None:
    """Raises PlanInputError for a mode or layout Trainer3D refuses."""
    if mode not in MODES:
        raise PlanInputError(f"{what}: mode={mode!r} is not one of {', '.join(MODES)}")
    if mode in ("zero2", "zero3") and pp > 1:
        raise PlanInputError(f"{what}: {mode} needs pp=1 (got pp={pp})")
    if min(dp, tp, pp) < 1 or spec.heads % tp:
        raise PlanInputError(f"{what}: dp={dp} tp={tp} pp={pp}, heads={spec.heads}")


def _rank_params(
    spec: ModelSpec, dp: int, tp: int, pp: int, mode: str, schedule: str
) -> list[tuple[int, int]]:
    """Per pipeline rank: (the parameters of its stages on one tp rank, the elements of
    its pool of reduce-scatter windows: 0 unless ZeRO-2/3 or FSDP with dp > 1)."""
    held = rank_stages(schedule if pp > 1 else "1f1b", pp)
    stages = stage_params(spec, sum(len(h) for h in held), tp)
    out = []
    for mine in held:
        ss = [stages[s] for s in mine]
        both_ends = 0 in mine and len(stages) - 1 in mine
        p = sum(s["blocks"] * s["block"] + s["embed"] + s["head"] for s in ss)
        p += 0 if both_ends else sum(s["tied"] for s in ss)
        if mode == "fsdp":  # one window pool per FSDP root (stage)
            windows = sum(max(s["block"], s["embed"] + s["head"] + s["tied"]) for s in ss)
        else:  # ZeroOptimizer's units: the blocks, and the rest as the root
            ends = sum(s["embed"] + s["head"] + s["tied"] for s in ss)
            windows = max(max(s["block"] for s in ss), ends)
        pooled = dp > 1 and mode in ("zero2", "zero3", "fsdp")
        out.append((p, windows * REDUCE_WINDOWS if pooled else 0))
    return out
