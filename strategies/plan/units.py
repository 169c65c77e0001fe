"""Strict parsing of sizes, bandwidths, times and throughputs, and their echo.

Decimal and binary prefixes are never mixed up: "80GB" is 80e9 bytes, "80GiB"
is 80 * 2**30 bytes, and a bare number or an ambiguous spelling ("80G", "80gb",
"80Gb": gigabits?) is refused with a message naming the input and what to write.
"""

from __future__ import annotations

import re

__all__ = [
    "PlanInputError",
    "format_bytes",
    "parse_bandwidth",
    "parse_bytes",
    "parse_flops",
    "parse_time",
]


class PlanInputError(ValueError):
    """A planner input that cannot be used; the message names it and what to change."""


_BYTE_UNITS = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_FLOP_UNITS = {"FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15}
_NUMBER = r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*"


def _split(text: str, what: str, units: dict, example: str) -> tuple[float, str]:
    if not isinstance(text, str):
        raise PlanInputError(
            f"{what}: expected a string with a unit such as {example!r}, got {text!r}"
        )
    m = re.fullmatch(_NUMBER + r"([A-Za-z/]+)\s*", text)
    if not m or m.group(2) not in units:
        raise PlanInputError(
            f"{what}={text!r}: write a number and one of the units {', '.join(units)} "
            f"(e.g. {example!r}); GB = 1e9 bytes, GiB = 2**30 bytes, no bits, no bare numbers"
        )
    value = float(m.group(1))
    return value, m.group(2)


def parse_bytes(text: str, what: str) -> int:
    """Bytes in `text` ("80GB", "80 GiB", "512MiB"). Raises PlanInputError naming `what`
    for a missing or unknown unit, or a value that is not positive."""
    value, unit = _split(text, what, _BYTE_UNITS, "80GB")
    n = round(value * _BYTE_UNITS[unit])
    if n <= 0:
        raise PlanInputError(f"{what}={text!r} must be more than 0 bytes")
    return n


def parse_bandwidth(text: str, what: str) -> float:
    """Bytes per second in `text` ("25GB/s", "12.5 GiB/s"). Raises PlanInputError naming
    `what` unless the unit is a byte unit followed by /s (no bits: write 100Gbit/s as 12.5GB/s)."""
    if not isinstance(text, str) or not text.rstrip().endswith("/s"):
        raise PlanInputError(
            f"{what}={text!r}: write bytes per second such as '25GB/s' or '12.5GiB/s' "
            "(bytes, not bits)"
        )
    value = parse_bytes(text.rstrip()[:-2], what)
    return float(value)


def parse_time(text: str, what: str) -> float:
    """Seconds in `text` ("5us", "1.5 ms"); zero is allowed. Raises PlanInputError naming `what`."""
    value, unit = _split(text, what, _TIME_UNITS, "5us")
    return value * _TIME_UNITS[unit]


def parse_flops(text: str, what: str) -> float:
    """FLOP per second in `text` ("312TFLOP/s"). Raises PlanInputError naming `what`."""
    value, unit = _split(text, what, _FLOP_UNITS, "312TFLOP/s")
    if value <= 0:
        raise PlanInputError(f"{what}={text!r} must be more than 0")
    return value * _FLOP_UNITS[unit]


def format_bytes(n: float, unit: str = "GB") -> str:
    """`n` bytes in `unit` (one of the byte units), e.g. format_bytes(31.4e9) -> '31.40 GB'."""
    if unit not in _BYTE_UNITS:
        raise PlanInputError(f"format_bytes: unit={unit!r} is not one of {', '.join(_BYTE_UNITS)}")
    return f"{n / _BYTE_UNITS[unit]:.2f} {unit}"
