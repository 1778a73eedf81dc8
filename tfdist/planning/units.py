"""Units of the cost model: bytes, bandwidths and durations read from text and printed.

    >>> parse_bytes("16GiB"), parse_bandwidth("25Gbps"), parse_duration("10us")
    (17179869184, 3125000000.0, 1e-05)
    >>> format_bytes(3e9), format_seconds(0.0123)
    ('3.00 GB', '12.3 ms')

`check_positive` is the validation every planning dataclass uses. No TensorFlow.
"""

from __future__ import annotations

import math
import re
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint32": 4, "uint64": 8, "uint16": 2, "complex64": 8, "complex128": 16,
}

_BYTE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_RATE_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_bytes(text: str | float | int, *, what: str = "memory") -> int:
    """'80GB' -> 80e9, '16GiB' -> 16 * 2**30, '512MB', '1024' (bytes).

    Raises:
      ValueError: unparsable or not positive, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
        if not match or match.group(2) not in _BYTE_UNITS:
            raise ValueError(
                f"{what} must be a size such as 80GB, 16GiB or 512MB. Received: {what}={text!r}"
            )
        value = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    _check_finite(what, value, text, example="80GB")
    if value <= 0:
        raise ValueError(f"{what} must be > 0. Received: {what}={text!r}")
    return int(value)


def _check_finite(what: str, value: float, text: Any, *, example: str) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number such as {example}; {text!r} is "
                         f"{'not a number' if math.isnan(value) else 'too large to represent'}."
                         f" Received: {what}={text!r}")


def parse_bandwidth(text: str | float | int, *, what: str = "bandwidth") -> float:
    """Link bandwidth in bytes/s: '25Gbps' / '25Gb/s' (bits) -> 3.125e9, '10GB/s' -> 1e10.

    A bare number is bytes per second.

    Raises:
      ValueError: unparsable, zero or negative, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip()
        match = re.fullmatch(_NUMBER + r"\s*([kKmMgGtT]?)(bps|b/s|Bps|B/s|bit/s|byte/s)?",
                             raw.replace("ytes", "yte"))
        if not match or (match.group(2) and not match.group(3)):
            raise ValueError(
                f"{what} must be a rate such as 25Gbps (bits/s), 25Gb/s, or 10GB/s "
                f"(bytes/s). Received: {what}={text!r}"
            )
        unit = match.group(3) or "B/s"
        bits = unit in ("bps", "b/s", "bit/s")
        value = float(match.group(1)) * _RATE_PREFIX[match.group(2).lower()]
        value = value / 8 if bits else value
    _check_finite(what, value, text, example="25Gbps")
    if value <= 0:
        raise ValueError(f"{what} must be > 0. Received: {what}={text!r}")
    return value


def parse_duration(text: str | float | int, *, what: str = "latency") -> float:
    """Seconds from '5us', '0.2ms', '1e-5s' or a bare number of seconds (may be 0).

    Raises:
      ValueError: unparsable or negative, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|ns)?", str(text).strip().lower())
        if not match:
            raise ValueError(
                f"{what} must be a duration such as 5us, 0.2ms or 1e-5s. Received: {what}={text!r}"
            )
        value = float(match.group(1)) * _TIME_UNITS[match.group(2) or "s"]
    _check_finite(what, value, text, example="5us")
    if value < 0:
        raise ValueError(f"{what} must be >= 0. Received: {what}={text!r}")
    return value


def format_bytes(num_bytes: float) -> str:
    """Human-readable bytes with binary prefixes: 1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError  # unreachable


def format_seconds(seconds: float) -> str:
    """'12.3 ms', '45.0 us', '1.20 s'."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def check_positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False):
    if value is None:
        raise ValueError(f"{name} is required. Received: {name}=None")
    bad_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if integer:
        bad_type = bad_type or not isinstance(value, int)
    if bad_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {bound}. Received: {name}={value!r}")
