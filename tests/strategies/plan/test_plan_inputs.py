"""The planner's inputs: strict units, the derived parameter count, clear refusals."""

from __future__ import annotations

import pytest
import torch

from pycollectives.strategies.models.gpt import Block, Embedding, GPTConfig, LMHead
from pycollectives.strategies.plan import ModelSpec, PlanInputError, parse_bytes, parse_request
from pycollectives.strategies.plan.units import parse_bandwidth, parse_flops, parse_time

BASE = {
    "layers": 2,
    "hidden": 32,
    "heads": 4,
    "vocab": 64,
    "seq": 16,
    "global_batch": 8,
    "hosts": 2,
    "devices_per_host": 2,
    "memory_per_device": "80GB",
    "intra_host": "100GB/s,3us",
    "inter_host": "12.5GB/s,10us",
    "flops": "312TFLOP/s",
}


def test_units_are_strict_and_never_mixed():
    assert parse_bytes("80GB", "m") == 80 * 10**9
    assert parse_bytes("80GiB", "m") == 80 * 2**30
    assert parse_bytes(" 1.5 TB", "m") == 1_500_000_000_000
    assert parse_bandwidth("12.5GiB/s", "bw") == 12.5 * 2**30
    assert parse_time("5us", "t") == pytest.approx(5e-6)
    assert parse_flops("312TFLOP/s", "f") == 312e12
    for bad in ("80", "80G", "80gb", "80Gb", "GB", "-1GB", "80 GB GB"):
        with pytest.raises(PlanInputError, match="memory_per_device"):
            parse_bytes(bad, "memory_per_device")
    with pytest.raises(PlanInputError, match="no bits"):
        parse_bandwidth("100Gbit/s", "inter_host")
    with pytest.raises(PlanInputError, match="bytes per second"):
        parse_bandwidth("100GB", "inter_host")


def _meta_params(cfg: GPTConfig) -> int:
    """Parameters of the reference GPT built on the meta device (no values drawn)."""
    with torch.device("meta"):
        embed = Embedding(cfg)
        block = Block(cfg)
        head = LMHead(cfg, embed.tok.weight if cfg.tie_embeddings else None)
    seen: dict[int, int] = {}
    for m in (embed, head):
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values()) + cfg.n_layer * sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize(
    "shape",
    [
        (2, 32, 4, 64, 16, 0),
        (3, 48, 6, 100, 24, 0),
        (4, 64, 8, 1000, 32, 96),
        (32, 4096, 32, 50304, 2048, 0),
    ],
)
def test_params_derived_match_the_gpt_built_on_meta(shape):
    layers, hidden, heads, vocab, seq, ffn = shape
    spec = ModelSpec(layers, hidden, heads, vocab, seq, ffn)
    cfg = GPTConfig(
        vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, d_model=hidden, d_ff=ffn
    )
    assert spec.params() == _meta_params(cfg)


def test_request_parsed_and_echoed():
    req = parse_request(BASE)
    assert req.cluster.memory == 80 * 10**9
    assert req.cluster.devices == 4
    assert req.allowed.dp == (1, 2, 4)
    echo = req.echo()
    assert echo["cluster"]["memory_per_device"] == "80GB = 80000000000 bytes"
    assert echo["model"]["params"] == req.model.params()
    gib = parse_request({**BASE, "memory_per_device": "80GiB"})
    assert gib.echo()["cluster"]["memory_per_device"] == "80GiB = 85899345920 bytes"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"memory_per_device": "80"}, "memory_per_device='80'"),
        ({"memory_per_device": 80}, "memory_per_device"),
        ({"intra_host": "100GB/s"}, "intra_host"),
        ({"flops": "312T"}, "flops"),
        ({"heads": 5}, "hidden=32 is not divisible by heads=5"),
        ({"layers": 0}, "layers=0"),
        ({"tp": [3], "dp": [1], "pp": [1]}, "no product dp\\*tp\\*pp equals the 4 devices"),
        ({"sharding": ["zero4"]}, "sharding: 'zero4'"),
        ({"schedules": "pipedream"}, "schedules: 'pipedream'"),
        ({"dtype": "int8"}, "dtype: 'int8'"),
        ({"microbatches": [0]}, "microbatches"),
        ({"gpus": 8}, "unknown input\\(s\\) gpus"),
    ],
)
def test_bad_input_names_what_to_change(change, message):
    with pytest.raises(PlanInputError, match=message):
        parse_request({**BASE, **change})
    missing = dict(BASE)
    del missing["memory_per_device"]
    with pytest.raises(PlanInputError, match="memory_per_device is missing"):
        parse_request(missing)
