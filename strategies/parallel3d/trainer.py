"""3D parallel training of the reference GPT: data x tensor x pipeline
parallelism composed on one ParallelDims.

For the rank at (dp_rank, tp_rank, pp_rank), `Trainer3D`:

- builds the pipeline stages this pp rank holds (gpt_stages: global
  parameter names, each initialized from (seed, name, full shape)) and makes
  them tensor-parallel over dims.tp_comm (parallelize_gpt: this rank's shard
  of the same full weights), so the full initial weights do not depend on
  the layout;
- takes its data-parallel share of each global batch (strategies.data:
  the global order of samples depends only on the seed) and cuts it into
  the schedule's micro-batches; every rank of a pipeline (and of a tp group)
  builds the same micro-batches;
- runs the pipeline schedule on dims.pp_comm (PipelineRuntime: the tied
  embedding/head gradient summed between the first and last stage);
- keeps the dp replicas in step with one of the modes of dp_modes.py (one
  interface: wrap the stages, accumulate, finish the step); it averages
  the gradients over dims.dp_comm: bucketed all-reduces launched
  while the step still runs (StepGradAverager), or with zero=1 a ZeRO-1
  optimizer on the dp axis (reduce-scatter after the step, each dp rank
  steps its shard of the optimizer state, all-gather);
- steps AdamW.

With pp = 1, `zero` 2/3 and `fsdp` shard over the dp axis instead: no
pipeline runtime, the one stage accumulates the micro-batches itself
(no_sync but for the last backward), its blocks the ZeRO/FSDP units. With
pp > 1, `fsdp` shards each stage over dp (fsdp_pipeline.py: every backward
unsynced, the tied gradient summed across stages, then one reduce-scatter
per unit after the step).

`device` ("cpu", or "cuda": each rank on cuda:(LOCAL_RANK % device count)):
the stages' parameters, the micro-batches and the activations live there,
so the tensor-parallel collectives, the dp gradient average and ZeRO/FSDP
take CUDA tensors through pycollectives' CUDA path; the pipeline's messages
and the tied gradient sum go through the host (batch_p2p takes CPU buffers).

With --sequence-parallel (tp > 1) the layer norms, dropouts and residual
stream run on [b, t/tp, d] sequence shards, and so do the activations the
stages exchange (GPTStage.sequence_shards = tp): each pipeline message is
1/tp of the bytes, for every schedule, ZB-H1 included.

What does not compose, refused on every rank with the flags named
(docs/parallel3d.md): ZeRO-2/3 with pp > 1 (their reduce-scatter in
backward assumes one backward per step; a pipeline step runs m interleaved
forwards and backwards per stage, sums the tied weight's gradient after the
last, and ZB-H1 computes weight gradients outside autograd; DeepSpeed
refuses them too), FSDP with ZB-H1.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from pycollectives import PyCollectivesError, ReduceOp
from pycollectives._buffers import cuda_built

from ..data import GlobalBatches, SyntheticSequences
from ..data_parallel.sharding.engine import count_storage
from ..models.gpt import Block, Embedding, GPTConfig, LMHead
from ..parallel_dims import ParallelDims
from ..pipeline import PipelineError, PipelineRuntime, build, deferred_parameters, gpt_stages
from ..pipeline.communications import agree, digest
from ..pipeline.gpt_stage import TIED
from ..tensor_parallel import parallelize_gpt
from .dp_modes import DataParallelMode, build_mode

__all__ = [
    "DEVICES",
    "SCHEDULES",
    "StepStats",
    "TrainOptions",
    "Trainer3D",
    "full_shapes",
    "problems",
    "resolve_device",
]

# command-line names -> strategies.pipeline.build names
SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbh1": "zb-h1"}
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainOptions:
    """How to train: the schedule and its micro-batches, the dp-axis
    optimizer (zero: 0 = all-reduce, 1-3 = ZeRO stage; fsdp; zero 2/3 need
    pp = 1, fsdp with pp > 1 a schedule other than zbh1), the device (a key of
    DEVICES, see resolve_device), the data and AdamW."""

    schedule: str = "1f1b"  # a key of SCHEDULES
    microbatches: int = 4  # per step and data-parallel rank
    virtual_stages: int = 2  # interleaved only: stages per rank
    zero: int = 0
    fsdp: bool = False
    sequence_parallel: bool = False
    global_batch: int = 8  # samples per step, over all dp ranks
    num_samples: int = 4096
    data_seed: int = 0
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    dtype: torch.dtype = torch.float32
    overlap: bool = True  # dp all-reduces during the step
    timeout: float | None = None  # seconds, for the pipeline's messages
    device: str = "cpu"  # "cpu" or "cuda" (cuda:(LOCAL_RANK % device count))


@dataclass
class StepStats:
    """One step: the global mean loss (the same on every rank), the tokens
    of the global batch and this rank's wall time for the step."""

    step: int
    loss: float
    tokens: int
    seconds: float


