"""The split of the GPT into stages, and the split backward (ZB-H1's I and W
by explicit functions per layer): single-process against nn.Linear, the LM
head and the plain GPT, bitwise; then with tensor-parallel stages on real
ranks against one process and against the unsplit layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pipeline_cases import B, T, config, microbatches
from torch import nn

import pycollectives as pc
from pycollectives.strategies.models import GPT
from pycollectives.strategies.parallel_dims import ParallelDims
from pycollectives.strategies.pipeline import (
    AutogradStage,
    PipelineRuntime,
    SplitLinear,
    SplitLMHead,
    WeightGradStore,
    balance,
    build,
    deferred_parameters,
    gpt_stages,
    layer_split,
)
from pycollectives.strategies.pipeline.gpt_stage import TIED
from pycollectives.strategies.tensor_parallel import parallelize_gpt


def test_layer_split_balances_parameters():
    assert balance([1] * 8, 4) == [2, 2, 2, 2]
    assert balance([1] * 8, 4, first=3) == [1, 2, 2, 3]
    assert balance([5, 1, 1, 1, 1], 2) == [1, 4]
    big = config(8, vocab_size=4096)  # the embedding and head outweigh blocks
    sizes = [len(r) for r in layer_split(big, 4)]
    assert sum(sizes) == 8 and sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes
    assert [len(r) for r in layer_split(config(8), 3, [2, 5, 1])] == [2, 5, 1]
    for bad in ([2, 5], [0, 7, 1], [2, 2, 2]):
        with pytest.raises(ValueError, match="split="):
            layer_split(config(8), 3, bad)
    with pytest.raises(
        ValueError, match="fewer layers than stages: n_layer=3 blocks cannot fill 4"
    ):
        gpt_stages(config(3), [0], 4)


def test_stages_are_the_gpt_cut_apart():
    cfg = config(5)
    gpt = GPT(cfg)
    stages = gpt_stages(cfg, range(3), 3, split=[2, 1, 2])
    full = dict(gpt.named_parameters())
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.equal(p, full[TIED if n == "head.weight" else n]), n
        assert len(st.blocks) == cfg.n_layer  # global indices: Identity elsewhere
    assert stages[2].head.weight is stages[0].embed.tok.weight  # one rank: shared
    x, y = microbatches(1)[0]
    h = stages[1](stages[0](x))
    assert torch.equal(stages[2](h, y), gpt(x, y))


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5, 16), (16, 16)])
def test_split_linear_is_nn_linear_bitwise(shape):
    torch.manual_seed(0)
    ref = nn.Linear(16, 24)
    store = WeightGradStore()
    split = SplitLinear.from_linear(nn.Linear(16, 24), store)
    with torch.no_grad():
        split.weight.copy_(ref.weight)
        split.bias.copy_(ref.bias)
    x = torch.randn(*shape)
    dy = torch.randn(*shape[:-1], 24)
    xr, xs, xo = (x.clone().requires_grad_() for _ in range(3))
    ref(xr).backward(dy)
    with store.microbatch(0):
        out = split(xs)
    out.backward(dy)  # I: dX only
    assert torch.equal(xs.grad, xr.grad) and split.weight.grad is None
    store.backward_weight(0)  # W: dW = dY^T X, db = sum(dY)
    assert torch.equal(split.weight.grad, ref.weight.grad)
    assert torch.equal(split.bias.grad, ref.bias.grad)
    split.zero_grad(set_to_none=True)
    split(xo).backward(dy)  # outside a micro-batch: every gradient now, as nn.Linear
    assert torch.equal(xo.grad, xr.grad) and torch.equal(split.weight.grad, ref.weight.grad)


def test_split_lm_head_is_lm_head_bitwise():
    cfg = config(1)
    ref, other = GPT(cfg).head, GPT(cfg).head
    store = WeightGradStore()
    head = SplitLMHead.from_head(other, store)
    x, y = torch.randn(B, T, 16), torch.randint(0, 32, (B, T))
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr, y).backward()
    with store.microbatch(0):
        loss = head(xs, y)
    loss.backward()
    store.backward_weight(0)
    assert torch.equal(xs.grad, xr.grad) and torch.equal(head.weight.grad, ref.weight.grad)
    assert torch.equal(head.ln_f.weight.grad, ref.ln_f.weight.grad)


def test_split_backward_frees_its_graph():
    """After I and W nothing of a micro-batch stays alive (a stashed X with
    its grad_fn once tied the stash to the graph in a cycle through
    autograd's C++ nodes: every step's activations leaked)."""
    import gc

    cfg = dataclasses.replace(config(2), seq_len=64)
    stage = gpt_stages(cfg, [0], 2)[0]
    ex = AutogradStage(stage, 0, 2, 3, split_weights=True)
    x = torch.randint(0, 32, (4, 64))

    def live() -> int:
        gc.collect()
        return sum(type(o) is torch.Tensor and o.numel() >= 4096 for o in gc.get_objects())

    before = live()
    for _ in range(2):
        for j in range(3):
            ex.forward(j, x, None)
        for j in range(3):
            ex.backward_input(j, torch.ones(4, 64, 16))
            ex.backward_weight(j)
        assert ex.activations() == (0, 0, 0)
        assert live() == before


# ---- with tensor parallelism: stages keep global names, parallelize_gpt applies


def _watch_w(rt: PipelineRuntime, names: dict[int, str], seen: dict[str, bool]) -> None:
    """Records, for each parameter W accumulates into, whether it had no
    .grad right before the step's first W and had one right after (seen)."""
    for st in rt.stages.values():
        store, run_w = st.store, st.store.backward_weight

        def watched(j: int, store=store, run_w=run_w) -> None:  # noqa: ANN001
            params = store.parameters(j)
            before = [p.grad is None for p in params]
            run_w(j)
            for p, none in zip(params, before, strict=True):
                n = names[id(p)]
                seen[n] = seen.get(n, True) and (none or j > 0) and p.grad is not None

        store.backward_weight = watched


