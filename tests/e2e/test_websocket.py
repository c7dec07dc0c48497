"""WebSocket on a stamped handshake: nothing the upstream echoes reaches the agent.

A real `credproxy run`, a real TLS WebSocket upstream (wsproto) on 127.0.0.1, and a client
that tunnels through the proxy (CONNECT, TLS with the proxy's CA, Upgrade).
"""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import trustme
import wsproto.events as ev
from wsproto import WSConnection

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.raw import proxy_auth, ws_session
from tests.e2e.servers import WsUpstream, authorization

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


def _upgrade(sock: ssl.SSLSocket, ws: WSConnection, request: ev.Request) -> None:
    """Each connection plays the script its path names."""
    sock.sendall(ws.send(ev.AcceptConnection()))
    auth = authorization(request)
    mode = request.target.rsplit("/", 1)[1]
    script = _script(mode, auth)
    if mode != "close":
        script += [ev.TextMessage("done"), ev.CloseConnection(1000, "bye")]
    for step in script:
        sock.sendall(ws.send(step))


@pytest.fixture(scope="module")
def ws_proxy(
    tmp_path_factory: pytest.TempPathFactory, upstream_ca: trustme.CA, initialised_home: Path
) -> Iterator[Proxy]:
    with WsUpstream(upstream_ca, "api.test", _upgrade) as server:
        home = tmp_path_factory.mktemp("wsproxy")
        running = start_proxy(
            home, upstream_ca, [f"api.test=127.0.0.1:{server.port}"], template=initialised_home
        )
        yield running
        stop_proxy(running)


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
    return ws_session(proxy, proxy_auth(principal, token), "api.test", f"/v1/ws/{mode}")


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
