"""The one grammar of names, hosts, authorities, methods and paths, for the CLI and the proxy.

What operators write (`parse_host`, `validate_*`, `parse_expiry`) must already be canonical
and parses once into frozen values. What arrives on the wire (`parse_authority`,
`normalize_host`, `canonicalize`) is normalised, or refused when two readers could disagree
about it. Both read hosts, IP literals, ports and path characters by the same rules below.
Pure: no mitmproxy, no SQLAlchemy.

One module, about 600 lines, on purpose: one grammar, so that what an operator writes and
what arrives on the wire can never be read by two diverging parsers.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import unicodedata
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from store.errors import InvalidInput

if TYPE_CHECKING:
    # The public suffix list is loaded on the first wildcard check, not at import.
    from publicsuffix2 import PublicSuffixList

# -- Names, methods, header and parameter names ----------------------------------------

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_METHOD_RE = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_HEADER_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
_PARAM_RE = re.compile(r"[A-Za-z0-9._~-]{1,64}")
# Headers a credential may never be written into: hop-by-hop, framing, or routing.
_FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "cookie",
    }
)


def validate_name(kind: str, name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidInput(f"invalid {kind} name {name!r}: use [a-z0-9][a-z0-9._-]{{0,62}}")
    return name


def validate_method(method: str) -> str:
    if method == "*":
        return method
    if not _METHOD_RE.fullmatch(method):
        hint = (
            f"; methods are case-sensitive, did you mean {method.upper()!r}?"
            if (_METHOD_RE.fullmatch(method.upper()))
            else ""
        )
        raise InvalidInput(f"invalid method {method!r}{hint}")
    return method


# IANA's HTTP Method Registry, less PRI (HTTP/2's connection preface, never a request).
REGISTERED_METHODS = frozenset(
    "ACL BASELINE-CONTROL BIND CHECKIN CHECKOUT CONNECT COPY DELETE GET HEAD LABEL LINK LOCK "
    "MERGE MKACTIVITY MKCALENDAR MKCOL MKREDIRECTREF MKWORKSPACE MOVE OPTIONS ORDERPATCH PATCH "
    "POST PROPFIND PROPPATCH PUT QUERY REBIND REPORT SEARCH TRACE UNBIND UNCHECKOUT UNLINK "
    "UNLOCK UPDATE UPDATEREDIRECTREF VERSION-CONTROL".split()
)


def check_registered_method(method: str) -> None:
    """Refuse a well-formed method outside the registry, naming the nearest registered one."""
    if method == "*" or method in REGISTERED_METHODS or not _METHOD_RE.fullmatch(method):
        return  # validate_method words a malformed one
    import difflib  # only here: the CLI's quick commands import this module

    near = difflib.get_close_matches(method, sorted(REGISTERED_METHODS), n=1, cutoff=0.6)
    hint = f": did you mean {near[0]!r}?" if near else ""
    raise InvalidInput(
        f"method {method!r} is not a registered HTTP method{hint} "
        "({extension_method} allows others)",
        extension_method="extension_method",
    )


def validate_header_name(name: str) -> str:
    if not _HEADER_RE.fullmatch(name) or name.lower() in _FORBIDDEN_HEADERS:
        raise InvalidInput(f"invalid or forbidden header name {name!r}")
    return name


def validate_param_name(name: str) -> str:
    if not _PARAM_RE.fullmatch(name):
        raise InvalidInput(f"invalid query parameter name {name!r}")
    return name


# -- IP literals, host names, ports -------------------------------------------------------


class BadAuthority(ValueError):
    """A host, port or authority the proxy refuses; the message is a fixed phrase."""


# A lower-case DNS name: labels of 1 to 63 letters, digits and inner hyphens.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
# What URL parsers read as IPv4 ("ends in a number", decimal or 0x-hex) is no host name.
_HEX_RE = re.compile(r"0x[0-9a-f]*")


def is_ip(text: str) -> bool:
    """Is `text` an IPv4 or (bracket-less) IPv6 literal that `ipaddress` reads?"""
    if ":" not in text and not text.replace(".", "").isdigit():
        return False  # neither IPv6 nor dotted decimal: spares ipaddress's exception
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _port(text: str) -> int | None:
    """A port as written after the colon: 1 to 65535 in ASCII digits, no leading zero."""
    if not (0 < len(text) <= 5 and text.isascii() and text.isdigit()) or text[0] == "0":
        return None
    port = int(text)
    return port if port < 65536 else None


def _split_authority(text: str) -> tuple[str, str, bool]:
    """`host[:port]` or `[v6][:port]` -> (host, what follows it, whether it was bracketed)."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadAuthority("unclosed bracket")
        return text[1:end], text[end + 1 :], True
    if text.count(":") > 1:
        raise BadAuthority("unbracketed IPv6")
    host, sep, port_text = text.partition(":")
    return host, sep + port_text, False


