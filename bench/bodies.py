"""Download bodies of the download mode, the same bytes in the upstream and in bench.redaction.

- `binary`: pseudo-random bytes (a release asset, a tarball, compressed data);
- `text`: URL-safe tokens separated by spaces (logs, base64 text);
- `json`: JSON objects whose strings hold escapes (`\\n`, `\\"`, `\\/`) and percent-encoded
  text: the escape characters the redactor must look behind.
"""

from __future__ import annotations

import argparse
import base64
import functools
import random

KINDS = ("binary", "text", "json")


@functools.cache
def body(kind: str, size: int) -> bytes:
    """`size` bytes of `kind`, the same on every call and in every process."""
    rng = random.Random(f"{kind}/{size}")
    if kind == "binary":
        return rng.randbytes(size)
    if kind == "text":
        words = base64.urlsafe_b64encode(rng.randbytes(size)).replace(b"A", b" ")
        return words[:size]
    if kind == "json":
        parts = []
        total = 0
        while total < size:
            word = base64.urlsafe_b64encode(rng.randbytes(12))
            part = (
                b'{"id": %d, "name": "%s \\n \\"quoted\\"", '
                b'"url": "https:\\/\\/files.example\\/%s?q=a%%20b"},\n' % (total, word, word)
            )
            parts.append(part)
            total += len(part)
        return b"".join(parts)[:size]
    raise ValueError(f"unknown body kind {kind!r}")


def parse_sizes(text: str) -> tuple[int, ...]:
    """`1m,16m` -> sizes in bytes (k and m are binary); an argparse type."""
    units = {"k": 1024, "m": 1024 * 1024}
    try:
        values = tuple(
            int(v[:-1]) * units[v[-1].lower()] if v[-1].lower() in units else int(v)
            for v in (v.strip() for v in text.split(","))
        )
    except (ValueError, IndexError) as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of sizes: {text}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("sizes must be positive")
    return values
