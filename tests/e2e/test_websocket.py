"""WebSocket on a stamped handshake: nothing the upstream echoes reaches the agent.

A real `credproxy run`, a real TLS WebSocket upstream (wsproto) on 127.0.0.1, and a client
that tunnels through the proxy (CONNECT, TLS with the proxy's CA, Upgrade).
"""

from __future__ import annotations

import base64
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import trustme
import wsproto.events as ev
from wsproto import ConnectionType, WSConnection

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.raw import proxy_auth, tunnel

pytestmark = pytest.mark.e2e

SECRET = "sk-ws-" + os.urandom(8).hex()
STAMPED = f"Bearer {SECRET}"
FORMS = [SECRET, base64.b64encode(SECRET.encode()).decode(), quote(SECRET, safe="")]


def _script(mode: str, auth: str) -> list[ev.Event]:
    """What the upstream sends after the handshake, echoing the stamped Authorization."""
    if mode == "text":
        return [ev.TextMessage(auth)]
    if mode == "binary":
        return [ev.BytesMessage(auth.encode())]
    if mode == "fragmented":
        return [
            ev.TextMessage(auth[:9], message_finished=False),
            ev.TextMessage(auth[9:15], message_finished=False),
            ev.TextMessage(auth[15:], message_finished=True),
        ]
    if mode == "split":
        return [ev.TextMessage("x " + auth[:15]), ev.TextMessage(auth[15:] + " y")]
    if mode == "ping":
        return [ev.Ping(auth.encode())]
    if mode == "close":
        return [ev.CloseConnection(1000, auth)]
    raise AssertionError(mode)


class WsUpstream:
    """A TLS WebSocket server for api.test: each connection plays the script its path names."""

    def __init__(self, ca: trustme.CA) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("api.test").configure_cert(self.context)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(10)
        with self.context.wrap_socket(raw, server_side=True) as sock:
            ws = WSConnection(ConnectionType.SERVER)
            try:
                while True:
                    data = sock.recv(65536)
                    if not data:
                        return
                    ws.receive_data(data)
                    for event in ws.events():
                        if isinstance(event, ev.Request):
                            sock.sendall(ws.send(ev.AcceptConnection()))
                            auth = dict(event.extra_headers).get(b"authorization", b"").decode()
                            mode = event.target.rsplit("/", 1)[1]
                            script = _script(mode, auth)
                            if mode != "close":
                                script += [ev.TextMessage("done"), ev.CloseConnection(1000, "bye")]
                            for step in script:
                                sock.sendall(ws.send(step))
                        elif isinstance(event, ev.CloseConnection):
                            return
            except (OSError, ssl.SSLError):
                return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def ws_proxy(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    server = WsUpstream(upstream_ca)
    home = tmp_path_factory.mktemp("wsproxy")
    running = start_proxy(
        home, upstream_ca, [f"api.test=127.0.0.1:{server.port}"], template=initialised_home
    )
    yield running
    stop_proxy(running)
    server.close()


@pytest.fixture
def agent(ws_proxy: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    """A principal with a --websocket bearer grant on api.test /v1/."""
    principal, cred = names("ws-agent"), names("ws-cred")
    token = ws_proxy.store.add_principal(principal)
    ws_proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(SECRET.encode()))
    ws_proxy.store.add_grant(principal, ["GET"], credential=cred, paths=["/v1/"], websocket=True)
    ws_proxy.wait_reload()
    return principal, token


def _session(proxy: Proxy, principal: str, token: str, mode: str) -> tuple[bytes, list[ev.Event]]:
    """Everything the client received after TLS (raw bytes) and the WebSocket events."""
    sock = tunnel(
        proxy.port, "api.test:443", proxy_auth(principal, token), "api.test", proxy.ca_file
    )
    ws = WSConnection(ConnectionType.CLIENT)
    received, got = b"", []
    with sock:
        sock.sendall(ws.send(ev.Request(host="api.test", target=f"/v1/ws/{mode}")))
        while True:
            try:
                data = sock.recv(65536)
            except (OSError, ssl.SSLError):
                break
            if not data:
                break
            received += data
            ws.receive_data(data)
            for event in ws.events():
                got.append(event)
                if isinstance(event, ev.Ping | ev.CloseConnection):
                    try:
                        sock.sendall(ws.send(event.response()))
                    except (OSError, ssl.SSLError):
                        pass  # the proxy may close first: what it sent is what counts
    return received, got


def _texts(events: list[ev.Event]) -> list[str | bytes]:
    """Whole messages: wsproto hands a message over in pieces as its frames arrive."""
    out: list[str | bytes] = []
    part: list[str | bytes] = []
    for e in events:
        if isinstance(e, ev.Message):
            part.append(e.data)
            if e.message_finished:
                out.append("".join(part) if isinstance(e.data, str) else b"".join(part))  # type: ignore[arg-type]
                part = []
    return out


def _assert_clean(received: bytes, proxy: Proxy) -> None:
    for form in FORMS:
        assert form.encode() not in received
        assert form not in proxy.output()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        pytest.param("text", ["Bearer [REDACTED]", "done"], id="a text message is redacted"),
        pytest.param("binary", [b"Bearer [REDACTED]", "done"], id="a binary message is redacted"),
        pytest.param(
            "fragmented",
            ["Bearer [REDACTED]", "done"],
            id="a message fragmented across frames is redacted whole",
        ),
        pytest.param("ping", ["done"], id="a ping payload is redacted"),
    ],
)
def test_server_messages_echoing_the_secret_are_redacted(ws_proxy, agent, mode, expected):
    received, got = _session(ws_proxy, *agent, mode)
    assert b"101" in received
    assert _texts(got) == expected
    if mode == "ping":
        assert [bytes(e.payload) for e in got if isinstance(e, ev.Ping)] == [b"[REDACTED]"]
    _assert_clean(received, ws_proxy)


def test_a_secret_split_across_two_messages_closes_the_connection(ws_proxy, agent):
    received, got = _session(ws_proxy, *agent, "split")
    texts = _texts(got)
    # The first message (a prefix of the secret at most) went out; nothing after it did.
    assert texts == ["x " + STAMPED[:15]]
    assert not any(isinstance(e, ev.CloseConnection) and e.reason == "bye" for e in got)
    assert STAMPED[15:].encode() not in received
    _assert_clean(received, ws_proxy)


def test_a_close_reason_echoing_the_secret_is_redacted(ws_proxy, agent):
    received, got = _session(ws_proxy, *agent, "close")
    [close] = [e for e in got if isinstance(e, ev.CloseConnection)]
    assert (close.code, close.reason) == (1000, "[REDACTED]")
    _assert_clean(received, ws_proxy)
