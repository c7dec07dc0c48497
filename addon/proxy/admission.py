"""Which client connections the proxy takes while they have not authenticated yet.

A connection is unauthenticated from accept until a CONNECT or a proxy request on it names a
valid token. Such connections are bounded per source address (an IPv6 one by its /64) and in
total, below `--max-connections`, so that an anonymous peer cannot take the places principals
need. When a bound is reached a newcomer is not simply refused: the oldest unauthenticated
connection of the address that holds the most makes room (the newcomer's own, if that is it),
so a peer flooding from one address only ever displaces its own connections. A connection
whose first bytes wait unread (one of a burst accepted together) is never the one: a bound
may be passed by a burst for as long as it takes the proxy to read it. Only when every
address holds one (the peer has as many addresses as the pool has places) is the newcomer
refused.
"""

from __future__ import annotations

import ipaddress
import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mitmproxy import connection

# Refusal and displacement reasons, named after the flag whose bound was reached.
MAX_CONNECTIONS = "max-connections"
MAX_UNAUTHENTICATED = "max-unauthenticated"
PER_ADDRESS = "max-unauthenticated-per-address"
# The audit line's detail, for a newcomer refused and for an older connection displaced.
REFUSED = {
    MAX_CONNECTIONS: "the proxy is at its connection cap",
    MAX_UNAUTHENTICATED: "the unauthenticated connections are at their cap, one per address",
}
DISPLACED = {
    PER_ADDRESS: "closed for a newer one: its address is at its cap of unauthenticated connections",
    MAX_UNAUTHENTICATED: "closed for a newer one: the unauthenticated connections are at their "
    "cap, and its address holds the most",
}


class Refused(Exception):
    """No place for a new connection; `bound` names the limit."""

    def __init__(self, bound: str) -> None:
        super().__init__(bound)
        self.bound = bound


def peer_key(client: connection.Client) -> str:
    """The source a connection is counted against: its IPv4 address, or its IPv6 /64."""
    host = client.peername[0] if client.peername else ""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Admission:
    """The unauthenticated connections by source, and who makes room for a newcomer."""

    def __init__(
        self,
        max_unauthenticated: int,
        per_address: int,
        authenticated: Callable[[connection.Client], bool],
        unread: Callable[[connection.Client], bool],
    ) -> None:
        self.max_unauthenticated = max_unauthenticated
        self.per_address = per_address
        # Asked before a connection is displaced: it may have authenticated in a hook that
        # is still waiting (a token mint), before the limits addon heard of it.
        self._authenticated = authenticated
        self._unread = unread  # bytes the proxy has not read yet wait on this connection
        # Weak, like all per-connection state: mitmproxy's lifecycle releases them.
        self.pending: weakref.WeakKeyDictionary[connection.Client, int] = (
            weakref.WeakKeyDictionary()
        )  # -> accept order
        self._by_source: dict[str, weakref.WeakSet[connection.Client]] = {}
        self._order = itertools.count()
        self.refused: dict[str, int] = defaultdict(int)
        self.displaced: dict[str, int] = defaultdict(int)

    def make_room(self, source: str) -> tuple[connection.Client, str] | None:
        """The connection to close so that one more from `source` fits, and which bound it
        makes room under; None when it fits as it is.

        Raises: Refused, when every source holds at most one.
        """
        mine = self._settled(source)
        if len(mine) >= self.per_address:
            return self._oldest(mine, PER_ADDRESS)
        if len(self.pending) < self.max_unauthenticated:
            return None
        heaviest = max(
            (s for s in list(self._by_source) if s != source),
            key=lambda s: len(self._by_source[s]),
            default=None,
        )
        theirs = self._settled(heaviest) if heaviest is not None else set()
        if len(self.pending) < self.max_unauthenticated:
            return None  # some of them had authenticated
        if len(theirs) > len(mine) + 1:
            return self._oldest(theirs, MAX_UNAUTHENTICATED)
        if mine:  # the newcomer's source is (one of) the heaviest: it pays
            return self._oldest(mine, MAX_UNAUTHENTICATED)
        raise Refused(MAX_UNAUTHENTICATED)

    def add(self, client: connection.Client, source: str) -> None:
        self.pending[client] = next(self._order)
        self._by_source.setdefault(source, weakref.WeakSet()).add(client)

    def remove(self, client: connection.Client, source: str) -> None:
        """`client` authenticated, or went: it counts no more (idempotent)."""
        if self.pending.pop(client, None) is None:
            return
        found = self._by_source.get(source)
        if found is not None:
            found.discard(client)
            if not found:
                del self._by_source[source]

    def is_pending(self, client: connection.Client) -> bool:
        return client in self.pending

    def _settled(self, source: str) -> set[connection.Client]:
        """`source`'s unauthenticated connections, after letting go of those that have
        authenticated meanwhile."""
        found = set(self._by_source.get(source, ()))
        for client in [c for c in found if self._authenticated(c)]:
            self.remove(client, source)
            found.discard(client)
        if not found:
            self._by_source.pop(source, None)  # emptied by the garbage collector, too
        return found

    def _oldest(
        self, clients: set[connection.Client], bound: str
    ) -> tuple[connection.Client, str] | None:
        """The oldest of `clients` the proxy has read from, to close under `bound`; None
        (the newcomer is let in over the bound) when every one has bytes waiting unread."""
        for client in sorted(clients, key=lambda c: self.pending.get(c, -1)):
            if not self._unread(client):
                return client, bound
        return None