# -- Authorities as they arrive (Host headers, CONNECT targets, SNI) ----------------------


def normalize_host(host: str) -> str:
    """Lower-case a host name or bracket-less IPv6 literal; raise BadAuthority if malformed."""
    if ":" in host:
        try:
            return str(ipaddress.IPv6Address(host.lower()))
        except ValueError as e:
            raise BadAuthority("invalid IPv6 literal") from e
    # ASCII first: str.lower() folds U+212A KELVIN SIGN into 'k'.
    lowered = host.lower()
    if not host.isascii() or len(lowered) > 253 or not _HOST_NAME_RE.fullmatch(lowered):
        raise BadAuthority("invalid host name")
    return lowered


def parse_authority(text: str) -> tuple[str, int | None]:
    """`host`, `host:port` or `[v6]:port` -> (normalized host, port or None)."""
    if "@" in text:
        raise BadAuthority("userinfo in authority")
    host, rest, bracketed = _split_authority(text)
    if bracketed and ":" not in host:
        raise BadAuthority("brackets without IPv6")
    port: int | None = None
    if rest:
        port = _port(rest[1:]) if rest.startswith(":") else None
        if port is None:
            raise BadAuthority("invalid port")
    return normalize_host(host), port


# -- Host patterns, as operators write them -----------------------------------------------


@functools.cache
def _suffix_rules() -> dict[str, list[str]]:
    """The public suffix list's rules by their last label, IDNA-encoded as host names are."""
    # Imported here: publicsuffix2 brings urllib.request with it, a noticeable part of a CLI
    # call that checks no wildcard host.
    from publicsuffix2 import PSL_FILE

    with open(PSL_FILE, encoding="utf-8") as f:
        rules = [rule for rule in map(str.strip, f) if rule and not rule.startswith("//")]
    encoded = {
        label: label if label.isascii() else label.encode("idna").decode()
        for label in {rule.rpartition(".")[2] for rule in rules}
    }
    by_tld: dict[str, list[str]] = defaultdict(list)
    for rule in rules:
        by_tld[encoded[rule.rpartition(".")[2]]].append(rule)
    return dict(by_tld)


@functools.cache
def _suffix_list(tld: str) -> PublicSuffixList:
    from publicsuffix2 import PublicSuffixList

    return PublicSuffixList(_suffix_rules().get(tld, []))


def _is_public_suffix(domain: str) -> bool:
    """Does the public suffix list make `domain` (lower-case, punycode) a public suffix?

    A lookup only reads the rules under the domain's last label, so only those are loaded:
    IDNA-encoding the rules of every other TLD is most of the cost of the whole list.
    """
    tld = domain.rpartition(".")[2]
    # Unknown TLDs share the empty list (only the implicit "*" rule), so the cache stays
    # bounded whatever names arrive.
    suffix: str | None = _suffix_list(tld if tld in _suffix_rules() else "").get_tld(domain)
    return suffix == domain


