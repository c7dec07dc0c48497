"""The destination guard: only global unicast addresses, unless the operator opens a range."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
# Deprecated forms Python still calls global. A translator or an old stack on the path could
# route them to the IPv4 address they carry, loopback included; no public service uses them.
_CARRY_IPV4 = (
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (RFC 4291 deprecated it)
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT, RFC 2765)
)
_NEVER_PUBLIC = (*_CARRY_IPV4, ipaddress.IPv6Network("fec0::/10"))  # site-local (RFC 3879)


def _embedded(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, NAT64, 6to4, Teredo)."""
    found = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if any(address in net for net in _NAT64):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    return found


def reachable(address: IPAddress) -> list[IPAddress]:
    """The address and every IPv4 address a dual-stack or translating path may take it to."""
    found: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        found.extend(_embedded(address))
        if any(address in net for net in _CARRY_IPV4):
            found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def is_public(address: IPAddress) -> bool:
    """Global unicast, and so is every IPv4 address it embeds."""
    if not address.is_global or address.is_multicast or address.is_unspecified:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        if any(address in net for net in _NEVER_PUBLIC):
            return False
        if any(address in net for net in _NAT64) or address.sixtofour or address.teredo:
            return all(is_public(v4) for v4 in _embedded(address))
    return True


@dataclass(frozen=True)
class DestinationGuard:
    """`--allow-private` ranges and the proxy's own addresses, parsed once at start."""

    allowed: tuple[IPNetwork, ...] = ()
    # The proxy's own listening sockets; None stands for every address (0.0.0.0, ::).
    own: frozenset[tuple[IPAddress | None, int]] = frozenset()

    @classmethod
    def parse(cls, cidrs: Iterable[str]) -> DestinationGuard:
        allowed = []
        for cidr in cidrs:
            try:
                allowed.append(ipaddress.ip_network(cidr, strict=False))
            except ValueError as e:
                raise ValueError(f"invalid --allow-private {cidr!r}: not a CIDR range") from e
        return cls(tuple(allowed))

    def listening_on(self, addresses: Iterable[tuple[str, int]]) -> DestinationGuard:
        own: set[tuple[IPAddress | None, int]] = set()
        for host, port in addresses:
            address = ipaddress.ip_address(host.split("%", 1)[0])
            if address.is_unspecified:
                own.add((None, port))
            else:
                own.update((a, port) for a in reachable(address))
        return DestinationGuard(self.allowed, frozenset(own))

    def permits(self, address: IPAddress, port: int) -> bool:
        if self._is_own(address, port):
            return False
        if any(address.version == net.version and address in net for net in self.allowed):
            return True
        return is_public(address)

    def _is_own(self, address: IPAddress, port: int) -> bool:
        """Could a connection to `address` reach one of the proxy's own listeners?"""
        if address.is_unspecified:
            # Linux connects 0.0.0.0 and :: to the local host: any listener on the port.
            return any(own_port == port for _, own_port in self.own)
        wildcard = (None, port) in self.own
        return any(
            (a, port) in self.own or (wildcard and not is_public(a)) for a in reachable(address)
        )

    def vet(self, answers: Iterable[str], port: int) -> IPAddress | None:
        """The address to dial, or None when any answer is forbidden (or there is none)."""
        addresses = []
        for text in answers:
            try:
                addresses.append(ipaddress.ip_address(text.split("%", 1)[0]))
            except ValueError:
                return None
        if not addresses or not all(self.permits(a, port) for a in addresses):
            return None
        return addresses[0]
