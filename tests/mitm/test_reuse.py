"""The pool of parked upstream connections and the key that keeps principals apart.

Real loopback sockets; tests/e2e/test_reuse.py runs it behind the real proxy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from addon.core.verdict import Tunnel
from addon.mitm.reuse import Pool, Reuse, offers
from addon.proxy.state import Clients, ClientState

KEY = ("agent", "api.test", ("127.0.0.1", 443), (b"http/1.1",))
OTHER = ("other-agent", "api.test", ("127.0.0.1", 443), (b"http/1.1",))

Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@asynccontextmanager
async def _peers() -> AsyncIterator[Callable[[], Any]]:
    """Loopback connections; the server side of each is kept to write to or close."""
    servers: list[asyncio.StreamWriter] = []

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        servers.append(w)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while len(servers) < 1 or servers[-1].is_closing():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        return reader, writer, servers[-1]

    try:
        yield connect
    finally:
        for w in servers:
            w.close()
        server.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_parked_connection_goes_to_its_key_only() -> None:
    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=5)
            reader, writer, _ = await connect()
            assert pool.give(KEY, reader, writer)
            assert pool.take(OTHER) is None
            assert pool.take(KEY) == (reader, writer)
            assert pool.take(KEY) is None
            assert (pool.parked, pool.reused, len(pool)) == (1, 1, 0)
            writer.close()

    run(go())


def test_bounds_per_key_and_in_all() -> None:
    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=5, per_key=2, total=3)
            pairs = [await connect() for _ in range(5)]
            given = [pool.give(KEY, r, w) for r, w, _ in pairs[:3]]
            assert given == [True, True, False]  # two per key
            assert pool.give(OTHER, pairs[3][0], pairs[3][1])
            assert not pool.give(OTHER, pairs[4][0], pairs[4][1])  # three in all
            assert len(pool) == 3
            pool.clear()
            assert len(pool) == 0
            assert all(w.is_closing() for _, w, _ in pairs[:2])
            for _, w, _ in pairs:
                w.close()

    run(go())


def test_closed_after_the_idle_limit() -> None:
    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=0.05)
            reader, writer, _ = await connect()
            assert pool.give(KEY, reader, writer)
            await asyncio.sleep(0.2)
            assert len(pool) == 0
            assert writer.is_closing()
            assert pool.take(KEY) is None

    run(go())


def test_zero_idle_parks_nothing() -> None:
    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=0)
            reader, writer, _ = await connect()
            assert not pool.give(KEY, reader, writer)
            writer.close()

    run(go())


@pytest.mark.parametrize("what", ["closed", "sent bytes"])
def test_a_connection_the_upstream_touched_while_parked_is_not_handed_out(what: str) -> None:
    """Closed by the upstream, or bytes nobody asked for (they would be the next client's
    answer): closed, never handed out."""

    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=5)
            reader, writer, server = await connect()
            assert pool.give(KEY, reader, writer)
            if what == "closed":
                server.close()
            else:
                server.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil")
            await asyncio.sleep(0.1)
            assert pool.take(KEY) is None
            assert writer.is_closing()

    run(go())


def test_not_parked_with_unread_bytes() -> None:
    async def go() -> None:
        async with _peers() as connect:
            pool = Pool(idle=5)
            reader, writer, server = await connect()
            server.write(b"left over")
            await asyncio.sleep(0.1)
            assert not pool.give(KEY, reader, writer)
            writer.close()

    run(go())


# -- the key -------------------------------------------------------------------------------


@dataclass
class _Conn:
    sni: str | None = "api.test"
    address: tuple[str, int] | None = ("127.0.0.1", 443)
    alpn: bytes | None = b"http/1.1"
    alpn_offers: list[bytes] = field(default_factory=lambda: [b"http/1.1"])


@dataclass
class _Event:
    tls: bool = True
    via: Any = None
    transport_protocol: str = "tcp"


def _reuse(state: ClientState | None) -> tuple[Reuse, Any]:
    clients = Clients()
    client = _Conn()

    class Key:  # weakly referenceable stand-in for mitmproxy's Client
        pass

    handle = Key()
    if state is not None:
        clients[handle] = state  # type: ignore[index]
    reuse = Reuse(clients)
    reuse.usable = True
    return reuse, (handle, client)


def test_the_key_names_the_tunnels_principal() -> None:
    reuse, (handle, _) = _reuse(ClientState(tunnel=Tunnel("agent", "api.test", 443)))
    assert reuse.key(handle, _Conn()) == KEY  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "state",
    [
        None,
        ClientState(),  # no principal
        ClientState(tunnel=Tunnel("agent", "api.test", 443), broken=True),
    ],
    ids=["no state", "no principal", "broken"],
)
def test_no_key_no_sharing(state: ClientState | None) -> None:
    reuse, (handle, _) = _reuse(state)
    assert reuse.key(handle, _Conn()) is None  # type: ignore[arg-type]


def test_no_key_without_a_name() -> None:
    reuse, (handle, _) = _reuse(ClientState(tunnel=Tunnel("agent", "api.test", 443)))
    assert reuse.key(handle, _Conn(sni=None)) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("client", "event", "usable", "expected"),
    [
        (_Conn(), _Event(), True, True),
        (_Conn(alpn=None, alpn_offers=[]), _Event(), True, True),
        (_Conn(alpn=b"h2", alpn_offers=[b"h2", b"http/1.1"]), _Event(), True, False),
        (_Conn(alpn=b"http/1.1", alpn_offers=[b"h2", b"http/1.1"]), _Event(), True, False),
        (_Conn(), _Event(tls=False), True, False),
        (_Conn(), _Event(via=("http", ("proxy", 8080))), True, False),
        (_Conn(), _Event(transport_protocol="udp"), True, False),
        (_Conn(), _Event(), False, False),
    ],
    ids=["h1", "no alpn", "h2", "h2 offered", "plain", "via", "udp", "options differ"],
)
def test_which_requests_credproxy_dials(
    client: _Conn, event: _Event, usable: bool, expected: bool
) -> None:
    reuse = Reuse(Clients())
    reuse.usable = usable
    assert reuse.eligible(client, event) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("client", "offered"),
    [
        ([b"http/1.1"], (b"http/1.1",)),
        ([b"x", b"http/1.0", b"http/1.1"], (b"http/1.1",)),
        ([b"http/1.1"] * 50, (b"http/1.1",)),
        ([b"http/1.0", b"http/1.0"], (b"http/1.0",)),
        ([b"\xff\xfe", b"spdy/3"], ()),
        ([], ()),
    ],
)
def test_one_of_three_alpn_offers_whatever_the_client_lists(
    client: list[bytes], offered: tuple[bytes, ...]
) -> None:
    """Each distinct offer is a TLS context (certifi loaded, about 1 MiB and 37 ms): a client
    listing http/1.1 k times once made k of them."""
    assert offers(client) == offered


def test_at_most_three_tls_contexts() -> None:
    reuse = Reuse(Clients())
    for k in range(1, 40):
        reuse.context(offers([b"http/1.1"] * k + [b"http/1.0"] * (k % 3)))
    reuse.context(offers([b"http/1.0"]))
    reuse.context(offers([]))
    assert len(reuse._contexts) == 3
