"""Echoes of the stamped secret never reach the agent or the audit stream: every form the README
promises, in held and streamed bodies, heads, h2 trailers and WebSocket frames, over HTTP/1
and HTTP/2, also when the secret is split across messages or between a body and its trailers.

The conftest's `rproxy` behind the echoing upstreams of tests/e2e/echoes.py.
"""

from __future__ import annotations

import pytest
import wsproto.events as ev

from store.rules import bodyrules
from tests.e2e.conftest import Proxy
from tests.e2e.echoes import (
    SECRET,
    _leaks,
    _mixed_escapes,
    _principal,
    _raw_deflate,
    _references,
)
from tests.e2e.raw import fetch, h2_get, h2_tunnel, proxy_auth, ws_session

pytestmark = pytest.mark.e2e


# -- bodies and heads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/mixed-held", id="a held body with every byte escaped another way"),
        pytest.param("/v1/mixed-streamed", id="a chunked body in 3-byte chunks, mixed escapes"),
        pytest.param("/v1/gzip-streamed", id="a gzip body in 5-byte chunks despite identity"),
        pytest.param("/v1/html-streamed", id="HTML character references in 3-byte chunks"),
        pytest.param("/v1/reason", id="the reason phrase is the secret"),
        pytest.param("/v1/header-name", id="a header name holds it, a value escapes it"),
        pytest.param("/v1/large-held-edge", id="a held body of exactly 64 KiB ending in it"),
    ],
)
@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_echoes_in_every_promised_form_are_redacted(
    rproxy: Proxy, raw_agent, path: str, http2: bool
):
    reply = fetch(rproxy, raw_agent, "raw.test", path, http2)
    assert reply.status == 200
    leaked = _leaks(reply.raw) or _mixed_escapes(SECRET) in reply.raw
    leaked = leaked or _references(SECRET) in reply.raw or _references(SECRET[2:]) in reply.raw
    assert not leaked, "the agent received the secret"
    if path in ("/v1/mixed-held", "/v1/mixed-streamed", "/v1/gzip-streamed", "/v1/html-streamed"):
        marked = b"[REDACTED]" in reply.body
        assert marked
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


def test_a_raw_deflate_body_echoing_the_secret_is_never_delivered(rproxy: Proxy, raw_agent):
    """`deflate` without its zlib header cannot be decoded: fail closed, nothing decoded leaks."""
    reply = fetch(rproxy, raw_agent, "raw.test", "/v1/raw-deflate", False)
    leaked = _leaks(reply.raw) or _raw_deflate(b"token=" + SECRET) in reply.raw
    assert not leaked, "the agent received the secret"
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


# -- h2 trailers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/trailers-held", id="h2 trailers of a held answer are redacted"),
        pytest.param("/v1/trailers-streamed", id="h2 trailers of a streamed answer are redacted"),
    ],
)
def test_h2_trailers_echoing_the_secret_are_redacted(rproxy: Proxy, names, path: str):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["h2.test"], paths=["/v1/"])
    rproxy.wait_reload()
    with h2_tunnel(rproxy, proxy_auth(principal, token), "h2.test") as tls:
        answer = h2_get(tls, "h2.test", path)
    fields, trailers = answer.fields, answer.trailers
    assert dict(fields).get(b":status") == b"200"
    seen = b"\n".join(k + b": " + v for k, v in trailers)
    leaked = _leaks(seen) or _mixed_escapes(SECRET) in seen
    assert not leaked, "the agent received the secret in a trailer"
    assert b"grpc-message: bad key [REDACTED]" in seen
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


def _h2_get(proxy: Proxy, agent: tuple[str, str], host: str, path: str) -> tuple[bytes, bytes]:
    """(body, trailers as 'name: value' lines) of one h2 GET through a tunnel."""
    with h2_tunnel(proxy, proxy_auth(*agent), host) as tls:
        answer = h2_get(tls, host, path)
    return answer.body, b"\n".join(k + b": " + v for k, v in answer.trailers)


