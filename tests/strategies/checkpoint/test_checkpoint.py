"""strategies.checkpoint.save / load between layouts: every pair of {ZeRO-1
N=2, ZeRO-2 N=3, ZeRO-3 N=4, FSDP N=2, one process}, and each of them into
ZeRO-1 N=3 (model and AdamW state equal after the load, read back by a reader independent of the library),
training resumed from every checkpoint in every layout (same layout: bitwise
equal to the uninterrupted run; another: within test_zero's tolerance against
one process), and bad input raising on every rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from zero_common import CFG, OPT, build, differ, global_batch

import pycollectives as pc
from pycollectives.strategies.checkpoint import load, read_stats, save
from pycollectives.strategies.data_parallel.zero import ZeroOptimizer
from pycollectives.strategies.models.gpt import GPT, GPTConfig

LAYOUTS = {"zero1": 2, "zero2": 3, "zero3": 4, "fsdp": 2, "single": 1}
DESTS = {**LAYOUTS, "zero1@3": 3}  # and ZeRO-1 on 3 ranks, a destination only
GLOBAL = 12  # rows per step whatever the layout: 6, 4, 3, 6, 12 per rank
SAVE_AT, STEPS = 3, 6
# Another layout sums the gradients in another order (and one process takes
# the mean over 12 rows at once): test_zero.py's bound against one process.
RTOL, ATOL = 1e-4, 2e-5
Params = dict[str, torch.Tensor]


def make(comm: pc.Communicator | None, mode: str) -> tuple[GPT, object]:
    """(model, optimizer) in `mode` ("single": a plain model, saved and loaded without a communicator)."""
    if mode == "single":
        model = GPT(CFG)
        return model, torch.optim.AdamW(model.parameters(), **OPT)
    return build(comm, mode.split("@")[0])


def train_step(comm: pc.Communicator | None, model: GPT, opt: object, step: int) -> None:
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    x, y = global_batch(1, step, GLOBAL)
    per = GLOBAL // world
    opt.zero_grad()
    model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    opt.step()


def full(model: GPT, opt: object) -> Params:
    if hasattr(opt, "full_parameters"):
        return opt.full_parameters()
    if hasattr(model, "full_parameters"):
        if model.sharding_unit.engine is None:  # built by the root's first forward
            with torch.no_grad():
                model(global_batch(1, 0, 1)[0])
        return model.full_parameters()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def job_source(comm: pc.Communicator | None, mode: str, root: str) -> tuple[Params, Params]:
    """Trains SAVE_AT steps, saves to root/mode, trains on to STEPS: (params
    at the save, params at the end of the uninterrupted run)."""
    comm = None if mode == "single" else comm
    model, opt = make(comm, mode)
    for s in range(SAVE_AT):
        train_step(comm, model, opt, s)
    saved = full(model, opt)
    save(f"{root}/{mode}", comm, model, opt, extra={"step": SAVE_AT, "mode": mode})
    for s in range(SAVE_AT, STEPS):
        train_step(comm, model, opt, s)
    return saved, full(model, opt)


def job_destination(
    comm: pc.Communicator | None, mode: str, root: str
) -> dict[str, tuple[Params, Params, int]]:
    """For every source: a fresh model and optimizer in `mode`, loaded, saved
    again to root/src-into-mode, trained on to STEPS: (params after the
    load, after the resumed run, tensor bytes this rank read)."""
    comm = None if mode == "single" else comm
    out = {}
    for src in LAYOUTS:
        model, opt = make(comm, mode)
        read_stats(reset=True)
        extra = load(f"{root}/{src}", comm, model, opt)
        got = read_stats()["bytes_read"]
        assert extra == {"step": SAVE_AT, "mode": src}, extra
        loaded = full(model, opt)
        save(f"{root}/{src}-into-{mode}", comm, model, opt)
        for s in range(SAVE_AT, STEPS):
            train_step(comm, model, opt, s)
        out[src] = (loaded, full(model, opt), got)
    return out


def read_full(path: Path) -> dict[str, np.ndarray]:
    """Every global tensor of a checkpoint, with json + numpy alone."""
    index = json.loads((path / "index.json").read_text())
    out = {n: np.zeros(m["shape"], dtype=np.float32) for n, m in index["tensors"].items()}
    seen = {n: np.zeros(m["shape"], dtype=np.int64) for n, m in index["tensors"].items()}
    for p in index["pieces"]:
        raw = (path / p["file"]).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        a, b = json.loads(raw[8 : 8 + n])[p["key"]]["data_offsets"]
        vals = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4")
        box = tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["sizes"], strict=True))
        where = np.arange(out[p["tensor"]].size).reshape(out[p["tensor"]].shape)[box].reshape(-1)
        lo, hi = p["flat"] or (0, where.size)
        out[p["tensor"]].reshape(-1)[where[lo:hi]] = vals
        seen[p["tensor"]].reshape(-1)[where[lo:hi]] += 1
    for name, count in seen.items():
        assert (count == 1).all(), f"{path.name}: {name} elements saved {set(count.flat)} times"
    return out


def _run(pool, mode: str, job, *args):
    t = time.perf_counter()
    out = pool(DESTS[mode]).run(job, mode, *args, timeout=240)[0]
    print(f"{job.__name__} {mode}: {time.perf_counter() - t:.2f} s")
    return out


@pytest.fixture(scope="module")
def matrix(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    sources = {mode: _run(pool, mode, job_source, str(root)) for mode in LAYOUTS}
    dests = {mode: _run(pool, mode, job_destination, str(root)) for mode in DESTS}
    return root, sources, dests


def test_save_holds_every_parameter_and_adamw_state(matrix):
    root, sources, _ = matrix
    for src, (saved, _) in sources.items():
        ck = read_full(root / src)
        names = {n for n in ck if not n.startswith("optim/")}
        assert names == set(saved) - {"head.weight"}, src  # tied to tok_emb.weight
        for n in names:
            assert np.array_equal(ck[n], saved[n].numpy()), (src, n)
            for k in ("exp_avg", "exp_avg_sq"):
                assert ck[f"optim/{k}/{n}"].shape == ck[n].shape, (src, n, k)
            assert ck[f"optim/step/{n}"].shape == () and ck[f"optim/step/{n}"] == SAVE_AT


@pytest.mark.parametrize("dest", list(DESTS))
def test_every_source_loads_into(matrix, dest):
    """Parameters after the load equal the source's; saved again from `dest`,
    every tensor (parameters, exp_avg, exp_avg_sq, step) is bitwise the
    source's checkpoint."""
    root, sources, dests = matrix
    for src, (saved, _) in sources.items():
        loaded, _, _ = dests[dest][src]
        assert differ(loaded, saved) is None, f"{src} -> {dest}: {differ(loaded, saved)}"
        a, b = read_full(root / src), read_full(root / f"{src}-into-{dest}")
        assert a.keys() == b.keys(), f"{src} -> {dest}: {sorted(a.keys() ^ b.keys())}"
        bad = [n for n in a if not np.array_equal(a[n], b[n])]
        assert not bad, f"{src} -> {dest}: {bad[:5]}"


