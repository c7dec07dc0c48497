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
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from addon.redaction.redact import Redactor, prepare
from bench.bodies import KINDS, body

SIZE = 4 * 1024 * 1024
PIECES = (16 * 1024, 64 * 1024)
PIECE = 64 * 1024
ROUNDS = 3


def _feed(secrets: list[bytes], data: bytes, piece: int, rounds: int = ROUNDS) -> float:
    """Seconds to redact `data` in pieces of `piece` bytes (best of `rounds`), the search built
    beforehand as the proxy builds it, once per secret set and off the event loop."""
    best = float("inf")
    prepared = prepare(secrets, sieve=True)
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


def _hex(rng: random.Random, size: int) -> bytes:
    """Lines of sha256 digests, as checksum lists and PEP 503 pages hold them."""
    return b"\n".join(rng.randbytes(32).hex().encode() for _ in range(size // 65 + 1))


def _b64(rng: random.Random, size: int) -> bytes:
    return base64.encodebytes(rng.randbytes(size * 3 // 4 + 3))


def _urlencoded(rng: random.Random, size: int) -> bytes:
    """A query string: words and UTF-8 and punctuation percent-escaped as `quote` writes them."""
    out, total = [], 0
    while total < size:
        word = base64.urlsafe_b64encode(rng.randbytes(rng.randint(3, 9))).rstrip(b"=")
        raw = rng.randbytes(rng.randint(1, 4))
        part = b"q%d=%s%s%%20&" % (total, word, quote(raw, safe="").encode())
        out.append(part)
        total += len(part)
    return b"".join(out)


def _json(rng: random.Random, size: int) -> bytes:
    """GitHub-like commits: 40-hex SHAs, escaped URLs, dates."""
    out, total = [], 0
    while total < size:
        sha, tree = rng.randbytes(20).hex().encode(), rng.randbytes(20).hex().encode()
        part = (
            b'{"sha": "%s", "commit": {"tree": {"sha": "%s", "url": '
            b'"https:\\/\\/api.github.com\\/repos\\/o\\/r\\/git\\/trees\\/%s"}, '
            b'"message": "fix \\"x\\"\\n", "date": "2026-12-07T04:43:49Z"}},\n' % (sha, tree, tree)
        )
        out.append(part)
        total += len(part)
    return b"".join(out)


def _html(rng: random.Random, size: int) -> bytes:
    """A PEP 503 simple page: links with sha256 fragments and character references."""
    out, total = [], 0
    while total < size:
        digest = rng.randbytes(32).hex().encode()
        part = (
            b'<a href="https://files.example/p/pkg-1.%d.tar.gz#sha256=%s" '
            b'data-requires-python="&gt;=3.9">pkg&#45;1.%d &amp; more</a><br/>\n'
            % (total, digest, total)
        )
        out.append(part)
        total += len(part)
    return b"".join(out)


SWEEP: dict[str, Callable[[random.Random, int], bytes]] = {
    "hex": _hex,
    "base64": _b64,
    "urlenc": _urlencoded,
    "json-sha": _json,
    "html": _html,
    "binary": lambda rng, size: rng.randbytes(size),
}


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