@dataclass(frozen=True)
class HostPattern:
    """`api.example.com`, `*.example.com` (exactly one more label), `[::1]`, with an optional port.

    A pattern without a port stands for the scheme's default port (443 for https, 80 for http).
    """

    host: str
    port: int | None = None

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches(self, host: str, port: int, default_port: int) -> bool:
        """`host` must already be normalised, as `normalize_host` makes it."""
        if port != (self.port if self.port is not None else default_port):
            return False
        if self.wildcard:
            suffix = self.host[1:]
            return (
                host.endswith(suffix)
                and "." not in host[: -len(suffix)]
                and len(host) > len(suffix)
            )
        return host == self.host

    def covers(self, other: HostPattern) -> bool:
        """Is every host:port `other` can match also matched by self (on https)?"""
        if (self.port or 443) != (other.port or 443):
            return False
        if self.wildcard:
            return other.host == self.host or self.matches(other.host, other.port or 443, 443)
        return other.host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def parse_host(spec: str) -> HostPattern:
    """Parse `host[:port]`; raise InvalidInput with a one-line reason."""
    text = spec.strip()
    if "/" in text:
        shown = re.sub(r"//[^/]*@", "//", text)  # no userinfo, password and all
        raise InvalidInput(f"invalid host {shown!r}: {_host_of_url(text)}")
    try:
        host, rest, bracketed = _split_authority(text)
    except BadAuthority as e:
        hint = "unclosed '['" if text.startswith("[") else "write IPv6 addresses as [addr]:port"
        raise InvalidInput(f"invalid host {spec!r}: {hint}") from e
    if bracketed:
        try:
            # The proxy's own reading of an IPv6 literal, so that the two compare equal.
            ipv6 = normalize_host(host) if ":" in host else ""
        except BadAuthority:
            ipv6 = ""
        if not ipv6:
            raise InvalidInput(f"invalid host {spec!r}: brackets are for IPv6 addresses")
        if rest and not rest.startswith(":"):
            raise InvalidInput(f"invalid host {spec!r}")
        return HostPattern(ipv6, _pattern_port(spec, rest))
    port = _pattern_port(spec, rest)
    if host != host.lower():
        raise InvalidInput(f"invalid host {spec!r}: write host names in lower case")
    if is_ip(host):
        if str(ipaddress.ip_address(host)) != host:
            raise InvalidInput(f"invalid host {spec!r}: write IP addresses in canonical form")
        return HostPattern(host, port)
    if not host.isascii():
        raise InvalidInput(f"invalid host {spec!r}: use the punycode (xn--) form")
    wildcard = host.startswith("*.")
    base = host[2:] if wildcard else host
    if len(host) > 253 or not _HOST_NAME_RE.fullmatch(base):
        raise InvalidInput(f"invalid host {spec!r}")
    tld = base.rpartition(".")[2]
    if tld.isdigit() or _HEX_RE.fullmatch(tld):
        raise InvalidInput(f"invalid host {spec!r}: not a host name nor a canonical IP address")
    if wildcard and ("." not in base or _is_public_suffix(base)):
        raise InvalidInput(f"invalid host {spec!r}: a wildcard may not cover a public suffix")
    return HostPattern(host, port)


def _host_of_url(text: str) -> str:
    """What to say to a URL or path given where a host pattern goes."""
    _, sep, rest = text.partition("://")
    authority = (rest if sep else text).split("/", 1)[0].rpartition("@")[2]
    if not authority:
        return "a host is expected (HOST or HOST:PORT), not a URL or a path"
    return f"a host is expected, not a URL: use {authority.lower()}"


def _pattern_port(spec: str, rest: str) -> int | None:
    """The port after a pattern's host: `rest` is empty or starts with ':'."""
    if not rest:
        return None
    port = _port(rest[1:])
    if port is None:
        raise InvalidInput(f"invalid port in {spec!r}")
    return port


# -- Paths: RFC 3986 pchar, canonical request paths, grant path patterns -----------------

_ALPHANUMERIC = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# RFC 3986 pchar without pct-encoded and without ';' (a matrix parameter to some servers).
PCHAR = _ALPHANUMERIC + "-._~!$&'()*+,=:@"
_PCHAR_CHARS = frozenset(PCHAR)
# Bytes, for bytes.translate(None, delete).
_PCHAR = PCHAR.encode("ascii")
_PCHAR_SET = frozenset(_PCHAR)
_PCHAR_SLASH = _PCHAR + b"/"
_UNRESERVED = frozenset((_ALPHANUMERIC + "-._~").encode("ascii"))
_HEX = frozenset(b"0123456789ABCDEFabcdef")
_CONTROLS = bytes(range(0x20)) + b"\x7f"
# An escape of these is refused, not kept: a backend that decodes before routing would see a
# separator, a matrix parameter or a control character the grant check never saw. An encoded
# slash is kept (npm's `@scope%2Fname`, GitLab's `group%2Fproject`), but only between parts
# that are names: a decoding backend then sees no empty or dot segment the canonical path hid.
_REFUSED_ESCAPES = frozenset(_CONTROLS + b"\\;")
ENCODED_SLASH = "%2F"
_DOT_OR_EMPTY = (b"", b".", b"..")
# After the escape of a literal '%', two hex digits re-form an escape for a second decoder.
_DOUBLE_ENCODED = re.compile(r"%25[0-9A-Fa-f]{2}")
_PATTERN_SLASH = re.compile("%2F", re.IGNORECASE)
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
        "empty or dot part around an encoded slash",
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

    A target that two parsers could read as two different paths is refused, never repaired:
    the upstream must see exactly the path the grant was checked against.

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
    # `decoded` holds the slash itself: a backend that decodes %2F reads these parts as
    # segments, so `a%2F..` or `a%2F%2Fb` would be a dot or empty segment to it.
    if 0x2F in decoded and any(part in _DOT_OR_EMPTY for part in decoded.split(b"/")):
        raise BadPath("empty or dot part around an encoded slash")
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