@pytest.mark.parametrize("dest", list(DESTS))
def test_resume_continues_the_uninterrupted_run(matrix, dest):
    _, sources, dests = matrix
    for src, (_, uninterrupted) in sources.items():
        _, resumed, _ = dests[dest][src]
        if src == dest:
            assert differ(resumed, uninterrupted) is None, (src, differ(resumed, uninterrupted))
        else:
            err = differ(resumed, uninterrupted, RTOL, ATOL)
            assert err is None, f"{src} resumed as {dest}: {err}"


def test_each_rank_reads_only_its_share(matrix):
    """A sharded load reads its own share of the tensors' bytes (1/N, give or
    take the padding of the flat shards); one process reads each byte once."""
    root, _, dests = matrix
    index = json.loads((root / "zero3" / "index.json").read_text())
    total = sum(4 * int(np.prod(m["shape"])) for m in index["tensors"].values())
    assert dests["single"]["zero3"][2] == total
    for dest in ("zero3", "zero2", "fsdp", "zero1", "zero1@3"):
        got = dests[dest]["zero3"][2]
        assert got <= 1.05 * total / DESTS[dest], (dest, got, total)


def job_bad_input(comm: pc.Communicator, root: str) -> list[str]:
    """Bad input raises on every rank, naming the operation, the rank and the problem."""
    r, bad = comm.rank, []
    model, opt = build(comm, "zero2")
    save(f"{root}/good", comm, model, opt)

    def expect(fn, *words: str) -> None:
        try:
            fn()
            bad.append(f"no error (wanted {words})")
        except ValueError as e:
            missing = [w for w in (f"rank {r}", "load(", *words) if w not in str(e)]
            if missing:
                bad.append(f"message lacks {missing}: {e}")

    expect(lambda: load(f"{root}/missing", comm, model, opt), "does not exist", "missing")
    other = GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=24)
    m2, o2 = build(comm, "zero2", GPT(other))
    expect(lambda: load(f"{root}/good", comm, m2, o2), "another model", "blocks.2", "24")
    where = f"{root}/good" if r == 0 else f"{root}/nowhere"
    expect(lambda: load(where, comm, model, opt), "on rank 1", "nowhere")
    single = GPT(CFG)
    sgd = torch.optim.SGD(single.parameters(), lr=0.1)
    expect(lambda: load(f"{root}/good", comm, single, sgd), "optimizer", "SGD", "AdamW")
    # fully_shard (one AdamW step per parameter) whose first step skipped one
    # parameter: its step differs from its unit's others, which one ZeroOptimizer
    # flat parameter (one step) cannot hold; the ZeRO optimizer stays untouched.
    fmodel, fopt = build(comm, "fsdp")
    per = GLOBAL // comm.world_size
    for s in range(2):
        x, y = global_batch(1, s, GLOBAL)
        fopt.zero_grad()
        fmodel(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]).backward()
        if s == 0:
            fmodel.blocks[1].ln1.weight.grad = None
        fopt.step()
    save(f"{root}/skipped", comm, fmodel, fopt)
    expect(
        lambda: load(f"{root}/skipped", comm, model, opt),
        "'step' differs",
        "1 for ['blocks.1.ln1.weight']",
        "fully_shard",
    )
    if opt.optimizer.state:
        bad.append("a refused load changed the ZeroOptimizer's state")
    return bad


