"""The planner's memory model against the published figures (exact formulas)."""

from __future__ import annotations

import pytest

from pycollectives.strategies.plan import PlanInputError
from pycollectives.strategies.plan.memory import activation_bytes_per_layer, model_states


@pytest.mark.parametrize(
    "sharding, published_gb",
    [("none", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9), ("fsdp", 1.9)],
)
def test_zero_paper_7_5b_on_64_devices(sharding, published_gb):
    """Rajbhandari et al. 2020, Fig. 1 / Table 1: Psi = 7.5B, N_d = 64, K = 12, mixed-precision
    Adam; GB = 1e9 bytes, the paper's figures rounded to one decimal (31.40625, 16.640625,
    1.875)."""
    states = model_states(7.5e9, 64, sharding, "bf16-mixed")
    assert round(states.total / 1e9, 1) == published_gb


def test_zero_paper_exact_bytes_and_items():
    p, n = 7.5e9, 64
    assert model_states(p, n, "none", "bf16-mixed").total == 16 * p
    assert model_states(p, n, "zero1", "bf16-mixed").total == 4 * p + 12 * p / n
    assert model_states(p, n, "zero2", "bf16-mixed").total == 2 * p + 14 * p / n
    assert model_states(p, n, "zero3", "bf16-mixed").total == 16 * p / n
    s = model_states(p, n, "zero1", "bf16-mixed")
    assert (s.params, s.grads, s.master, s.optimizer) == (2 * p, 2 * p, 4 * p / n, 8 * p / n)
    fp32 = model_states(p, n, "zero1", "fp32")
    assert fp32.total == 8 * p + 8 * p / n  # benchmarks/data_parallel/zero_memory.py's fp32 row


def test_project_accounting_differs_where_the_strategies_do():
    p, n = 1000.0, 4
    assert model_states(p, n, "zero3", "bf16-mixed", "pycollectives").total == 14 * p / n
    assert model_states(p, n, "fsdp", "bf16-mixed", "pycollectives").total == 16 * p / n
    assert model_states(p, n, "zero2", "bf16-mixed", "pycollectives").total == 2 * p + 14 * p / n
    with pytest.raises(PlanInputError, match="accounting"):
        model_states(p, n, "zero3", "bf16-mixed", "deepspeed")
    with pytest.raises(PlanInputError, match="sharding"):
        model_states(p, n, "zero4", "bf16-mixed")


# Korthikanti et al. 2022, Table 2, evaluated at GPT-3 175B's shape (their Table 3: a = 96,
# h = 12288, s = 2048, t = 8) with b = 1: each published expression, term by term.
S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H


def test_korthikanti_table_2():
    assert activation_bytes_per_layer(S, B, H, A) == SBH * (34 + 5 * A * S / H)
    assert activation_bytes_per_layer(S, B, H, A, T) == SBH * (10 + 24 / T + 5 * A * S / (H * T))
    assert activation_bytes_per_layer(S, B, H, A, T, sequence_parallel=True) == pytest.approx(
        SBH * (34 + 5 * A * S / H) / T, rel=1e-15
    )
    assert activation_bytes_per_layer(S, B, H, A, T, recompute="selective") == SBH * (10 + 24 / T)
    assert (
        activation_bytes_per_layer(S, B, H, A, T, sequence_parallel=True, recompute="selective")
        == SBH * 34 / T
    )
    assert activation_bytes_per_layer(S, B, H, A, T, recompute="full") == 2 * SBH
    # t = 1: tensor parallel reduces to no parallelism.
    assert activation_bytes_per_layer(S, B, H, A, 1) == activation_bytes_per_layer(S, B, H, A)


def test_korthikanti_figures_in_gb():
    """The 175B layer in concrete numbers (bytes / 1e9): 34 + 5as/h = 114 at this shape."""
    assert 5 * A * S / H == 80.0
    assert activation_bytes_per_layer(S, B, H, A) / 1e9 == pytest.approx(2.869, abs=1e-3)
    assert activation_bytes_per_layer(
        S, B, H, A, T, sequence_parallel=True, recompute="selective"
    ) / 1e9 == pytest.approx(0.1069, abs=1e-4)
    with pytest.raises(PlanInputError, match="recompute='some'"):
        activation_bytes_per_layer(S, B, H, A, recompute="some")
