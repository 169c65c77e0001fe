"""The reference GPT (strategies.models) and the deterministic data
(strategies.data), in one process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pycollectives.strategies.data import GlobalBatches, SyntheticSequences
from pycollectives.strategies.models import GPT, GPTConfig, initial_value


def test_config_errors():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_head=4"):
        GPTConfig(d_model=30)
    with pytest.raises(ValueError, match="n_layer=0 must be >= 1"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout=1.0"):
        GPTConfig(dropout=1.0)


def test_forward_shapes_and_tied_head():
    cfg = GPTConfig()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert model(idx).shape == (3, cfg.seq_len, cfg.vocab_size)
    assert model(idx, idx).shape == ()
    assert model.head.weight is model.embed.tok.weight
    assert "head.weight" not in dict(model.named_parameters())  # counted once
    untied = GPT(dataclasses.replace(cfg, tie_embeddings=False))
    assert not torch.equal(untied.head.weight, untied.embed.tok.weight)
    with pytest.raises(ValueError, match="longer than seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_initialization_depends_on_seed_and_name_only():
    cfg = GPTConfig(n_layer=3)
    a, b = GPT(cfg), GPT(cfg, torch.float64)
    torch.manual_seed(123)  # torch's generator plays no part, and is left as it was
    state = torch.get_rng_state()
    c = GPT(cfg)
    assert torch.equal(state, torch.get_rng_state())
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q.float()) and torch.equal(p, r), name
        assert torch.equal(p, initial_value(cfg, name, tuple(p.shape))), name
    other = GPT(dataclasses.replace(cfg, seed=1))
    assert not torch.equal(other.blocks[0].mlp.fc.weight, a.blocks[0].mlp.fc.weight)
    # Each block's weights are drawn from their own generator: block 2 of a
    # 3-block model is block 2 of a 4-block one, up to the residual scaling.
    deeper = GPT(dataclasses.replace(cfg, n_layer=4))
    assert torch.equal(deeper.blocks[2].mlp.fc.weight, a.blocks[2].mlp.fc.weight)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, a.blocks[1].attn.qkv.weight)
    # Norms ones and zeros, biases zeros, residual projections scaled down.
    assert torch.equal(a.blocks[0].ln1.weight, torch.ones(cfg.d_model))
    assert not a.blocks[0].attn.qkv.bias.any()
    ratio = a.blocks[0].mlp.proj.weight.std() / a.blocks[0].mlp.fc.weight.std()
    assert abs(ratio - 1 / math.sqrt(2 * cfg.n_layer)) < 0.1


def test_data_is_deterministic_and_sharded_by_rank():
    data = SyntheticSequences(16, 8, 50, seed=1)
    assert torch.equal(data[7], SyntheticSequences(16, 8, 50, seed=1)[7])
    assert not torch.equal(data[7], SyntheticSequences(16, 8, 50, seed=2)[7])
    x, y = data.batch(torch.tensor([3, 7]))
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1], data[7][:-1])
    # Every token follows the chain.
    tokens = data.samples(torch.arange(50))
    allowed = data.successors[tokens[:, :-1]] == tokens[:, 1:, None]
    assert allowed.any(-1).all()
    order = GlobalBatches(50, 12, seed=4)
    # Epochs are permutations laid end to end: 5 steps of 12 cover 50 ids, then 10 more.
    ids = torch.cat([order.global_ids(s) for s in range(5)])
    assert sorted(ids[:50].tolist()) == list(range(50))
    assert torch.equal(ids[50:], order.permutation(1)[:10])
    assert not torch.equal(order.permutation(0), order.permutation(1))
    for dp in (1, 2, 3, 4):
        shares = [GlobalBatches(50, 12, dp_size=dp, dp_rank=r, seed=4) for r in range(dp)]
        for step in (0, 4, 9):  # random access: no state carried between steps
            assert torch.equal(torch.cat([s.ids(step) for s in shares]), order.global_ids(step))
    with pytest.raises(ValueError, match="global_batch_size=12 is not divisible by dp=5"):
        GlobalBatches(50, 12, dp_size=5)
    with pytest.raises(IndexError, match="outside"):
        data.samples(torch.tensor([50]))


def test_loss_falls_on_synthetic_sequences():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=32)
    data = SyntheticSequences(cfg.vocab_size, cfg.seq_len, 256, seed=0)
    order = GlobalBatches(256, 16, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(60):
        loss = model(*data.batch(order.global_ids(step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(cfg.vocab_size)
    # Near the floor log(2): each next token is one of 2 successors, at random.
    assert sum(losses[-5:]) / 5 < data.loss_floor + 0.35, losses
