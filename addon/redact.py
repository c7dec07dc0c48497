"""Response redaction: a stamped secret echoed by the upstream reaches the agent as [REDACTED]."""

from __future__ import annotations

import base64
import functools
import re
import zlib
from collections.abc import Callable, Sequence
from urllib.parse import quote, quote_plus

MARK = b"[REDACTED]"


def forms(secret: bytes) -> list[bytes]:
    """The secret as sent, base64 (both alphabets, with and without padding), URL-encoded."""
    candidates = {
        secret,
        base64.b64encode(secret),
        base64.b64encode(secret).rstrip(b"="),
        base64.urlsafe_b64encode(secret),
        base64.urlsafe_b64encode(secret).rstrip(b"="),
        quote(secret, safe="").encode(),
        quote_plus(secret, safe="").encode(),
    }
    return sorted((c for c in candidates if len(c) >= 4), key=len, reverse=True)


@functools.lru_cache(maxsize=4096)
def _compile(secrets: tuple[bytes, ...]) -> tuple[list[bytes], re.Pattern[bytes] | None]:
    """Built once per secret, not per request: the hot path only scans."""
    needles = sorted({f for s in secrets for f in forms(s)}, key=len, reverse=True)
    pattern = re.compile(b"|".join(re.escape(n) for n in needles)) if needles else None
    return needles, pattern


class Redactor:
    """Replaces every form of the secrets in a stream, across chunk boundaries.

    Holds back only a tail that could be the start of a secret, so a stream of events is
    not delayed when nothing in it resembles one.
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self._needles, self._pattern = _compile(tuple(secrets))
        self._tail = b""
        self.count = 0

    def _sub(self, data: bytes) -> bytes:
        assert self._pattern is not None
        out, n = self._pattern.subn(MARK, data)
        self.count += n
        return out

    def _partial(self, data: bytes) -> int:
        """Length of the longest suffix of `data` that a secret form starts with."""
        best = 0
        for needle in self._needles:
            for k in range(min(len(needle) - 1, len(data)), best, -1):
                if needle.startswith(data[-k:]):
                    best = k
                    break
        return best

    def feed(self, chunk: bytes) -> bytes:
        """Redacted bytes that are safe to send now; b"" flushes the held-back tail."""
        if self._pattern is None:
            return chunk
        if not chunk:
            rest, self._tail = self._tail, b""
            return self._sub(rest)
        data = self._sub(self._tail + chunk)
        # Redacted output never re-forms a secret ([REDACTED] starts none), so holding back
        # only the unfinished tail is enough.
        hold = self._partial(data)
        emit, self._tail = data[: len(data) - hold], data[len(data) - hold :]
        return emit

    def whole(self, body: bytes) -> bytes:
        """Redact a complete body (nothing held back: there is no next chunk)."""
        if self._pattern is None or len(body) < len(self._needles[-1]):
            return body  # shorter than the shortest form of a secret
        return self._sub(body)

    def headers(self, fields: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[bytes, bytes], ...]:
        """Redact header values; a field whose name holds a secret is dropped (and counted).

        One search over every name and value decides; `fields` comes back as it is when it
        holds no secret, the usual case.
        """
        pattern = self._pattern
        if pattern is None or not pattern.search(b"\n".join(b"\n".join(f) for f in fields)):
            return fields
        kept = []
        for name, value in fields:
            if pattern.search(name):
                self.count += 1
            else:
                kept.append((name, self._sub(value)))
        return tuple(kept)


class Decoder:
    """Undo a response's Content-Encoding chunk by chunk, so redaction sees the plaintext."""

    def __init__(self, encoding: str) -> None:
        self._flush: Callable[[], bytes] = lambda: b""
        if encoding in ("gzip", "x-gzip", "deflate"):
            # 32 + 15: accept a gzip or zlib header.
            inflater = zlib.decompressobj(wbits=47)
            self._decode: Callable[[bytes], bytes] = inflater.decompress
            self._flush = inflater.flush
        elif encoding == "br":
            import brotli

            self._decode = brotli.Decompressor().process
        elif encoding == "zstd":
            import zstandard

            self._decode = zstandard.ZstdDecompressor().decompressobj().decompress
        else:
            raise ValueError(f"unsupported content-encoding {encoding!r}")

    def feed(self, chunk: bytes) -> bytes:
        """Decoded bytes; b"" flushes."""
        return self._decode(chunk) if chunk else self._flush()
