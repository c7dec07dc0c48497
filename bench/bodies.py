"""Download bodies of the download mode, the same bytes in the upstream and in bench.redaction.

- `binary`: pseudo-random bytes (a release asset, a tarball, compressed data);
- `text`: URL-safe tokens separated by spaces (logs, base64 text);
- `json`: JSON objects whose strings hold escapes (`\\n`, `\\"`, `\\/`) and percent-encoded
  text: the escape characters the redactor must look behind;
- the redaction sweep's kinds (issue 47): `hex` (sha256 lines), `base64` (MIME lines),
  `urlenc` (a query string dense with escapes), `json-sha` (GitHub-like commits), `html` (a
  PEP 503 page with character references).
"""

from __future__ import annotations

import argparse
import base64
import functools
import random
from collections.abc import Callable
from urllib.parse import quote


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
    if kind in SWEEP:
        return SWEEP[kind](rng, size)[:size]
    raise ValueError(f"unknown body kind {kind!r}")


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


# The redaction sweep's kinds (bench.redaction --sweep), each also a download body (--body).
SWEEP: dict[str, Callable[[random.Random, int], bytes]] = {
    "hex": _hex,
    "base64": _b64,
    "urlenc": _urlencoded,
    "json-sha": _json,
    "html": _html,
    "binary": lambda rng, size: rng.randbytes(size),
}


KINDS = ("binary", "text", "json", *(k for k in SWEEP if k != "binary"))


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