def validate_path_pattern(pattern: str) -> str:
    """Segment-bounded prefix; `*` stands for exactly one segment; a trailing `/` means below.

    Plain pchar and `%2F` between two names: every pattern is its own canonical path (with `*`
    read as a segment). Returns the pattern with `%2f` written `%2F`, as canonicalize does.
    """
    if not pattern.startswith("/"):
        raise InvalidInput(f"invalid path pattern {pattern!r}: must start with '/'")
    if pattern == "/":
        return pattern
    segments = pattern[1:].split("/")
    below = segments[-1] == ""
    if below:
        segments.pop()
    for index, segment in enumerate(segments):
        if segment in ("", ".", ".."):
            raise InvalidInput(f"invalid path pattern {pattern!r}: empty or dot segment")
        if segment == "**":
            below_here = "/" + "".join(s + "/" for s in segments[:index])
            instead = f" ({below_here!r})" if index == len(segments) - 1 and not below else ""
            raise InvalidInput(
                f"invalid path pattern {pattern!r}: '**' is not supported: a trailing '/' "
                f"matches everything below{instead}, '*' one whole segment"
            )
        if "*" in segment and segment != "*":
            raise InvalidInput(f"invalid path pattern {pattern!r}: '*' must be a whole segment")
        parts = _PATTERN_SLASH.split(segment)
        if len(parts) > 1 and any(part in ("", ".", "..") for part in parts):
            raise InvalidInput(f"invalid path pattern {pattern!r}: %2F must sit between two names")
        if not all(map(_PCHAR_CHARS.issuperset, parts)):
            raise InvalidInput(
                f"invalid path pattern {pattern!r}: only unencoded path characters "
                "and %2F are allowed"
            )
        segments[index] = ENCODED_SLASH.join(parts)
    return "/" + "/".join(segments) + ("/" if below else "")


def has_star(pattern: str) -> bool:
    """Does the path pattern hold a `*` segment?"""
    return "*" in pattern.split("/")


def path_matches(pattern: str, path: str, encoded_slash: bool = False) -> bool:
    """Does canonical `path` fall under grant path `pattern`?

    A pattern matches itself and everything below it, segment by segment; with a trailing '/'
    only what is below it. A '*' segment matches exactly one non-empty segment, and one that
    holds an encoded slash only with `encoded_slash`: to a backend that decodes %2F it is
    several segments.
    """
    if "*" not in pattern:
        if pattern.endswith("/"):
            return path.startswith(pattern)
        return path.startswith(pattern) and (len(path) == len(pattern) or path[len(pattern)] == "/")
    wanted, below = _split_pattern(pattern)
    got = path.split("/")[1:]
    if len(got) < len(wanted) + below:
        return False
    return all(
        w == g or (w == "*" and g != "" and (encoded_slash or ENCODED_SLASH not in g))
        for w, g in zip(wanted, got, strict=False)
    )


@functools.lru_cache(maxsize=4096)
def _split_pattern(pattern: str) -> tuple[tuple[str, ...], bool]:
    """Pattern -> (its segments, whether it ends in '/' and so matches only what is below)."""
    return tuple(pattern.strip("/").split("/")), pattern.endswith("/")


# -- Expiry ---------------------------------------------------------------------------

_DURATION_RE = re.compile(r"([1-9][0-9]{0,8})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """`30s`, `10m`, `2h`, `7d` from now, or an ISO-8601 instant (naive means UTC)."""
    now = now or datetime.now(UTC)
    m = _DURATION_RE.fullmatch(text)
    if m:
        try:
            return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
        except OverflowError as e:
            raise InvalidInput(
                "invalid {expires} {text!r}: too far away", expires="expiry", text=text
            ) from e
    try:
        when = datetime.fromisoformat(text)
    except ValueError as e:
        raise InvalidInput(
            "invalid {expires} {text!r}: use 30s, 10m, 2h, 7d or ISO-8601",
            expires="expiry",
            text=text,
        ) from e
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when <= now:
        raise InvalidInput(
            "invalid {expires} {text!r}: it is in the past", expires="expiry", text=text
        )
    try:
        return when.astimezone(UTC)
    except OverflowError as e:  # a time zone that pushes it past the year 9999
        raise InvalidInput(
            "invalid {expires} {text!r}: too far away", expires="expiry", text=text
        ) from e


_RATE_RE = re.compile(r"([1-9][0-9]{0,8})/([smhd])")
_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Rate:
    """`count` requests per `period` seconds, as written (`60/m`)."""

    count: int
    period: float
    text: str

    @property
    def per_second(self) -> float:
        return self.count / self.period


def parse_rate(text: str) -> Rate:
    m = _RATE_RE.fullmatch(text)
    if not m:
        raise InvalidInput(
            "invalid {rate} {text!r}: use N/s, N/m, N/h or N/d, e.g. 60/m", rate="rate", text=text
        )
    return Rate(int(m.group(1)), _PERIODS[m.group(2)], text)