def test_bad_input_raises_on_every_rank(pool, tmp_path):
    for r, bad in enumerate(pool(2).run(job_bad_input, str(tmp_path), timeout=120)):
        assert not bad, f"rank {r}: {bad}"


def job_other_optimizers(comm: pc.Communicator, root: str) -> dict[str, Params]:
    """ZeRO-1 with SGD momentum, ZeRO-2 with bf16 compute (fp32 master shards):
    saved after 2 steps; returns the full (master) parameters."""
    out = {}
    for label, mode, kw in (
        ("sgd", "zero1", {}),
        ("bf16", "zero2", {"param_dtype": torch.bfloat16}),
    ):
        model = GPT(CFG)
        if label == "sgd":
            opt = ZeroOptimizer(model, torch.optim.SGD, comm, stage=1, lr=0.1, momentum=0.9)
        else:
            opt = build(comm, mode, model, **kw)[1]
        for s in range(2):
            train_step(comm, model, opt, s)
        save(f"{root}/{label}", comm, model, opt)
        out[label] = full(model, opt)
    return out


def test_sgd_momentum_and_mixed_precision_load_into_one_process(pool, tmp_path):
    saved = pool(2).run(job_other_optimizers, str(tmp_path), timeout=120)[0]
    model = GPT(CFG)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    load(tmp_path / "sgd", None, model, sgd)
    ck = read_full(tmp_path / "sgd")
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert differ(got, saved["sgd"]) is None
    assert sgd.param_groups[0]["lr"] == 0.1  # restored
    for n, p in model.named_parameters():
        buf = sgd.state[p]["momentum_buffer"]
        assert buf.abs().sum() > 0 and np.array_equal(buf.numpy(), ck[f"optim/momentum_buffer/{n}"])
    model = GPT(CFG)
    adamw = torch.optim.AdamW(model.parameters(), **OPT)
    load(tmp_path / "bf16", None, model, adamw)  # the fp32 master values, not bf16 copies
    got = {n: p.detach() for n, p in model.named_parameters()}
    ck = read_full(tmp_path / "bf16")
    assert all(
        p.dtype == torch.float32 and np.array_equal(p.numpy(), ck[n]) for n, p in got.items()
    )
    # full_parameters() of ZeRO-2 in bf16 are the compute copies: the masters rounded
    assert differ({n: p.to(torch.bfloat16) for n, p in got.items()}, saved["bf16"]) is None