# The streamed body's held-back tail is redacted together with the trailers: a secret split
# between the body's end and a trailer never reaches the agent.
@pytest.mark.parametrize(
    "path",
    [pytest.param("/v1/body-then-trailer", id="the body ends with its start, a trailer the rest")],
)
def test_a_secret_split_between_body_and_trailers_never_reaches_the_agent(
    rproxy: Proxy, names, path: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["h2.test"], paths=["/v1/"])
    rproxy.wait_reload()
    body, trailers = _h2_get(rproxy, (principal, token), "h2.test", path)
    joined = body.removeprefix(b"key: ") + trailers.removeprefix(b"grpc-message: ")
    whole = SECRET in joined
    assert not whole, "the agent can put the secret back together"


# An empty HTTP/2 DATA frame mid-body is not the body's end (addon/mitm/emptydata.py): the
# held-back start of a secret is not flushed by it.
def test_a_secret_split_around_an_empty_h2_data_frame_is_redacted(rproxy: Proxy, names):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["h2.test"], paths=["/v1/"])
    rproxy.wait_reload()
    body, _ = _h2_get(rproxy, (principal, token), "h2.test", "/v1/empty-frame-split")
    assert body.startswith(b"echo: ") and body.endswith(b" end"), body
    assert SECRET not in body and SECRET[:9] not in body, body


def test_a_tools_list_event_split_around_an_empty_h2_data_frame_is_filtered(rproxy: Proxy, names):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal,
        ["GET"],
        credential=cred,
        hosts=["h2.test"],
        paths=["/v1/"],
        body=bodyrules.parse("mcp", {"tools": ["ok"]}),
    )
    rproxy.wait_reload()
    body, _ = _h2_get(rproxy, (principal, token), "h2.test", "/v1/mcp-empty-frame")
    assert b'"ok"' in body, body
    assert b"drop_repo" not in body, body


# -- WebSocket -----------------------------------------------------------------------------


def _ws_text(events: list[ev.Event]) -> str:
    return "".join(e.data for e in events if isinstance(e, ev.TextMessage))


@pytest.fixture
def ws_agent(rproxy: Proxy, names) -> tuple[str, str]:
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET"], credential=cred, hosts=["ws.test"], paths=["/v1/"], websocket=True
    )
    rproxy.wait_reload()
    return principal, token


# The cross-message check remembers more than the previous message's tail and reads control
# frames: a secret over three messages, or a message and a close or ping, never arrives whole.
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("three", id="the secret in three server messages reaches the agent"),
        pytest.param("close-split", id="a message's tail and the close reason make the secret"),
        pytest.param("ping-split", id="a message's tail and a ping payload make the secret"),
    ],
)
def test_a_secret_spread_over_websocket_frames_never_reaches_the_agent(
    rproxy: Proxy, ws_agent, mode: str
):
    received, got = ws_session(rproxy, proxy_auth(*ws_agent), "ws.test", f"/v1/ws/{mode}")
    assert b"101" in received
    text = ""  # everything the agent got, in order: messages, close reasons, ping payloads
    for e in got:
        if isinstance(e, ev.TextMessage):
            text += e.data
        elif isinstance(e, ev.CloseConnection):
            text += e.reason or ""
        elif isinstance(e, ev.Ping | ev.Pong):
            text += bytes(e.payload).decode("latin-1")
    whole = SECRET.decode() in text
    assert not whole, "the agent can put the secret back together"


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("two", id="the secret in two server messages: the second never arrives"),
        pytest.param("pong", id="an unsolicited pong echoing the secret is redacted"),
        pytest.param("eager", id="a message in the same write as the 101 is redacted"),
    ],
)
def test_websocket_forms_across_two_messages_and_in_pongs_held(rproxy: Proxy, ws_agent, mode: str):
    received, got = ws_session(rproxy, proxy_auth(*ws_agent), "ws.test", f"/v1/ws/{mode}")
    assert b"101" in received
    whole = SECRET.decode() in _ws_text(got)
    assert not whole, "the agent can put the secret back together"
    leaked = _leaks(received)
    assert not leaked, "the agent received the secret"
    if mode == "pong":
        pongs = [bytes(e.payload) == b"[REDACTED]" for e in got if isinstance(e, ev.Pong)]
        assert pongs == [True]
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"
