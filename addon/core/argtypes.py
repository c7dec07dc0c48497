"""argparse types for the CLI's numbers: plain ASCII, range-checked, never NaN."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from datetime import timedelta

MAX_ID = 2**63 - 1  # the databases' BIGINT; past it SQLite raises rather than finds nothing


def seconds() -> Callable[[str], float]:
    """A finite, non-negative number of seconds."""

    def parse(text: str) -> float:
        try:
            # float() also takes other scripts' digits and `1_0`: plain ASCII only.
            if not text.isascii() or "_" in text:
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite, non-negative number")
        return value

    return parse


def count(minimum: int, maximum: int = MAX_ID) -> Callable[[str], int]:
    """A whole number in [minimum, maximum], in plain ASCII digits."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not minimum <= int(text) <= maximum:
            raise argparse.ArgumentTypeError(
                f"{text!r} must be a whole number from {minimum} to {maximum}"
            )
        return int(text)

    return parse


MAX_TTL = timedelta(days=30)
_TTL_RE = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_TTL_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def ttl(text: str) -> timedelta:
    """A session's lifetime: 30s, 10m, 8h or 7d, at most 30 days."""
    m = _TTL_RE.fullmatch(text)
    value = timedelta(**{_TTL_UNITS[m.group(2)]: int(m.group(1))}) if m else None
    if value is None or value > MAX_TTL:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use 30s, 10m, 8h or 7d, at most 30d"
        )
    return value
