"""The response redactor's cost per byte, in this process: `python -m bench.redaction`.

`Redactor.feed` over each body kind of bench.bodies, in pieces of the size mitmproxy hands
a response stream, for a secret shaped like the benchmark's (a 43-character URL-safe token),
echoed nowhere: what every download through a redacted grant pays. The token is the same on
every run, so that runs compare: the sieve's cost depends on which escapes the secret's bytes
have (this one holds `-`, whose escape `%2d` begins as the JSON body's `%20` does).
"""

from __future__ import annotations

import base64
import random
import sys
import time
from typing import Any

from addon.redaction.redact import Redactor
from bench.bodies import KINDS, body

SIZE = 4 * 1024 * 1024
PIECES = (16 * 1024, 64 * 1024)
ROUNDS = 3


def _feed(secret: bytes, data: bytes, piece: int) -> float:
    """Seconds to redact `data` in pieces of `piece` bytes (best of ROUNDS)."""
    best = float("inf")
    for _ in range(ROUNDS):
        redactor = Redactor([secret])
        began = time.perf_counter()
        for at in range(0, len(data), piece):
            redactor.feed(data[at : at + piece])
        redactor.feed(b"")
        best = min(best, time.perf_counter() - began)
    return best


def costs(kind: str | None = "binary") -> list[dict[str, Any]] | None:
    """ns per byte and MB/s of Redactor.feed for each body kind; None when `kind` is None."""
    if kind is None:
        return None
    secret = base64.urlsafe_b64encode(random.Random(7).randbytes(32)).rstrip(b"=")
    rows = []
    for each in KINDS:
        data = body(each, SIZE)
        for piece in PIECES:
            seconds = _feed(secret, data, piece)
            rows.append(
                {
                    "body": each,
                    "piece": piece,
                    "ns_per_byte": round(seconds * 1e9 / len(data), 2),
                    "mb_s": round(len(data) / seconds / 1e6, 1),
                }
            )
    return rows


if __name__ == "__main__":
    for row in costs() or []:
        print(
            f"{row['body']:<7} pieces of {row['piece']:>6} B: {row['ns_per_byte']:6.2f} ns/B, "
            f"{row['mb_s']:7.1f} MB/s",
            file=sys.stdout,
        )
