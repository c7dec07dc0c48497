"""Redaction of WebSocket traffic on a stamped handshake: messages, close reasons, pings.

mitmproxy reassembles a fragmented message before the `websocket_message` hook, which
redacts it whole. A form split across two messages cannot be unsent: the first part (a
proper prefix of a form at most) has gone out, so the second is dropped and the connection
closed. Control frames (close, ping, pong) pass no hook and are forwarded before
`websocket_end`: `server_events` redacts them first, in the WebSocket layer that
addon/mitm/websocket.py gives mitmproxy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import wsproto.events
from mitmproxy import flow as mflow
from mitmproxy import http

from addon.redaction.redact import MARK, Redactor, Unredactable

# Held beside the flow, never in flow.metadata (mitmproxy serialises metadata).
REDACTORS: weakref.WeakKeyDictionary[http.HTTPFlow, Redactor] = weakref.WeakKeyDictionary()
# The largest message (either direction) mitmproxy may gather before the connection is closed.
MESSAGE_LIMIT = 8 * 1024 * 1024
# The end of the last server message sent that could begin a form.
_TAILS: weakref.WeakKeyDictionary[http.HTTPFlow, bytes] = weakref.WeakKeyDictionary()


class SplitSecret(Exception):
    """A form of the secret spans two server messages."""


def on_message(flow: http.HTTPFlow) -> None:
    """Redact the server message mitmproxy is about to relay; raises SplitSecret."""
    assert flow.websocket is not None
    messages = flow.websocket.messages
    message = messages[-1]
    # mitmproxy keeps every message of a connection; nothing here needs the older ones.
    del messages[:-1]
    if killed(flow):
        message.drop()
        return
    redactor = REDACTORS.get(flow)
    if message.from_client or redactor is None:
        return
    if redactor.spans(_TAILS.get(flow, b""), message.content):
        raise SplitSecret("a secret form spans two messages")
    out = redactor.whole(message.content)
    if message.is_text and out is not message.content:
        # A non-ASCII secret may cut a character: send valid UTF-8, redacted again.
        out = redactor.whole(out.decode("utf-8", "replace").encode())
    message.content = out
    # The tail of everything sent so far, not of this message alone: a form may be spread
    # over three messages or more.
    sent = _TAILS.get(flow, b"") + out
    hold = redactor.partial(sent)
    _TAILS[flow] = sent[len(sent) - hold :] if hold else b""


def kill(flow: http.HTTPFlow) -> None:
    """Fail closed: drop the message in hand and end the connection."""
    if flow.websocket is not None and flow.websocket.messages:
        flow.websocket.messages[-1].drop()
    if flow.killable:
        flow.kill()


def killed(flow: http.HTTPFlow) -> bool:
    return flow.error is not None and flow.error.msg == mflow.Error.KILLED_MESSAGE


def server_events(
    flow: http.HTTPFlow, read: Callable[[], Iterator[wsproto.events.Event]]
) -> Callable[[], Iterator[wsproto.events.Event]]:
    """The server's events as they are relayed: none once the flow is killed, and on a
    stamped flow control frames redacted."""
    redactor = REDACTORS.get(flow)

    def redacted() -> Iterator[wsproto.events.Event]:
        for ev in read():
            if killed(flow):
                return  # nothing more from the server once the flow is dead
            if redactor is None:
                yield ev
            else:
                yield _redact_control(ev, redactor, _TAILS.get(flow, b""))

    return redacted


def _holds(redactor: Redactor, data: bytes) -> bool:
    try:
        return redactor.whole(data) != data
    except Unredactable:
        return True


def _redact_control(
    ev: wsproto.events.Event, redactor: Redactor, tail: bytes
) -> wsproto.events.Event:
    """A control frame with a form in it, or ending one the messages began, goes on with
    MARK as its whole payload."""

    def holds(payload: bytes) -> bool:
        return _holds(redactor, payload) or redactor.spans(tail, payload)

    if isinstance(ev, wsproto.events.CloseConnection):
        if ev.reason and holds(ev.reason.encode("utf-8", "surrogateescape")):
            return wsproto.events.CloseConnection(ev.code, MARK.decode())
    elif isinstance(ev, wsproto.events.Ping | wsproto.events.Pong):
        if ev.payload and holds(bytes(ev.payload)):
            return type(ev)(payload=MARK)
    return ev
