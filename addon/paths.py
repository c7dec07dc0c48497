"""Canonical request paths, and grant path patterns matched against them.

A target that two parsers could read as two different paths is refused, never repaired: the
upstream must see exactly the path the grant was checked against. Pure: stdlib only.
"""

import functools
import re
import unicodedata

_ALPHANUMERIC = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_UNRESERVED = frozenset(_ALPHANUMERIC + b"-._~")
# RFC 3986 pchar without pct-encoded; bytes, for bytes.translate(None, delete).
_PCHAR = _ALPHANUMERIC + b"-._~!$&'()*+,=:@"
_PCHAR_SET = frozenset(_PCHAR)
_PCHAR_SLASH = _PCHAR + b"/"
_HEX = frozenset(b"0123456789ABCDEFabcdef")
_CONTROLS = bytes(range(0x20)) + b"\x7f"
# An escape of these is refused, not kept: a backend that decodes before routing would see a
# separator, a matrix parameter or a control character the grant check never saw.
_REFUSED_ESCAPES = frozenset(_CONTROLS + b"/\\;")
# After the escape of a literal '%', two hex digits re-form an escape for a second decoder.
_DOUBLE_ENCODED = re.compile(r"%25[0-9A-Fa-f]{2}")
# Non-ASCII characters that NFKC folds into one of these could be turned into structure by a
# normalising upstream (U+FF0E FULLWIDTH FULL STOP becomes '.').
_FOLDS_TO_STRUCTURE = frozenset("./\\;%?#")

DETAILS = frozenset(
    {
        "not origin-form",
        "fragment",
        "control character",
        "invalid character",
        "invalid escape",
        "encoded slash",
        "backslash",
        "matrix parameter",
        "double encoding",
        "invalid utf-8",
        "confusable character",
        "empty segment",
        "dot segment above root",
    }
)


class BadPath(ValueError):
    """A request target that is refused; .detail is a fixed phrase, never echoing the input."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def canonicalize(target: bytes) -> tuple[str, bytes | None]:
    """Origin-form request target -> (canonical path, raw query bytes after '?' or None).

    Raises:
        BadPath: with one of DETAILS.
    """
    if not target.startswith(b"/"):
        raise BadPath("not origin-form")
    if b"#" in target:
        raise BadPath("fragment")
    raw_path, question, raw_query = target.partition(b"?")
    query = raw_query if question else None
    if query is not None and len(query.translate(None, _CONTROLS + b" ")) != len(query):
        raise BadPath("control character")
    if (
        not raw_path.translate(None, _PCHAR_SLASH)
        and b"/." not in raw_path
        and b"//" not in raw_path
    ):
        # Already canonical: plain characters, no escapes, no dot or empty segments.
        return raw_path.decode("ascii"), query
    return _canonical_path(raw_path), query


def _canonical_path(raw_path: bytes) -> str:
    raw_segments = raw_path.split(b"/")[1:]
    last = len(raw_segments) - 1
    kept: list[str] = []
    segment = ""
    for index, raw in enumerate(raw_segments):
        segment = _segment(raw)
        if segment == "..":
            if not kept:
                raise BadPath("dot segment above root")
            kept.pop()
        elif segment == ".":
            pass
        elif segment:
            kept.append(segment)
        elif index != last:
            raise BadPath("empty segment")
    path = "/" + "/".join(kept)
    # RFC 3986 remove_dot_segments: '/a/b/..' is '/a/', a directory, not '/a'.
    if kept and segment in ("", ".", ".."):
        path += "/"
    return path


def _segment(raw: bytes) -> str:
    """One raw segment -> its canonical form: unreserved escapes decoded, others upper-cased."""
    if b"%" not in raw and not raw.translate(None, _PCHAR):
        return raw.decode("ascii")
    parts: list[str] = []
    decoded = bytearray()
    index = 0
    while index < len(raw):
        byte = raw[index]
        if byte in _PCHAR_SET:
            parts.append(chr(byte))
            decoded.append(byte)
            index += 1
            continue
        if byte != 0x25:
            raise BadPath(_raw_refusal(byte))
        pair = raw[index + 1 : index + 3]
        if len(pair) != 2 or not _HEX.issuperset(pair):
            raise BadPath("invalid escape")
        value = int(pair, 16)
        if value in _UNRESERVED:
            parts.append(chr(value))
        elif value == 0x2F:
            raise BadPath("encoded slash")
        elif value in _REFUSED_ESCAPES:
            raise BadPath(_raw_refusal(value))
        else:
            parts.append(f"%{value:02X}")
        decoded.append(value)
        index += 3
    segment = "".join(parts)
    # Checked on the result, so '%25%32%65' is caught as surely as '%252e'.
    if _DOUBLE_ENCODED.search(segment):
        raise BadPath("double encoding")
    if not decoded.isascii():
        try:
            text = decoded.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadPath("invalid utf-8") from e
        if any(_folds_to_structure(char) for char in text if not char.isascii()):
            raise BadPath("confusable character")
    return segment


def _raw_refusal(byte: int) -> str:
    if byte == 0x3B:
        return "matrix parameter"
    if byte == 0x5C:
        return "backslash"
    if byte <= 0x20 or byte == 0x7F:
        return "control character"
    return "invalid character"


def _folds_to_structure(char: str) -> bool:
    folded = unicodedata.normalize("NFKC", char)
    return any(c in _FOLDS_TO_STRUCTURE or c < " " or c == "\x7f" for c in folded)


def path_matches(pattern: str, path: str) -> bool:
    """Does canonical `path` fall under grant path `pattern`?

    A pattern matches itself and everything below it, segment by segment; with a trailing '/'
    only what is below it. A '*' segment matches exactly one non-empty segment.
    """
    if "*" not in pattern:
        if pattern.endswith("/"):
            return path.startswith(pattern)
        return path.startswith(pattern) and (len(path) == len(pattern) or path[len(pattern)] == "/")
    wanted, below = _split_pattern(pattern)
    got = path.split("/")[1:]
    if len(got) < len(wanted) + below:
        return False
    return all(w == g or (w == "*" and g != "") for w, g in zip(wanted, got, strict=False))


@functools.lru_cache(maxsize=4096)
def _split_pattern(pattern: str) -> tuple[tuple[str, ...], bool]:
    """Pattern -> (its segments, whether it ends in '/' and so matches only what is below)."""
    return tuple(pattern.strip("/").split("/")), pattern.endswith("/")
