"""Hop-by-hop fields end at credproxy: each of its two connections is its own to manage.

A proxy removes `Connection`, every field it names, and the other connection-specific fields
before forwarding (RFC 9110, 7.6.1). credproxy does so in both directions: the agent's fields
after the verdict and before stamping (a field the agent names is its own copy, the stamp
comes after), the upstream's before redaction. It sends only its own: `Upgrade` with
`Connection: Upgrade` for a granted WebSocket, `TE: trailers` from an HTTP/2 agent (whose
trailers it forwards). `Host`, `Content-Length` and `Transfer-Encoding` are never removed by
being named: credproxy checks the first and frames bodies by the others.

A `close` belongs to the hop it came on. The upstream's stays on the response as the one
`Connection` field, for mitmproxy's HTTP/1 client to close that connection by; the agent's is
remembered beside its request. `install()` wraps mitmproxy's Http1Server.send so that the
head the agent reads carries credproxy's own `Connection`: `close` when the agent asked for
it, never the upstream's.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from mitmproxy.proxy.layers.http._events import ResponseHeaders
from mitmproxy.proxy.layers.http._http1 import Http1Server

from addon.mitm import once

if TYPE_CHECKING:
    from mitmproxy import http

Fields = tuple[tuple[bytes, bytes], ...]

# Proxy-Authorization is not here: addon/proxy/auth.py consumes it (and refuses another
# principal's).
FIELDS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"proxy-authenticate")
)
NEVER_NAMED = frozenset((b"host", b"content-length", b"transfer-encoding"))
_CLOSE = ((b"connection", b"close"),)

# Requests whose agent asked to close its connection; responses whose upstream did.
_agent_closes: weakref.WeakSet[http.Request] = weakref.WeakSet()
_upstream_closes: weakref.WeakSet[http.Response] = weakref.WeakSet()


def options(fields: Fields) -> frozenset[bytes]:
    """The connection options of every `Connection` field, lower-case."""
    return frozenset(
        token
        for name, value in fields
        if name.lower() == b"connection"
        for token in (part.strip().lower() for part in value.split(b","))
        if token
    )


def strip(fields: Fields, upgrade: bool = False, trailers: bool = False) -> tuple[Fields, bool]:
    """The fields without hop-by-hop ones, and whether the sender asked to close.

    `upgrade` keeps an upgrade the sender asked for (its `Upgrade` fields and one
    `Connection: Upgrade`); `trailers` keeps `TE: trailers` if TE listed it.
    """
    named = options(fields)
    dropped = (FIELDS | named) - NEVER_NAMED
    kept = tuple(f for f in fields if f[0].lower() not in dropped)
    if upgrade and b"upgrade" in named:
        kept += (*(f for f in fields if f[0].lower() == b"upgrade"), (b"connection", b"Upgrade"))
    if trailers and any(
        coding.split(b";")[0].strip().lower() == b"trailers"
        for name, value in fields
        if name.lower() == b"te"
        for coding in value.split(b",")
    ):
        kept += ((b"te", b"trailers"),)
    return kept, b"close" in named


def for_upstream(request: http.Request, websocket: bool) -> None:
    """Strip the agent's hop-by-hop fields from an allowed request; remember its close."""
    fields, close = strip(request.headers.fields, upgrade=websocket, trailers=request.is_http2)
    request.headers.fields = fields
    if close:
        _agent_closes.add(request)


def for_agent(response: http.Response) -> None:
    """Strip the upstream's hop-by-hop fields; a close it asked for stays for its own hop."""
    upgrade = response.status_code == 101
    fields, close = strip(response.headers.fields, upgrade=upgrade)
    if close and not upgrade:
        fields += _CLOSE
        _upstream_closes.add(response)
    response.headers.fields = fields


def agent_head(request: http.Request | None, response: http.Response) -> http.Response:
    """The response as the agent's HTTP/1 connection sends it: with credproxy's `Connection`."""
    closes = request is not None and request in _agent_closes
    if response.status_code < 200 or not (closes or response in _upstream_closes):
        return response
    head = response.copy()
    fields = tuple(f for f in head.headers.fields if f[0].lower() != b"connection")
    head.headers.fields = fields + _CLOSE if closes else fields
    return head


@once
def install() -> None:
    """Wrap Http1Server.send; raises RuntimeError if mitmproxy changed it."""
    original = Http1Server.send
    if "self.response = response = event.response" not in inspect.getsource(original):
        raise RuntimeError("mitmproxy changed: Http1Server.send")
    Http1Server.send = _own_connection(original)  # type: ignore[method-assign]


def _own_connection(original: Callable[..., Generator[Any, Any, None]]) -> Callable[..., Any]:
    # Not a generator itself: it hands back mitmproxy's, one frame less on every command.
    def send(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, ResponseHeaders):
            head = agent_head(self.request, event.response)
            if head is not event.response:
                # Http1Server keeps the head it sent and closes after it by its `Connection`.
                event = ResponseHeaders(event.stream_id, head, event.end_stream)
        return original(self, event)

    return send
