"""The response redactor's cost per byte, in this process: `python -m bench.redaction`.

Two measures:

- `costs`: `Redactor.feed` over each body kind of bench.bodies, in pieces of the size
  mitmproxy hands a response stream, for one fixed secret shaped like the benchmark's (a
  43-character URL-safe token), echoed nowhere.
- `sweep` (`--sweep`): body kinds dense in the bytes escapes and base64 are written with (hex,
  base64, URL-encoded text, JSON with 40-hex SHAs, HTML, binary) × 1-4 secrets per redactor ×
  `--draws` random draws of `secrets.token_urlsafe(32)`, min / median / max MB/s per cell. The
  sieve's cost depends on which escapes the drawn secrets' bytes have: the minimum over draws
  is the figure that matters. Draws come from `--seed`, so that runs compare.
"""

from __future__ import annotations

import argparse
import base64
import random
import statistics
import sys
import time
from typing import Any

from addon.redaction.redact import Redactor, prepare
from bench.bodies import KINDS, SWEEP, body

SIZE = 4 * 1024 * 1024
PIECES = (16 * 1024, 64 * 1024)
PIECE = 64 * 1024
ROUNDS = 3


def _feed(secrets: list[bytes], data: bytes, piece: int, rounds: int = ROUNDS) -> float:
    """Seconds to redact `data` in pieces of `piece` bytes (best of `rounds`), the search built
    beforehand as the proxy builds it, once per secret set and off the event loop."""
    best = float("inf")
    prepared = prepare(secrets)
    for _ in range(rounds):
        redactor = Redactor(secrets, prepared)
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
            seconds = _feed([secret], data, piece)
            rows.append(
                {
                    "body": each,
                    "piece": piece,
                    "ns_per_byte": round(seconds * 1e9 / len(data), 2),
                    "mb_s": round(len(data) / seconds / 1e6, 1),
                }
            )
    return rows


def _token(rng: random.Random) -> bytes:
    """What `secrets.token_urlsafe(32)` returns, from a seeded generator."""
    return base64.urlsafe_b64encode(rng.randbytes(32)).rstrip(b"=")


def sweep(
    kinds: tuple[str, ...], counts: tuple[int, ...], draws: int, size: int, seed: int
) -> list[dict[str, Any]]:
    """min / median / max MB/s per body kind and number of secrets, over `draws` draws."""
    rows = []
    for kind in kinds:
        data = SWEEP[kind](random.Random(kind), size)[:size]
        for count in counts:
            rng = random.Random(f"{seed}/{count}")
            rates: list[float] = []
            slowest: list[bytes] = []
            for _ in range(draws):
                drawn = [_token(rng) for _ in range(count)]
                rate = len(data) / _feed(drawn, data, PIECE, rounds=1) / 1e6
                if not rates or rate < min(rates):
                    slowest = drawn
                rates.append(rate)
            rows.append(
                {
                    "body": kind,
                    "secrets": count,
                    "min": round(min(rates)),
                    "median": round(statistics.median(rates)),
                    "max": round(max(rates)),
                    "slowest": [s.decode() for s in slowest],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redaction", description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="body kinds x secrets x draws")
    parser.add_argument("--kinds", default=",".join(SWEEP), help="sweep: body kinds")
    parser.add_argument("--secrets", default="1,2,3,4", help="sweep: secrets per redactor")
    parser.add_argument("--draws", type=int, default=20, help="sweep: draws per cell")
    parser.add_argument("--size", type=int, default=2 * 1024 * 1024, help="sweep: body bytes")
    parser.add_argument("--seed", type=int, default=0, help="sweep: seed of the draws")
    parser.add_argument("--slowest", action="store_true", help="sweep: print the slowest draw")
    args = parser.parse_args(argv)
    if not args.sweep:
        for row in costs() or []:
            print(
                f"{row['body']:<7} pieces of {row['piece']:>6} B: {row['ns_per_byte']:6.2f} "
                f"ns/B, {row['mb_s']:7.1f} MB/s"
            )
        return
    kinds = tuple(args.kinds.split(","))
    counts = tuple(int(c) for c in args.secrets.split(","))
    print(f"{'body':<9} secrets  min MB/s  median  max  ({args.draws} draws, {args.size} B)")
    for row in sweep(kinds, counts, args.draws, args.size, args.seed):
        print(
            f"{row['body']:<9} {row['secrets']:>7}  {row['min']:>8}  {row['median']:>6}  "
            f"{row['max']:>5}" + (f"  {' '.join(row['slowest'])}" if args.slowest else ""),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
