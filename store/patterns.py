"""The grammar of what operators write: names, host patterns, methods, path patterns, expiry.

Everything here parses once into frozen values; the proxy trusts them afterwards.
"""

from __future__ import annotations

import ipaddress
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache

from publicsuffix2 import PSL_FILE, PublicSuffixList

from store.errors import InvalidInput

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_LABEL_RE = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_METHOD_RE = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_HEADER_RE = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
_PARAM_RE = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_PCHAR = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,=:@")
_HEX_RE = re.compile(r"0x[0-9a-f]*")
_DURATION_RE = re.compile(r"([1-9][0-9]{0,8})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# Headers a credential may never be written into: hop-by-hop, framing, or routing.
_FORBIDDEN_HEADERS = frozenset(
    {
        "host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
        "trailer", "keep-alive", "proxy-authorization", "proxy-authenticate", "cookie",
    }
)


def validate_name(kind: str, name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidInput(f"invalid {kind} name {name!r}: use [a-z0-9][a-z0-9._-]{{0,62}}")
    return name


@cache
def _suffix_rules() -> dict[str, list[str]]:
    """The public suffix list's rules by their last label, IDNA-encoded as host names are."""
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


@cache
def _suffix_list(tld: str) -> PublicSuffixList:
    return PublicSuffixList(_suffix_rules().get(tld, []))


def _is_public_suffix(domain: str) -> bool:
    """Does the public suffix list make `domain` (lower-case, punycode) a public suffix?

    A lookup only reads the rules under the domain's last label, so only those are loaded:
    the whole list takes 0.1 s, most of it IDNA-encoding rules of other TLDs.
    """
    tld = domain.rpartition(".")[2]
    # Unknown TLDs share the empty list (only the implicit "*" rule), so the cache stays
    # bounded whatever names arrive.
    suffix: str | None = _suffix_list(tld if tld in _suffix_rules() else "").get_tld(domain)
    return suffix == domain


def _is_ip(host: str) -> bool:
    if ":" not in host and not host.replace(".", "").isdigit():
        return False  # neither IPv6 nor dotted decimal: spares ipaddress's exception
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
        """`host` must already be lower-case, as the proxy's host binding makes it."""
        if port != (self.port if self.port is not None else default_port):
            return False
        if self.wildcard:
            suffix = self.host[1:]
            return host.endswith(suffix) and "." not in host[: -len(suffix)] and len(host) > len(
                suffix
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
    port: int | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise InvalidInput(f"invalid host {spec!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if not _is_ip(host) or ":" not in host:
            raise InvalidInput(f"invalid host {spec!r}: brackets are for IPv6 addresses")
        host = str(ipaddress.ip_address(host))
        if rest:
            if not rest.startswith(":"):
                raise InvalidInput(f"invalid host {spec!r}")
            port = _parse_port(spec, rest[1:])
        return HostPattern(host, port)
    if text.count(":") == 1:
        text, port_text = text.split(":")
        port = _parse_port(spec, port_text)
    elif ":" in text:
        raise InvalidInput(f"invalid host {spec!r}: write IPv6 addresses as [addr]:port")
    if text != text.lower():
        raise InvalidInput(f"invalid host {spec!r}: write host names in lower case")
    if _is_ip(text):
        if str(ipaddress.ip_address(text)) != text:
            raise InvalidInput(f"invalid host {spec!r}: write IP addresses in canonical form")
        return HostPattern(text, port)
    if not text.isascii():
        raise InvalidInput(f"invalid host {spec!r}: use the punycode (xn--) form")
    wildcard = text.startswith("*.")
    labels = (text[2:] if wildcard else text).split(".")
    if len(text) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        raise InvalidInput(f"invalid host {spec!r}")
    # What URL parsers read as IPv4 ("ends in a number", decimal or 0x-hex) is no host name.
    if labels[-1].isdigit() or _HEX_RE.fullmatch(labels[-1]):
        raise InvalidInput(f"invalid host {spec!r}: not a host name nor a canonical IP address")
    if wildcard:
        base = text[2:]
        if len(labels) < 2 or _is_public_suffix(base):
            raise InvalidInput(f"invalid host {spec!r}: a wildcard may not cover a public suffix")
    return HostPattern(text, port)


def _parse_port(spec: str, text: str) -> int:
    if not text.isdigit() or text.startswith("0") or not 0 < int(text) < 65536:
        raise InvalidInput(f"invalid port in {spec!r}")
    return int(text)


def validate_method(method: str) -> str:
    if method == "*":
        return method
    if not _METHOD_RE.fullmatch(method):
        hint = f"; methods are case-sensitive, did you mean {method.upper()!r}?" if (
            _METHOD_RE.fullmatch(method.upper())
        ) else ""
        raise InvalidInput(f"invalid method {method!r}{hint}")
    return method


def validate_path_pattern(pattern: str) -> str:
    """Segment-bounded prefix; `*` stands for exactly one segment; a trailing `/` means below."""
    if not pattern.startswith("/"):
        raise InvalidInput(f"invalid path pattern {pattern!r}: must start with '/'")
    if pattern == "/":
        return pattern
    segments = pattern[1:].split("/")
    if segments[-1] == "":
        segments.pop()
    for segment in segments:
        if segment in ("", ".", ".."):
            raise InvalidInput(f"invalid path pattern {pattern!r}: empty or dot segment")
        if "*" in segment and segment != "*":
            raise InvalidInput(f"invalid path pattern {pattern!r}: '*' must be a whole segment")
        if not set(segment) <= _PCHAR or ";" in segment:
            raise InvalidInput(
                f"invalid path pattern {pattern!r}: only unencoded path characters are allowed"
            )
    return pattern


def validate_header_name(name: str) -> str:
    if not _HEADER_RE.fullmatch(name) or name.lower() in _FORBIDDEN_HEADERS:
        raise InvalidInput(f"invalid or forbidden header name {name!r}")
    return name


def validate_param_name(name: str) -> str:
    if not _PARAM_RE.fullmatch(name):
        raise InvalidInput(f"invalid query parameter name {name!r}")
    return name


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """`30s`, `10m`, `2h`, `7d` from now, or an ISO-8601 instant (naive means UTC)."""
    now = now or datetime.now(UTC)
    m = _DURATION_RE.fullmatch(text)
    if m:
        try:
            return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
        except OverflowError as e:
            raise InvalidInput(f"invalid --expires {text!r}: too far away") from e
    try:
        when = datetime.fromisoformat(text)
    except ValueError as e:
        raise InvalidInput(f"invalid --expires {text!r}: use 30s, 10m, 2h, 7d or ISO-8601") from e
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when <= now:
        raise InvalidInput(f"invalid --expires {text!r}: it is in the past")
    try:
        return when.astimezone(UTC)
    except OverflowError as e:  # a time zone that pushes it past the year 9999
        raise InvalidInput(f"invalid --expires {text!r}: too far away") from e