def problems(dims: ParallelDims, config: GPTConfig, opts: TrainOptions) -> list[str]:
    """What is wrong with training `config` with `opts` on `dims` (the same
    list on every rank: a function of the arguments only)."""
    out = []
    if opts.schedule not in SCHEDULES:
        out.append(f"--schedule {opts.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if opts.zero not in (0, 1, 2, 3):
        out.append(f"--zero {opts.zero} must be 0, 1, 2 or 3")
    elif opts.zero in (2, 3) and dims.pp > 1:
        out.append(
            f"--zero {opts.zero} with --pp {dims.pp} does not compose with the pipeline runtime "
            "(its reduce-scatter during backward assumes one backward per step; a pipeline step "
            "runs one per micro-batch, sums the tied embedding/head gradient after the last, and "
            "ZB-H1 computes weight gradients outside autograd; DeepSpeed's PipelineEngine refuses "
            "ZeRO-2/3 with pipeline parallelism too): use --zero 1, or --pp 1"
        )
    if opts.fsdp and dims.pp > 1 and opts.schedule == "zbh1":
        out.append(
            f"--fsdp with --pp {dims.pp} and --schedule zbh1 does not compose (ZB-H1's W computes "
            "weight gradients outside autograd, where FSDP's gradient hooks do not see them): use "
            "--schedule 1f1b, gpipe or interleaved, or --zero 1"
        )
    if opts.device not in DEVICES:
        out.append(f"--device {opts.device!r} is not one of {', '.join(DEVICES)}")
    if opts.fsdp and opts.zero:
        out.append(f"--fsdp and --zero {opts.zero}: choose one")
    if opts.microbatches < 1 or opts.global_batch < 1:
        out.append(f"--microbatches {opts.microbatches}, --batch {opts.global_batch} must be >= 1")
    elif opts.global_batch % (dims.dp * opts.microbatches):
        out.append(
            f"--batch {opts.global_batch} is not divisible by --dp {dims.dp} x --microbatches "
            f"{opts.microbatches}: every micro-batch must hold the same number of samples"
        )
    for what, size in (("n_head", config.n_head), ("vocab_size", config.vocab_size),
                       ("MLP hidden size", config.hidden)):  # fmt: skip
        if size % dims.tp:
            out.append(f"{what}={size} is not divisible by --tp {dims.tp}")
    if opts.sequence_parallel and config.seq_len % dims.tp:
        out.append(f"seq_len={config.seq_len} is not divisible by --tp {dims.tp}")
    v = opts.virtual_stages if opts.schedule == "interleaved" else 1
    if v < 1:
        out.append(f"virtual_stages={v} must be >= 1")
    elif config.n_layer < dims.pp * v:
        out.append(
            f"fewer layers than stages: n_layer={config.n_layer} blocks cannot fill "
            f"--pp {dims.pp} x {v} stages per rank = {dims.pp * v} stages"
        )
    return out


def resolve_device(name: str, rank: int) -> torch.device:
    """The device of option `name` for this process: the CPU, or for "cuda"
    cuda:(LOCAL_RANK % torch.cuda.device_count()) (LOCAL_RANK from the
    environment, as torchrun sets it; `rank` without it).

    Raises ValueError naming --device and `rank` for "cuda" where torch sees
    no CUDA device or pycollectives was built without CUDA, and for a name
    not in DEVICES.
    """
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"--device {name!r}: rank {rank}: not one of {', '.join(DEVICES)}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda: rank {rank}: torch sees no CUDA device (torch.cuda.is_available() "
            f"is False; torch {torch.__version__}): use --device cpu"
        )
    if not cuda_built():
        raise ValueError(
            f"--device cuda: rank {rank}: pycollectives was built without CUDA (rebuild with "
            "PYCOLL_CUDA=1): use --device cpu"
        )
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


