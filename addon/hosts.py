"""Authorities as they arrive (Host headers, CONNECT targets, SNI) and the --resolve map."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# A DNS name or an IPv4 literal in dotted form; anything else in a Host header is refused.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


class BadAuthority(ValueError):
    pass


def normalize_host(host: str) -> str:
    """Lower-case a host name or bracket-less IPv6 literal; raise BadAuthority if malformed."""
    lowered = host.lower()
    if ":" in lowered:
        try:
            return str(ipaddress.IPv6Address(lowered))
        except ValueError as e:
            raise BadAuthority("invalid IPv6 literal") from e
    if len(lowered) > 253 or not _HOST_RE.fullmatch(lowered):
        raise BadAuthority("invalid host name")
    return lowered


def parse_authority(text: str) -> tuple[str, int | None]:
    """`host`, `host:port` or `[v6]:port` -> (normalized host, port or None)."""
    if "@" in text:
        raise BadAuthority("userinfo in authority")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadAuthority("unclosed bracket")
        host, rest = text[1:end], text[end + 1 :]
        if ":" not in host:
            raise BadAuthority("brackets without IPv6")
    elif text.count(":") > 1:
        raise BadAuthority("unbracketed IPv6")
    else:
        host, sep, port_text = text.partition(":")
        rest = sep + port_text
    port: int | None = None
    if rest:
        if not rest.startswith(":") or not rest[1:].isdigit() or rest[1:2] == "0":
            raise BadAuthority("invalid port")
        port = int(rest[1:])
        if not 0 < port < 65536:
            raise BadAuthority("invalid port")
    return normalize_host(host), port


@dataclass(frozen=True)
class Target:
    address: str
    port: int | None


class ResolveMap:
    """`--resolve NAME[:PORT]=ADDRESS[:PORT]`: where to dial a name; SNI and Host keep the name."""

    def __init__(self, entries: dict[tuple[str, int | None], Target]) -> None:
        self._entries = entries

    @classmethod
    def parse(cls, specs: list[str]) -> ResolveMap:
        entries: dict[tuple[str, int | None], Target] = {}
        for spec in specs:
            name_part, sep, target_part = spec.partition("=")
            if not sep:
                raise ValueError(f"invalid --resolve {spec!r}: use NAME[:PORT]=ADDRESS[:PORT]")
            try:
                name, port = parse_authority(name_part)
                address, target_port = parse_authority(target_part)
            except BadAuthority as e:
                raise ValueError(f"invalid --resolve {spec!r}: {e}") from e
            entries[(name, port)] = Target(address, target_port)
        return cls(entries)

    def lookup(self, host: str, port: int) -> tuple[str, int] | None:
        target = self._entries.get((host, port)) or self._entries.get((host, None))
        if target is None:
            return None
        return target.address, target.port or port

    def __bool__(self) -> bool:
        return bool(self._entries)
