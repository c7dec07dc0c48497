"""WebSocket redaction, hook by hook, on mitmproxy's test flows."""

from __future__ import annotations

import wsproto.events as ev
from mitmproxy.test import tflow
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from addon.redaction import wsredact
from addon.redaction.redact import MARK, Redactor

SECRET = b"sk-ws-0123456789"


def _flow(*messages: WebSocketMessage, stamped: bool = True):
    flow = tflow.twebsocketflow(messages=list(messages))
    if stamped:
        wsredact.REDACTORS[flow] = Redactor([SECRET])
    return flow


def _server(content: bytes, text: bool = True) -> WebSocketMessage:
    return WebSocketMessage(Opcode.TEXT if text else Opcode.BINARY, False, content)


def _deliver(flow, message: WebSocketMessage) -> WebSocketMessage:
    flow.websocket.messages.append(message)
    wsredact.on_message(flow)
    return message


def test_server_text_and_binary_messages_are_redacted():
    flow = _flow()
    assert _deliver(flow, _server(b"echo " + SECRET)).content == b"echo " + MARK
    assert _deliver(flow, _server(b"\x00" + SECRET, text=False)).content == b"\x00" + MARK


def test_client_messages_and_unstamped_flows_are_left_alone():
    flow = _flow()
    sent = WebSocketMessage(Opcode.TEXT, True, SECRET)
    assert _deliver(flow, sent).content == SECRET
    plain = _flow(stamped=False)
    assert _deliver(plain, _server(SECRET)).content == SECRET


def test_a_form_spanning_two_server_messages_raises_and_the_hook_kills():
    flow = _flow()
    _deliver(flow, _server(b"x " + SECRET[:6]))
    second = _server(SECRET[6:] + b" y")
    flow.websocket.messages.append(second)
    try:
        wsredact.on_message(flow)
    except wsredact.SplitSecret:
        wsredact.kill(flow)
    else:
        raise AssertionError("a split secret was let through")
    assert second.dropped and wsredact.killed(flow)
    assert _deliver(flow, _server(b"later")).dropped  # nothing more once killed


def test_a_partial_form_that_does_not_finish_is_not_a_split():
    flow = _flow()
    _deliver(flow, _server(b"x " + SECRET[:6]))
    assert _deliver(flow, _server(b"nothing more")).content == b"nothing more"


def test_a_non_ascii_secret_inside_text_leaves_valid_utf8():
    flow = tflow.twebsocketflow(messages=[])
    wsredact.REDACTORS[flow] = Redactor([b"\xa9key-1"])  # starts inside a character
    out = _deliver(flow, _server("x\u00a9key-1".encode()))
    assert b"\xa9key-1" not in out.content
    out.content.decode("utf-8")


def test_the_message_history_is_not_kept():
    flow = _flow(_server(b"a"), _server(b"b"))
    _deliver(flow, _server(b"c"))
    assert [m.content for m in flow.websocket.messages] == [b"c"]


def test_control_frames_holding_a_form_carry_only_the_mark():
    redactor = Redactor([SECRET])
    close = wsredact._redact_control(
        ev.CloseConnection(1000, "bad " + SECRET.decode()), redactor, b""
    )
    assert (close.code, close.reason) == (1000, MARK.decode())
    assert wsredact._redact_control(ev.Ping(SECRET), redactor, b"").payload == MARK
    assert wsredact._redact_control(ev.Pong(b"x" + SECRET), redactor, b"").payload == MARK
    kept = ev.CloseConnection(1000, "bye")
    assert wsredact._redact_control(kept, redactor, b"") is kept


def test_the_proxy_hook_fails_closed(monkeypatch):
    from tests.fakes import Chain, StaticLive, make_policy

    def boom(flow):
        raise RuntimeError("redaction broke")

    addon = Chain(StaticLive(make_policy()))
    monkeypatch.setattr(wsredact, "on_message", boom)
    flow = _flow(_server(SECRET))
    addon.websocket_message(flow)
    assert flow.websocket.messages[-1].dropped and wsredact.killed(flow)


def test_a_control_frame_ending_a_form_the_messages_began_carries_only_the_mark():
    redactor = Redactor([SECRET])
    half = len(SECRET) // 2
    ping = wsredact._redact_control(ev.Ping(SECRET[half:]), redactor, SECRET[:half])
    assert ping.payload == MARK
