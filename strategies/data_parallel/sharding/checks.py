"""Checks that every rank agrees on before the engine communicates: bad input
raises the same clear error on every rank instead of a hang.

Each check is local (this rank's model, arguments, devices) and its findings
are exchanged in one collective (`agree`), so a problem seen by one rank only
(a parameter on another device there, a model built differently) still stops
every rank, with a message naming the ranks and the parameter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pycollectives import Communicator

from .communications import all_gather_bytes

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "agree",
    "describe_params",
    "device_problems",
    "optimizer_problems",
]

# Optimizers whose update of each element depends only on that element's
# gradient, state and scalar hyperparameters: stepping a flat 1/N shard equals
# stepping the full tensors elementwise (bitwise, with the same implementation
# flags). Adafactor (factored row/column statistics), Muon (orthogonalized
# matrices), LBFGS (global line search) and SparseAdam (sparse gradients) are not.
ELEMENTWISE_OPTIMIZERS: tuple[str, ...] = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "NAdam",
    "RAdam",
    "ASGD",
)


def describe_params(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """(name, shape, dtype, requires_grad, device type) of each parameter, as plain data."""
    return [
        [n, list(p.shape), str(p.dtype), bool(p.requires_grad), p.device.type] for n, p in named
    ]


def device_problems(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Parameters on several devices, or not materialized (meta)."""
    out = []
    devices: dict[str, list[str]] = {}
    for n, p in named:
        devices.setdefault(str(p.device), []).append(n)
    if len(devices) > 1:
        listing = ", ".join(
            f"{d} ({names[0]}{', ...' if len(names) > 1 else ''})" for d, names in devices.items()
        )
        out.append(f"parameters are on several devices: {listing}; move the module to one device")
    if "meta" in devices:
        out.append(f"parameters {devices['meta'][:3]} are on the meta device (not materialized)")
    return out


def optimizer_problems(
    optimizer_class: Any, kwargs: dict[str, Any], assume_elementwise: bool
) -> list[str]:
    """Why `optimizer_class(**kwargs)` cannot step flat 1/N shards, if it cannot."""
    if not isinstance(optimizer_class, type) or not issubclass(
        optimizer_class, torch.optim.Optimizer
    ):
        return [
            f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer subclass "
            "(pass the class, e.g. torch.optim.AdamW, and its arguments as keywords)"
        ]
    name = optimizer_class.__name__
    if name not in ELEMENTWISE_OPTIMIZERS and not assume_elementwise:
        return [
            f"{name} does not fit ZeRO: every rank steps a flat 1/N shard of each unit's "
            "parameters, which equals the full update only for an optimizer that updates each "
            f"element from its own gradient and state ({', '.join(ELEMENTWISE_OPTIMIZERS)}); "
            f"pass assume_elementwise=True if {name} is one"
        ]
    try:  # bad hyperparameters fail here, alike on every rank, not in the middle of setup
        optimizer_class([nn.Parameter(torch.zeros(1))], **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        return [f"{name}(**{kwargs}) raised {type(e).__name__}: {e}"]
    return []


def agree(comm: Communicator, what: str, description: Any, problems: list[str]) -> None:
    """Collective: exchanges every rank's `description` (plain data) and local
    `problems`, and raises the same ValueError on every rank if any rank has a
    problem or the descriptions differ. A description that is a list of
    [name, ...] entries is compared entry by entry, so the message names the
    first entry that differs and the ranks on each side."""
    payload = json.dumps({"d": description, "p": problems}).encode()
    every = [json.loads(b) for b in all_gather_bytes(comm, payload)]
    found: dict[str, list[int]] = {}
    for r, e in enumerate(every):
        for p in e["p"]:
            found.setdefault(p, []).append(r)
    if found:
        msgs = [f"on {_ranks(rs)}: {p}" for p, rs in found.items()]
        raise ValueError(f"{what}: rank {comm.rank}: " + "; ".join(msgs))
    descs = [e["d"] for e in every]
    if all(d == descs[0] for d in descs):
        return
    raise ValueError(f"{what}: rank {comm.rank}: {_difference(descs)}")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _difference(descs: list[Any]) -> str:
    """Names the first entry that differs between the ranks' descriptions."""
    if all(isinstance(d, list) for d in descs):
        for i in range(max(len(d) for d in descs)):
            entries = [json.dumps(d[i]) if i < len(d) else "nothing" for d in descs]
            if len(set(entries)) > 1:
                groups: dict[str, list[int]] = {}
                for r, e in enumerate(entries):
                    groups.setdefault(e, []).append(r)
                sides = "; ".join(f"ranks {rs}: {e}" for e, rs in groups.items())
                first = next(d[i] for d in descs if i < len(d))
                label = first[0] if isinstance(first, list) and first else f"entry {i}"
                return (
                    f"the model differs between ranks at '{label}' (entry {i}): {sides}; every "
                    "rank must build the same model, with the same settings"
                )
    groups = {}
    for r, d in enumerate(descs):
        groups.setdefault(json.dumps(d), []).append(r)
    return "the ranks' settings differ: " + "; ".join(
        f"ranks {rs}: {d}" for d, rs in groups.items()
    )
