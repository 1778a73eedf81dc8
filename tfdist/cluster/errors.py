"""The errors of tfdist.cluster, and how their messages quote what was received.

Everything a message quotes comes from a user (an environment variable, a
flag, a file), so it is quoted with `received()`: bounded in length and depth,
and ASCII only, so a hostile value can neither flood a terminal nor break the
print of the message itself (a surrogate from invalid UTF-8 in the
environment cannot be written to a UTF-8 stderr).
"""

from __future__ import annotations

import reprlib
from typing import Any


class TFConfigError(ValueError):
    """A TF_CONFIG (or a cluster description) is invalid; the message says how to fix it."""


class TFConfigWarning(UserWarning):
    """A TF_CONFIG that works but should be changed (e.g. an unknown top-level key)."""


class _Received(reprlib.Repr):
    def __init__(self):
        super().__init__()
        self.maxlevel = 4
        self.maxstring = 120
        self.maxother = 120
        self.maxlong = 60
        self.maxdict = self.maxlist = self.maxtuple = 8

    def repr_int(self, x, level):
        # str() of an int over 4300 digits raises ValueError (CPython's limit).
        if x.bit_length() > 200:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_str(self, x, level):
        return ascii(x) if len(x) <= self.maxstring else (
            ascii(x[:self.maxstring // 2]) + "..." + ascii(x[-self.maxstring // 4:]))


_RECEIVED = _Received()


def received(value: Any) -> str:
    """repr() of a user-supplied value for an error message: short, shallow, ASCII."""
    try:
        return _RECEIVED.repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail to build
        return f"<a {type(value).__name__}>"


def check_count(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """Raises TFConfigError unless `value` is an int in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise TFConfigError(
            f"{name} must be an integer {bound}. Received: {name}={received(value)}")