class Trainer3D:
    """Trains the GPT of `config` on `dims` (see the module docstring).

    Collective over dims.world to build and to step. Raises ValueError on
    every rank, naming the flags, for options that do not fit (`problems`)
    or that differ between ranks; the pipeline runtime, parallelize_gpt and
    ZeroOptimizer check what they build the same way.
    """

    def __init__(self, dims: ParallelDims, config: GPTConfig, opts: TrainOptions) -> None:
        self.dims, self.config, self.opts = dims, config, opts
        found = problems(dims, config, opts)
        if not found:
            try:
                self.device = resolve_device(opts.device, dims.world.rank)
            except ValueError as e:
                found.append(str(e))
        error = ValueError("; ".join(found)) if found else None
        agree(dims.world, "Trainer3D", error, digest(f"{config}/{opts}/{dims.sizes}"),
              "train another model or with other options", opts.timeout)  # fmt: skip
        m = opts.microbatches
        # --zero 2/3 and --fsdp (pp = 1): plain accumulation, no pipeline runtime
        self.sharded = opts.zero in (2, 3) or (opts.fsdp and dims.pp == 1)
        v = opts.virtual_stages if opts.schedule == "interleaved" else 1
        self.schedule = build(SCHEDULES[opts.schedule], dims.pp, m, v)
        held = self.schedule.stages_of(dims.pp_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # torch's current device: the CUDA collectives'
        stages = gpt_stages(
            config, held, self.schedule.num_stages, dtype=opts.dtype, device=self.device
        )
        if dims.tp > 1:
            sp = opts.sequence_parallel
            stages = [parallelize_gpt(st, dims, sequence_parallel=sp) for st in stages]
        self.stages = stages
        self.runtime = None
        if not self.sharded:
            self.runtime = PipelineRuntime(
                self.schedule, stages, dims.pp_comm, timeout=opts.timeout, sum_tied=not opts.fsdp
            )
        named, seen = [], set()
        for st in stages:
            for n, p in st.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((TIED if n == "head.weight" and config.tie_embeddings else n, p))
        self.named_params = named
        # Late: the tied weight (summed after the step) and ZB-H1's split layers'
        # weights and biases, tensor-parallel ones included (gradients in W;
        # their hooks fire in I without one).
        late = [p for st in stages for p in st.tied_parameters().values()]
        late += deferred_parameters(stages)
        adamw = dict(lr=opts.lr, betas=opts.betas, weight_decay=opts.weight_decay)
        self.dp: DataParallelMode = build_mode(
            dims, stages, named, late, self.runtime, zero=opts.zero, fsdp=opts.fsdp,
            microbatches=m, overlap=opts.overlap, adamw=adamw,
        )  # fmt: skip
        # what checkpoints, tests and benchmarks look into
        self.optimizer, self.zero, self.averager = self.dp.optimizer, self.dp.zero, self.dp.averager
        self.fsdp_roots = self.dp.fsdp_roots
        self.data = SyntheticSequences(
            config.vocab_size, config.seq_len, opts.num_samples, seed=opts.data_seed
        )
        self.batches = GlobalBatches(opts.num_samples, opts.global_batch, dp_size=dims.dp,
                                     dp_rank=dims.dp_rank, seed=opts.data_seed)  # fmt: skip
        self.step_index = 0  # the next step to run (a resumed run sets it)

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's share of step `step`'s global batch, cut into the
        schedule's micro-batches (inputs, targets)."""
        x, y = self.data.batch(self.batches.ids(step))
        x, y = x.to(self.device), y.to(self.device)
        m = self.opts.microbatches
        return list(zip(x.chunk(m), y.chunk(m), strict=True))

    def step(self) -> StepStats:
        """Collective: one training step (step `step_index`, then incremented).

        A communication error (a dead, stopped or interrupted peer, a timeout,
        a mismatch), raised on every rank, names the ranks as world ranks with
        their (dp, tp, pp) coordinates, whichever group communicator failed."""
        try:
            return self._step()
        except (PyCollectivesError, PipelineError) as e:
            # A pipeline error names pipeline ranks (unless tensor-parallel
            # collectives inside a stage failed: then the aborted one decides).
            axis = "pp" if isinstance(e, PipelineError) and self.dims.tp == 1 else None
            e.args = (f"step {self.step_index} on {self.dims.where()}: "
                      f"{self.dims.in_world_terms(str(e), axis)}",)  # fmt: skip
            raise

    def _step(self) -> StepStats:
        start = time.perf_counter()
        k = self.step_index
        self.dp.zero_grad()
        for _, p in self.named_params:
            p.grad = None
        microbatches = self.microbatches(k)
        if self.runtime is not None:
            with self.dp.accumulating():  # the pipeline step: m backwards per stage
                losses = self.runtime.step(microbatches).losses
        else:
            losses = self._accumulate(microbatches)
        self.dp.finish()
        mine = 0.0
        if losses is not None and self.dims.tp_rank == 0:
            mine = sum(losses) / len(losses) / self.dims.dp
        loss = torch.tensor([mine], dtype=torch.float64)
        self.dims.world.all_reduce(loss, ReduceOp.SUM)
        self.step_index += 1
        tokens = self.opts.global_batch * self.config.seq_len
        return StepStats(k, float(loss[0]), tokens, time.perf_counter() - start)

    def _accumulate(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """--zero 2/3, --fsdp (one stage): forward and backward of each
        micro-batch (loss / m), communicating in the last backward only."""
        model, m, losses = self.stages[0], len(microbatches), []
        for j, (x, y) in enumerate(microbatches):
            quiet = self.dp.accumulating() if j < m - 1 else contextlib.nullcontext()
            with quiet:
                loss = model(x, y)
                (loss / m).backward()
            losses.append(float(loss.detach()))
        return losses

    def storage(self) -> dict[str, int]:
        """Bytes of tensor storage this rank holds by role (params, param_shards, grads,
        optimizer, reduce_buffers), each storage counted once: the sharding engines' own
        roles (ZeroOptimizer's, each FSDP root's), the parameters, their gradients, the
        optimizer's state and the dp all-reduce buckets. Local; no communication."""
        roles: dict[str, list[torch.Tensor]] = {
            r: [] for r in ("params", "param_shards", "grads", "optimizer", "reduce_buffers")
        }
        roots = list(self.fsdp_roots) or ([self.dp.root] if hasattr(self.dp, "root") else [])
        engines = [root.sharding_unit.engine for root in roots]
        engines += [self.zero.engine] if self.zero is not None else []
        for engine in engines:
            for role, tensors in engine.storage_roles(self.optimizer).items():
                roles[role] += tensors
        params = [p for _, p in self.named_params]
        roles["params"] += params
        roles["grads"] += [p.grad for p in params if p.grad is not None]
        roles["optimizer"] += [
            t
            for st in self.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        ]
        if self.averager is not None:
            roles["reduce_buffers"] += self.averager.buffers()
        return count_storage(roles)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective over dims.tp_comm (and dims.dp_comm with --zero 2/3 or
        --fsdp): the parameters of this rank's stages as full tensors
        (tensor-parallel and data-parallel shards gathered), by their names in
        the whole GPT (the tied head under embed.tok.weight)."""
        local = self.dp.full_parameters()
        shapes, out = full_shapes(self.config), {}
        tp = self.dims.tp_comm
        for name, value in local.items():
            if name == "head.weight" and self.config.tie_embeddings:
                name = TIED
            full, t = shapes[name], value.detach().contiguous()
            split = [d for d in range(t.dim()) if t.shape[d] != full[d]]
            if split:
                every = t.new_empty((tp.world_size, *t.shape))
                tp.all_gather(every, t)
                t = torch.cat(list(every), split[0])
            out[name] = t.clone()
        return out


def full_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape in the GPT of `config`, by name (built on meta)."""
    with torch.device("meta"):
        parts = {"embed.": Embedding(config), "head.": LMHead(config)}
        block = Block(config)
    out = {pre + n: tuple(p.shape) for pre, mod in parts.items() for n, p in mod.named_parameters()}
    for i in range(config.n_layer):
        out.update({f"blocks.{i}.{n}": tuple(p.shape) for n, p in block.named_parameters()})
    if config.tie_embeddings:
        out.pop("head.weight")
    return out
