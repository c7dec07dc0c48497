"""The WebSocket layer of a stamped handshake: control frames redacted, messages bounded, kills
honoured.

mitmproxy forwards a server's close, ping and pong frames before any hook runs (only messages
reach `websocket_message`), gathers a fragmented message's frames with no limit, and does not
end a WebSocket on `flow.kill()`. `install()` makes mitmproxy's HTTP layer upgrade to
RedactingWebsocketLayer instead of mitmproxy's `WebsocketLayer` (HttpStream looks the class up
on its module at each upgrade), and sends a message as one frame. What is redacted, and how,
is addon/redaction/wsredact.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers import websocket as ws_layer

from addon.mitm import once
from addon.redaction.wsredact import MESSAGE_LIMIT, kill, killed, server_events

_Base = ws_layer.WebsocketLayer


class RedactingWebsocketLayer(_Base):
    """mitmproxy's layer, with the server's control frames redacted, kills honoured and
    messages bounded."""

    def _sides(self) -> tuple[Any, ...]:
        return (self.client_ws, self.server_ws)

    def _start(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from _Base.start(self, event)
        self.server_ws.events = server_events(self.flow, self.server_ws.events)  # type: ignore[method-assign]

    _handle_event: Callable[..., Any] = _start

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().relay_messages(event)
        # mitmproxy gathers a message's frames until its last one: bound what it gathers.
        if any(sum(map(len, ws.frame_buf)) > MESSAGE_LIMIT for ws in self._sides()):
            kill(self.flow)
        # flow.kill() alone does not end a WebSocket in mitmproxy: close both sides.
        if killed(self.flow) and self._handle_event != self.done:
            yield commands.CloseConnection(self.context.client)
            yield commands.CloseConnection(self.context.server)
            self._handle_event = self.done


@once
def install() -> None:
    """Make mitmproxy's HTTP layer upgrade to RedactingWebsocketLayer.

    Raises: RuntimeError if mitmproxy's WebSocket layer no longer has the shape replaced here.
    """
    if not (
        callable(getattr(_Base, "start", None))
        and callable(getattr(_Base, "relay_messages", None))
        and isinstance(getattr(ws_layer.Fragmentizer, "FRAGMENT_SIZE", None), int)
    ):
        raise RuntimeError("mitmproxy's WebSocket layer changed: messages cannot be redacted")
    ws_layer.WebsocketLayer = RedactingWebsocketLayer  # type: ignore[misc]
    # A redacted message changes length and is re-fragmented; mitmproxy decodes each text
    # fragment alone, which would break a character cut at a fragment boundary. One frame.
    ws_layer.Fragmentizer.FRAGMENT_SIZE = 2**62
