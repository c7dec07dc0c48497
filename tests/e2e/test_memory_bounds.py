"""The proxy's memory stays within its bound whatever one client or upstream sends, and everyone
else is served meanwhile: WebSocket messages that never end or inflate, h2 downloads nobody
reads, and compression bombs on a stamped answer and on credproxy.internal.

Each case measures the proxy's resident memory (tests/e2e/memory.py) around the attack, on
the conftest's `proxy_b`, while its `bystander` makes requests.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable

import pytest
import wsproto.events as ev
from wsproto import ConnectionType, WSConnection
from wsproto.extensions import PerMessageDeflate

from tests.e2e.conftest import Proxy, _internal_head, _wait_for
from tests.e2e.memory import MEMORY_BOUND, MIB, Peak
from tests.e2e.raw import connect, get, h2_tunnel, proxy_auth, read_reply, tunnel
from tests.e2e.servers import WsUpstream

pytestmark = pytest.mark.e2e


@pytest.fixture
def ws_agent(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("ws")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["ws.test"], websocket=True)
    proxy_b.wait_reload()
    return name, token


def ws_open(
    proxy: Proxy, who: tuple[str, str], target: str, deflate: bool = False
) -> tuple[ssl.SSLSocket, WSConnection]:
    sock = tunnel(proxy.port, "ws.test:443", proxy_auth(*who), "ws.test", proxy.ca_file)
    ws = WSConnection(ConnectionType.CLIENT)
    exts = [PerMessageDeflate()] if deflate else []
    sock.sendall(ws.send(ev.Request(host="ws.test", target=target, extensions=exts)))
    sock.settimeout(5)
    while True:
        data = sock.recv(65536)
        assert data, "no handshake answer"
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, ev.AcceptConnection):
                return sock, ws
            raise AssertionError(f"handshake refused: {event}")


# -- WebSocket messages --------------------------------------------------------------------


# mitmproxy reassembles a WebSocket message in memory with no size bound: the proxy bounds it.
def test_a_never_ending_websocket_message_from_the_upstream_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander, ws_upstream: WsUpstream
):
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        sock, _ = ws_open(proxy_b, ws_agent, "/v1/flood")
        with sock:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and peak.peak - peak.start < 2 * MEMORY_BOUND:
                time.sleep(0.2)
            statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# An agent's WebSocket message is never held whole in the proxy, however large.
def test_a_never_ending_websocket_message_from_the_agent_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander
):
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        sock, ws = ws_open(proxy_b, ws_agent, "/v1/sink")
        with sock:
            chunk = b"a" * MIB
            try:
                for _ in range(48):
                    sock.sendall(ws.send(ev.BytesMessage(chunk, message_finished=False)))
            except OSError:
                pass  # the proxy ended it: what a bound would do
            time.sleep(0.5)
            statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# permessage-deflate would let 50 KB on the wire inflate to 48 MiB held in the proxy: the
# extension is never negotiated, and a compressed frame sent anyway ends the connection.
def test_a_compressed_websocket_bomb_from_the_agent_stays_within_the_memory_bound(
    proxy_b: Proxy, ws_agent, bystander
):
    import struct
    import zlib

    assert get(proxy_b, bystander).status == 200
    sock = tunnel(proxy_b.port, "ws.test:443", proxy_auth(*ws_agent), "ws.test", proxy_b.ca_file)
    ws = WSConnection(ConnectionType.CLIENT)
    request = ev.Request(host="ws.test", target="/v1/sink", extensions=[PerMessageDeflate()])
    with Peak(proxy_b.process.pid) as peak, sock:
        sock.sendall(ws.send(request))
        sock.settimeout(5)
        accepted = None
        while accepted is None:
            data = sock.recv(65536)
            assert data, "no handshake answer"
            ws.receive_data(data)
            accepted = next((e for e in ws.events() if isinstance(e, ev.AcceptConnection)), None)
        assert accepted.extensions == []
        squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
        payload = squeeze.compress(b"\0" * (48 * MIB)) + squeeze.flush(zlib.Z_SYNC_FLUSH)[:-4]
        assert len(payload) < 200_000
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        frame = b"\xc2\xff" + struct.pack("!Q", len(payload)) + mask + masked  # FIN, RSV1
        try:
            sock.sendall(frame)
            time.sleep(1)
        except OSError:
            pass
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


def test_a_modest_websocket_message_still_goes_through(proxy_b: Proxy, ws_agent, ws_upstream):
    before = ws_upstream.received
    sock, ws = ws_open(proxy_b, ws_agent, "/v1/sink")
    with sock:
        sock.sendall(ws.send(ev.BytesMessage(b"m" * 100_000)))
        deadline = time.monotonic() + 5
        while ws_upstream.received < before + 100_000 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ws_upstream.received >= before + 100_000


# -- h2 downloads that are never read ------------------------------------------------------


def _h2_never_read(proxy: Proxy, who: tuple[str, str], streams: int) -> ssl.SSLSocket:
    """A tunnel to big.test over h2 with `streams` downloads whose window never opens."""
    import h2.connection

    tls = h2_tunnel(proxy, proxy_auth(*who), "big.test")
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    request = [(":method", "GET"), (":scheme", "https"), (":authority", "big.test")]
    for n in range(streams):
        conn.send_headers(2 * n + 1, [*request, (":path", f"/v1/big/{n}")], end_stream=True)
    tls.sendall(conn.data_to_send())
    return tls


def test_one_principal_with_many_h2_tunnels_that_never_read_stays_within_the_memory_bound(
    proxy_b: Proxy, names, bystander
):
    """12 tunnels, 5 never-read downloads each (mitmproxy's 5 upstream connections per
    client connection): each stream is reset at its 1 MiB bound and memory is given back."""

    import h2.settings  # noqa: F401 - used by _h2_never_read

    name = names("h2many")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["big.test"])
    proxy_b.wait_reload()
    assert get(proxy_b, bystander).status == 200
    with Peak(proxy_b.process.pid) as peak:
        held = [_h2_never_read(proxy_b, (name, token), streams=5) for _ in range(12)]
        time.sleep(4)
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
        for tls in held:
            tls.close()
    assert statuses == [200] * 3
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# An h2 stream reset because its client stopped reading is audited as such, never as
# bad-request / bad-request-head.
def test_a_slow_h2_reader_is_audited_with_a_reason_that_says_so(proxy_b: Proxy, names):
    import h2.settings  # noqa: F401 - used by _h2_never_read

    name = names("h2slow")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["big.test"])
    proxy_b.wait_reload()
    tls = _h2_never_read(proxy_b, (name, token), streams=1)
    with tls:
        assert _wait_for(lambda: bool(proxy_b.requests(name)), 8)
    [line] = proxy_b.requests(name)
    assert line["decision"] == "error" and line.get("error")
    # The request head was fine: the client stopped reading.
    assert line.get("reason") != "bad-request"
    assert "request-head" not in line["error"]


# -- compressed bodies ---------------------------------------------------------------------


# A compressed response to a stamped request is inflated with an output bound: a chunk that
# decodes past 8 MiB ends the response, cut, never completed.
def test_a_gzip_bomb_in_a_stamped_response_stays_within_the_memory_bound(
    proxy_b: Proxy, names, bystander, bomb_body: bytes
):
    """An agent stores an object with Content-Encoding: gzip (S3 allows it) and fetches it
    with the stamped credential: 100 KB on the wire, 96 MiB of zeros once inflated."""
    from store.crypto import Secret

    name, cred = names("bomb"), names("bomb-cred")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_credential(cred, "bearer", ["bomb.test"], Secret(b"bomb-secret-123"))
    proxy_b.store.add_grant(name, ["GET"], credential=cred)
    proxy_b.wait_reload()
    assert len(bomb_body) < 200_000
    assert get(proxy_b, bystander).status == 200
    received = 0
    with Peak(proxy_b.process.pid) as peak:
        sock, reply = connect(proxy_b.port, "bomb.test:443", proxy_auth(name, token))
        assert reply.status == 200
        context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
        with context.wrap_socket(sock, server_hostname="bomb.test") as tls:
            tls.settimeout(10)
            tls.sendall(b"GET /v1/object HTTP/1.1\r\nHost: bomb.test\r\nConnection: close\r\n\r\n")
            try:
                while data := tls.recv(1 << 20):  # a reader that keeps up
                    received += len(data)
            except (OSError, ssl.SSLError):
                pass
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert received < 96 * MIB  # cut: never delivered whole
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"


# credproxy.internal decodes Content-Encoding, so its 16 KiB bound holds for the decoded body
# too: a 200-byte brotli body that inflates to 128 MiB is refused within the memory bound.
def test_a_brotli_bomb_to_credproxy_internal_stays_within_the_memory_bound(
    proxy_b: Proxy, bystander
):
    import brotli

    body = brotli.compress(b"\0" * (128 * MIB), quality=5)
    assert len(body) < 1024
    head = _internal_head(bystander, "POST", "/access-requests", len(body), "Content-Encoding: br")
    with Peak(proxy_b.process.pid) as peak:
        with socket.create_connection(("127.0.0.1", proxy_b.port), timeout=15) as sock:
            sock.sendall(head + body)
            reply = read_reply(sock)
        statuses = [get(proxy_b, bystander).status for _ in range(3)]
    assert statuses == [200] * 3
    assert reply.status in (400, 413)
    assert peak.growth < MEMORY_BOUND, f"grew {peak.growth / MIB:.1f} MiB"