def job_tp_pp(comm: pc.Communicator) -> dict:
    """tp=2 x pp=2, 1F1B and ZB-H1 (the tensor-parallel layers split): each
    against one process; ZB-H1 against 1F1B; what ZB-H1's W computed."""
    m = 4
    out: dict = {"bad": [], "grads": {}}
    with ParallelDims(comm, tp=2, pp=2) as dims:
        cfg = config(4)
        ref = GPT(cfg, dtype=torch.float64)
        for x, y in microbatches(m):
            (ref(x, y) / m).backward()
        want = dict(ref.named_parameters())
        for name in ("1f1b", "zb-h1"):
            s = build(name, 2, m)
            stages = gpt_stages(cfg, s.stages_of(dims.pp_rank), 2, dtype=torch.float64)
            stages = [parallelize_gpt(st, dims) for st in stages]
            rt = PipelineRuntime(s, stages, dims.pp_comm, timeout=30)
            seen: dict[str, bool] = {}
            _watch_w(rt, {id(p): n for n, p in stages[0].named_parameters()}, seen)
            rt.step(microbatches(m))
            out["grads"][name] = {n: p.grad.clone() for n, p in stages[0].named_parameters()}
            if name == "zb-h1":
                out["w"] = seen
                out["in_i"] = sorted(
                    n for n, p in stages[0].named_parameters() if id(p) not in
                    {id(q) for q in deferred_parameters(stages)}
                )  # fmt: skip
            for n, p in stages[0].named_parameters():
                full = want[TIED if n in ("head.weight",) else n].grad
                every = p.grad.new_empty((2, *p.grad.shape))
                dims.tp_comm.all_gather(every, p.grad.contiguous())
                split = [d for d in range(p.dim()) if p.shape[d] != full.shape[d]]
                got = torch.cat(list(every), split[0]) if split else every[0]
                if not torch.allclose(got, full, rtol=1e-10, atol=1e-12):
                    out["bad"].append(f"{name} {n}: {(got - full).abs().max():.3g}")
        out["stage"] = dims.pp_rank
    return out


