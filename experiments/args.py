"""Checks of the benchmarks' list flags, so each names what it received the same way."""

from __future__ import annotations


def int_list(flag: str, values, minimum: int, *, why: str = "", example: str = "") -> list[int]:
    """The values of a list flag (e.g. --workers=1,2,4) as integers, in the order given.

    Raises:
      ValueError: an empty list, a value that is not an integer or is below `minimum`,
        naming the flag, what it must be (and `why`), an example and what was received.
    """
    try:
        counts = [int(v) for v in values]
    except (TypeError, ValueError):
        counts = []
    if not counts or min(counts) < minimum:
        received = ",".join(str(v) for v in values) if values is not None else ""
        raise ValueError(f"{flag} must be integers >= {minimum}{f' ({why})' if why else ''}"
                         f"{f', e.g. {example}' if example else ''}. Received: {received!r}")
    return counts
