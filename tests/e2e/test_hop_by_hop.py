"""Hop-by-hop fields end at the proxy, both ways: the agent's never reach the upstream, the
upstream's never reach the agent, and a `close` closes only the connection it came on.

A real proxy, raw clients (HTTP/1 and HTTP/2 inside a tunnel) and upstreams that record the
head they received and count their connections.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
import trustme
import wsproto.events as ev
from wsproto import WSConnection

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.misbehaving import H2Upstream, RawUpstream, head
from tests.e2e.raw import (
    Reply,
    closed_by_peer,
    exchange,
    fetch,
    h2_tunnel,
    proxy_auth,
    read_reply,
    tunnel,
)
from tests.e2e.servers import WsUpstream
from tests.e2e.upstream import Received, Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-hop-" + os.urandom(8).hex()
BEARER, KEYED, H2, WS = "api.test", "key.test", "h2.test", "ws.test"
LINGER = "linger.test"
# Fields no upstream and no agent may receive from the other side.
HOP = {"connection", "keep-alive", "proxy-connection", "te", "upgrade", "proxy-authenticate"}
UPSTREAM_HOP = [
    ("Connection", "X-Foo"),
    ("X-Foo", "upstream-private"),
    ("Keep-Alive", "timeout=5, max=100"),
    ("Proxy-Connection", "keep-alive"),
    ("Proxy-Authenticate", 'Basic realm="upstream"'),
    ("Upgrade", "h2c"),
]


def _app(received: Received) -> tuple[int, list[tuple[str, str]], bytes] | None:
    if received.target.startswith("/v1/hop-answer"):
        return 200, UPSTREAM_HOP, b"hop"
    if received.target.startswith("/v1/close-answer"):
        return 200, [("Connection", "close")], b"closing"
    return None


def _h2_hop_answer(conn: Any, stream_id: int, secret: bytes) -> None:
    fields = [(b":status", b"200"), (b"connection", b"x-foo"), (b"x-foo", b"1")]
    conn.send_headers(stream_id, fields, end_stream=True)


def _close_later(_: bytes) -> Iterator[bytes]:
    """`Connection: close`, the body after the proxy has read the head (so the head has been
    stripped by then), and no close for a while: kept, the connection would be handed to
    the next client, and no answer would come."""
    yield head(b"HTTP/1.1 200 OK", b"Connection: close", b"Content-Length: 3")
    time.sleep(0.3)
    yield b"bye"


class Handshakes:
    """What the WebSocket upstream received in each handshake."""

    def __init__(self) -> None:
        self.seen: list[ev.Request] = []

    def __call__(self, sock: ssl.SSLSocket, ws: WSConnection, request: ev.Request) -> None:
        self.seen.append(request)
        sock.sendall(ws.send(ev.AcceptConnection()))
        sock.sendall(ws.send(ev.CloseConnection(1000, "bye")))


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def servers(ca: trustme.CA) -> Iterator[tuple[Any, ...]]:
    handshakes = Handshakes()
    with (
        Upstream(ca, [BEARER, KEYED], app=_app) as h1,
        H2Upstream(ca, [H2], {"/v1/h2-hop": _h2_hop_answer}) as h2,
        WsUpstream(ca, WS, handshakes) as ws,
        RawUpstream(ca, [LINGER], {"/v1/x": _close_later}, linger=3) as lingering,
    ):
        yield h1, h2, ws, handshakes, lingering


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    ca: trustme.CA,
    servers: tuple[Any, ...],
    initialised_home: Path,
) -> Iterator[Proxy]:
    h1, h2, ws, _, lingering = servers
    resolve = [f"{name}=127.0.0.1:{h1.port}" for name in (BEARER, KEYED)]
    resolve += [f"{H2}=127.0.0.1:{h2.port}", f"{WS}=127.0.0.1:{ws.port}"]
    resolve.append(f"{LINGER}=127.0.0.1:{lingering.port}")
    home = tmp_path_factory.mktemp("hop")
    running = start_proxy(home, ca, resolve, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture
def upstream(servers: tuple[Any, ...]) -> Upstream:
    time.sleep(0.05)
    servers[0].log.clear()
    return servers[0]  # type: ignore[no-any-return]


_n = iter(range(10**6))


@pytest.fixture
def agent(proxy: Proxy) -> tuple[str, str]:
    """A principal with a bearer grant on api.test, a header (X-Api-Key) grant on key.test,
    bearer grants on h2.test and linger.test, a WebSocket grant on ws.test: GET and POST
    under /v1/."""
    n = next(_n)
    principal = f"hop-{n}"
    token = proxy.store.add_principal(principal)
    schemes = {BEARER: ("bearer", None), KEYED: ("header", "X-Api-Key"), H2: ("bearer", None)}
    schemes[WS] = schemes[LINGER] = ("bearer", None)
    for host, (scheme, header) in schemes.items():
        cred = f"hop-{n}-{host.split('.')[0]}"
        proxy.store.add_credential(cred, scheme, [host], Secret(SECRET.encode()), header)
        proxy.store.add_grant(
            principal, ["GET", "POST"], credential=cred, paths=["/v1/"], websocket=host == WS
        )
    proxy.wait_reload()
    return principal, token


def _send(proxy: Proxy, who: tuple[str, str], host: str, head: str, body: bytes = b"") -> Reply:
    """One raw HTTP/1 request in a new tunnel to `host`; `head` is the lines after the
    request line and Host."""
    with tunnel(proxy.port, f"{host}:443", proxy_auth(*who), host, proxy.ca_file) as tls:
        tls.settimeout(10)
        raw = f"{head}\r\n\r\n".encode() + body
        return exchange(tls, raw)


def _names(received: Received) -> list[str]:
    return [name.lower() for name, _ in received.headers]


AUTHORIZATION = f"Bearer {SECRET}"


@pytest.mark.parametrize(
    ("host", "lines", "gone", "stamped"),
    [
        pytest.param(
            BEARER,
            [
                "Connection: close, X-Private",
                "X-Private: drop-me",
                "Keep-Alive: timeout=5",
                "Proxy-Connection: keep-alive",
                "TE: trailers",
            ],
            ["x-private"],
            ("authorization", AUTHORIZATION),
            id="the issue's request: Connection, what it names, Keep-Alive, Proxy-Connection, TE",
        ),
        pytest.param(
            BEARER,
            ["Connection: Authorization", "Authorization: Bearer placeholder"],
            [],
            ("authorization", AUTHORIZATION),
            id="Connection naming Authorization: the agent's copy goes, the stamp stays",
        ),
        pytest.param(
            KEYED,
            ["Connection: X-Api-Key", "X-Api-Key: placeholder"],
            [],
            ("x-api-key", SECRET),
            id="Connection naming the scheme's header: the stamp stays",
        ),
        pytest.param(
            BEARER,
            ["CONNECTION: AUTHORIZATION, X-PRIVATE", "authorization: x", "x-private: 1"],
            ["x-private"],
            ("authorization", AUTHORIZATION),
            id="upper case names a field in any case",
        ),
        pytest.param(
            KEYED,
            ["cOnNeCtIoN: x-API-key, X-pRiVaTe", "X-Api-Key: placeholder", "X-Private: 1"],
            ["x-private"],
            ("x-api-key", SECRET),
            id="mixed case",
        ),
        pytest.param(
            BEARER,
            ["Connection: X-A", "Connection: X-B, keep-alive", "X-A: 1", "X-B: 2"],
            ["x-a", "x-b"],
            ("authorization", AUTHORIZATION),
            id="several Connection lines each name fields",
        ),
        pytest.param(
            BEARER,
            ["Proxy-Connection: keep-alive"],
            [],
            ("authorization", AUTHORIZATION),
            id="Proxy-Connection alone",
        ),
        pytest.param(
            BEARER,
            ["Keep-Alive: timeout=5, max=100"],
            [],
            ("authorization", AUTHORIZATION),
            id="Keep-Alive alone",
        ),
        pytest.param(
            BEARER, ["TE: gzip, trailers"], [], ("authorization", AUTHORIZATION), id="TE alone"
        ),
    ],
)
def test_the_agents_hop_by_hop_fields_never_reach_the_upstream(
    proxy: Proxy, upstream: Upstream, agent, host, lines, gone, stamped
):
    head = "\r\n".join(["GET /v1/x HTTP/1.1", f"Host: {host}", *lines])
    reply = _send(proxy, agent, host, head)
    assert reply.status == 200
    [received] = upstream.log.requests
    names = _names(received)
    assert not (HOP | set(gone)) & set(names), received.headers
    name, value = stamped
    assert received.header(name) == [value]
    assert received.header("host") == [host]


def test_host_and_the_framing_are_never_removed_by_being_named(
    proxy: Proxy, upstream: Upstream, agent
):
    body = b'{"x": 1}'
    head = "\r\n".join(
        [
            "POST /v1/items HTTP/1.1",
            f"Host: {BEARER}",
            "Connection: Host, Content-Length, Transfer-Encoding",
            f"Content-Length: {len(body)}",
        ]
    )
    assert _send(proxy, agent, BEARER, head, body).status == 200
    [received] = upstream.log.requests
    assert received.header("host") == [BEARER]
    assert received.header("content-length") == [str(len(body))]
    assert received.body == body
    assert "connection" not in _names(received)


def test_a_chunked_body_named_in_connection_still_arrives_framed(
    proxy: Proxy, upstream: Upstream, agent
):
    head = "\r\n".join(
        [
            "POST /v1/items HTTP/1.1",
            f"Host: {BEARER}",
            "Connection: Transfer-Encoding",
            "Transfer-Encoding: chunked",
        ]
    )
    assert _send(proxy, agent, BEARER, head, b"5\r\nhello\r\n0\r\n\r\n").status == 200
    [received] = upstream.log.requests
    assert received.header("transfer-encoding") == ["chunked"]
    assert received.body == b"hello"


@pytest.mark.parametrize("http2", [False, True], ids=["HTTP/1 agent", "HTTP/2 agent"])
def test_the_upstreams_hop_by_hop_fields_never_reach_the_agent(
    proxy: Proxy, upstream: Upstream, agent, http2
):
    answer = fetch(proxy, agent, BEARER, "/v1/hop-answer", http2=http2)
    assert answer.status == 200 and answer.body == b"hop"
    names = set(answer.headers)
    assert not (HOP | {"x-foo"}) & names, answer.headers


def test_an_http2_upstreams_connection_fields_are_refused(proxy: Proxy, agent):
    """h2 (validate_inbound_headers) refuses connection-specific fields in an HTTP/2 answer."""
    answer = fetch(proxy, agent, H2, "/v1/h2-hop", http2=True)
    assert answer.status == 502
    assert "x-foo" not in answer.headers and "connection" not in answer.headers


@pytest.mark.parametrize(
    "field",
    [
        (b"connection", b"x-private"),
        (b"keep-alive", b"timeout=5"),
        (b"proxy-connection", b"keep-alive"),
        (b"upgrade", b"websocket"),
        (b"te", b"gzip"),
        (b"transfer-encoding", b"chunked"),
    ],
    ids=lambda f: f[0].decode(),
)
def test_an_http2_agents_connection_fields_are_refused_before_the_upstream(
    proxy: Proxy, upstream: Upstream, agent, field
):
    """h2 itself refuses them (malformed in HTTP/2): nothing reaches the upstream."""
    assert _h2_get(proxy, agent, field) != b"200"
    assert upstream.log.requests == []


def test_an_http2_agents_te_trailers_never_reaches_an_http1_upstream(
    proxy: Proxy, upstream: Upstream, agent
):
    """credproxy forwards trailers between HTTP/2 peers only: over HTTP/1 it refuses them."""
    assert _h2_get(proxy, agent, (b"te", b"trailers")) == b"200"
    [received] = upstream.log.requests
    assert received.header("te") == []
    assert received.header("authorization") == [AUTHORIZATION]


def _h2_get(proxy: Proxy, agent: tuple[str, str], field: tuple[bytes, bytes]) -> bytes | None:
    """GET api.test/v1/x over HTTP/2 with `field`, sent as it is; the status, if any."""
    config = h2.config.H2Configuration(
        validate_outbound_headers=False, normalize_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    request = [
        (b":method", b"GET"),
        (b":scheme", b"https"),
        (b":authority", BEARER.encode()),
        (b":path", b"/v1/x"),
        field,
    ]
    conn.send_headers(1, request, end_stream=True)
    status = None
    ends = h2.events.StreamEnded | h2.events.StreamReset | h2.events.ConnectionTerminated
    with h2_tunnel(proxy, proxy_auth(*agent), BEARER) as tls:
        tls.settimeout(5)
        tls.sendall(conn.data_to_send())
        ended = False
        while not ended:
            try:
                data = tls.recv(65536)
            except (TimeoutError, OSError):
                break
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"]
                ended = ended or isinstance(event, ends)
            tls.sendall(conn.data_to_send())
    return status


def test_the_agents_close_closes_its_own_connection_and_not_the_upstreams(
    proxy: Proxy, upstream: Upstream, agent
):
    """One-shot clients that send `Connection: close` still share one upstream connection,
    and are told and shown the close of their own."""
    head = f"GET /v1/x HTTP/1.1\r\nHost: {BEARER}\r\nConnection: close\r\n\r\n".encode()
    for _ in range(4):
        with tunnel(proxy.port, f"{BEARER}:443", proxy_auth(*agent), BEARER, proxy.ca_file) as tls:
            tls.settimeout(10)
            reply = exchange(tls, head)
            assert reply.status == 200
            assert reply.headers.get("connection") == "close"
            assert closed_by_peer(tls, 5)
        time.sleep(0.1)  # the proxy parks the connection once it has seen its client go
    assert len(upstream.log.requests) == 4
    assert upstream.log.connections == 1
    assert all("connection" not in _names(r) for r in upstream.log.requests)


def test_the_upstreams_close_closes_its_own_connection_and_not_the_agents(
    proxy: Proxy, upstream: Upstream, agent
):
    with tunnel(proxy.port, f"{BEARER}:443", proxy_auth(*agent), BEARER, proxy.ca_file) as tls:
        tls.settimeout(10)
        first = exchange(tls, f"GET /v1/close-answer HTTP/1.1\r\nHost: {BEARER}\r\n\r\n".encode())
        assert first.status == 200 and first.body == b"closing"
        assert "connection" not in first.headers
        second = exchange(tls, f"GET /v1/after HTTP/1.1\r\nHost: {BEARER}\r\n\r\n".encode())
        assert second.status == 200
    assert upstream.log.connections == 2, "the connection the upstream closed is not used again"


def test_a_connection_the_upstream_said_it_closes_is_never_kept(
    proxy: Proxy, servers: tuple[Any, ...], agent
):
    """Its `Connection: close` is gone from what the agent reads, yet it is closed."""
    lingering: RawUpstream = servers[4]
    lingering.heads.clear()
    request = f"GET /v1/x HTTP/1.1\r\nHost: {LINGER}\r\n\r\n".encode()
    for _ in range(2):
        with tunnel(proxy.port, f"{LINGER}:443", proxy_auth(*agent), LINGER, proxy.ca_file) as tls:
            tls.settimeout(10)
            reply = exchange(tls, request)
        assert reply.status == 200 and reply.body == b"bye"
        assert "connection" not in reply.headers
        time.sleep(0.1)
    assert len(lingering.heads) == 2


def test_a_granted_websocket_keeps_its_upgrade_and_loses_the_rest(
    proxy: Proxy, servers: tuple[Any, ...], agent
):
    handshakes: Handshakes = servers[3]
    handshakes.seen.clear()
    head = "\r\n".join(
        [
            "GET /v1/ws HTTP/1.1",
            f"Host: {WS}",
            "Connection: keep-alive, Upgrade, X-Private",
            "Upgrade: websocket",
            "X-Private: drop-me",
            "Keep-Alive: timeout=5",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version: 13",
            "Authorization: Bearer placeholder",
        ]
    )
    with tunnel(proxy.port, f"{WS}:443", proxy_auth(*agent), WS, proxy.ca_file) as tls:
        tls.settimeout(10)
        tls.sendall(f"{head}\r\n\r\n".encode())
        reply = read_reply(tls)
    assert reply.status == 101
    assert reply.headers["upgrade"].lower() == "websocket"
    assert reply.headers["connection"].lower() == "upgrade"
    [request] = handshakes.seen
    extra = {k.decode().lower(): v.decode() for k, v in request.extra_headers}
    assert extra.get("authorization") == AUTHORIZATION
    assert "x-private" not in extra and "keep-alive" not in extra