def test_pipeline_with_tensor_parallel_stages(pool):
    """tp=2 x pp=2 matches one process (within rounding: tp sums partial
    products) under 1F1B and ZB-H1; under ZB-H1 the tensor-parallel layers'
    weights and biases get their gradients in W only (none before the first
    W, all of them after it), every other parameter in I, and the gradients
    are bitwise those of 1F1B's unsplit layers."""
    for r, out in enumerate(pool(4).run(job_tp_pp, timeout=120)):
        assert out["bad"] == [], (r, out["bad"])
        one, zb = out["grads"]["1f1b"], out["grads"]["zb-h1"]
        differ = [n for n in one if not torch.equal(one[n], zb[n])]
        assert differ == [], (r, differ)
        tp_layers = {n for n in one if ".attn." in n or ".mlp." in n or n == "head.weight"}
        assert set(out["w"]) == tp_layers and all(out["w"].values()), (r, out["w"])
        assert set(out["in_i"]) == set(one) - tp_layers, (r, out["in_i"])
        if out["stage"] == 0:  # embedding, layer norms; stage 1: its layer norms and ln_f
            assert "embed.tok.weight" in out["in_i"], out["in_i"]
        else:
            assert "head.weight" in out["w"], out["w"]


def job_split_tp_layers(comm: pc.Communicator, sp: bool) -> dict:
    """One tp=2 stage, with or without sequence parallelism: F, I, W of two
    micro-batches through the split layers against F, B of unsplit ones; then
    the split layers outside a micro-batch (every gradient in backward)."""
    m = 2
    with ParallelDims(comm, tp=2) as dims:
        cfg = config(2, tie_embeddings=False)
        split, plain = (
            AutogradStage(parallelize_gpt(gpt_stages(cfg, [0], 1, dtype=torch.float64)[0], dims,
                                          sequence_parallel=sp), 0, 1, m, split_weights=s)
            for s in (True, False)
        )  # fmt: skip
        for j, (x, y) in enumerate(microbatches(m)):
            split.forward(j, x, y)
            plain.forward(j, x, y)
        for j in range(m):
            split.backward_input(j, None)
            plain.backward(j, None)
        named = dict(split.module.named_parameters())
        after_i = sorted(n for n, p in named.items() if p.grad is None)
        deferred = {id(p) for p in deferred_parameters([split.module])}
        for j in range(m):
            split.backward_weight(j)
        want = dict(plain.module.named_parameters())

        def bad() -> list[str]:
            return [
                f"{n}: {(p.grad - want[n].grad).abs().max():.3g}"
                for n, p in named.items()
                if not torch.allclose(p.grad, want[n].grad, rtol=1e-10, atol=1e-12)
            ]

        bad_w = bad()
        for p in named.values():
            p.grad = None
        for x, y in microbatches(m):
            (split.module(x, y) / m).backward()
        return dict(
            after_i=after_i,
            deferred=sorted(n for n, p in named.items() if id(p) in deferred),
            bad_w=bad_w,
            bad_outside=bad(),
        )


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_split_tensor_parallel_layers(pool, sp):
    """The split tensor-parallel layers' gradients equal the unsplit layers'
    (within rounding), with and without sequence parallelism; after I the
    column- and row-parallel weights and biases and the head's weight have
    none, except the row-parallel bias under sequence parallelism (summed
    across tp, a communication, so computed in I)."""
    for r, out in enumerate(pool(2).run(job_split_tp_layers, sp, timeout=60)):
        assert out["bad_w"] == [] and out["bad_outside"] == [], (r, out)
        tp_layers = [f"blocks.{b}.{layer}.{p}" for b in range(2)
                     for layer in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
                     for p in ("bias", "weight")]  # fmt: skip
        if sp:
            tp_layers = [n for n in tp_layers if not n.endswith("proj.bias")]
        assert out["after_i"] == out["deferred"] == sorted([*tp_layers, "head.weight"]), (r, out)
