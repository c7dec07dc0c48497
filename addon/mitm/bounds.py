"""Bounds where mitmproxy has no hook: a head still arriving, a stream's error, an h2 queue,
a response body's reads.

`install()` patches mitmproxy's layers once per process: a client's first bytes count as a
head read while the next_layer hook runs, a request or response head
longer than HEAD_LIMIT is refused, a stream the sweeper (addon/proxy/limits.py) cut off answers
504 with a fixed message, an HTTP/2 client that stops reading has its stream reset once too
much is held for it, and each piece of a response body that arrives, held whole or streamed,
is reported (`HttpStream`'s two body states; mitmproxy calls no hook for a body held whole),
so that a response still flowing is not cut as a stall. It checks h2's own limits and raises
at start if they changed.

mitmproxy's layers and h2 are imported inside the functions that patch them, not at the top:
addon/proxy/limits.py reads this module's constants, and every CLI command that builds the
`run` parser imports that module.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from addon.core.reasons import STATUS, Reason
from addon.mitm import once
from addon.observe import audit
from addon.observe.problem import problem

if TYPE_CHECKING:
    from mitmproxy import connection

# A request or response head (line and headers) may be this long; HTTP/2 header lists are
# bounded by h2 itself (64 KiB decoded, 64 CONTINUATION frames), see `H2_LIMITS`.
HEAD_LIMIT = 64 * 1024
# What h2 (4.1) enforces per client connection, checked at install so an upgrade cannot
# silently change it: a 101st concurrent stream ends the connection with PROTOCOL_ERROR.
H2_LIMITS = {"max_concurrent_streams": 100, "max_header_list_size": 64 * 1024}
# What the proxy holds for an HTTP/2 client that stops reading (its flow-control window kept
# closed): over this per stream, or over the second bound for the whole connection, the stream
# is reset and the upstream connection closed. HTTP/1 needs none: mitmproxy stops reading the
# upstream while the client's socket buffer is full.
H2_STREAM_BUFFER = 1024 * 1024
H2_CONNECTION_BUFFER = 8 * 1024 * 1024
TIMEOUT_PREFIX = "upstream timeout"

# Flows and upstream connections the sweeper cut off, and why; read by the patched layers.
timed_out_flows: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
timed_out_servers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# Called with the client connection when an HTTP/1 request head starts arriving.
on_head_started: list[Callable[[Any], None]] = []
# Called with the client connection whenever bytes of a request head are read.
on_head_read: list[Callable[[Any], None]] = []
# Called with the flow when a piece of its response body arrives (HTTP/1 and HTTP/2).
on_response_data: list[Callable[[Any], None]] = []


@once
def install() -> None:
    """Patch mitmproxy's layers; raises RuntimeError if h2's limits or their shape changed."""
    import h2.config
    import h2.connection
    import h2.frame_buffer
    from mitmproxy.proxy import layer
    from mitmproxy.proxy.layers import tls as tls_layer
    from mitmproxy.proxy.layers.http import HttpStream, _http1, _http2

    settings = h2.connection.H2Connection(h2.config.H2Configuration()).local_settings
    actual = {name: getattr(settings, name) for name in H2_LIMITS}
    if actual != H2_LIMITS or h2.frame_buffer.CONTINUATION_BACKLOG != 64:
        raise RuntimeError(f"h2's limits changed: {actual}")
    layer.NextLayer._handle_event = _reading_first(layer.NextLayer._handle_event)  # type: ignore[method-assign]
    server, client = _http1.Http1Server, _http1.Http1Client
    server.read_headers = _bounded_head(server.read_headers, _refuse_request_head)  # type: ignore[method-assign]
    client.read_headers = _bounded_head(client.read_headers, _refuse_response_head)  # type: ignore[method-assign]
    HttpStream.handle_protocol_error = _timeout_answer(HttpStream.handle_protocol_error)  # type: ignore[method-assign]
    _http2.Http2Server._handle_event = _bounded_h2_buffer(_http2.Http2Server._handle_event)  # type: ignore[method-assign]
    tls_layer.ServerTLSLayer._handshake_finished = _timeout_handshake(  # type: ignore[method-assign]
        tls_layer.ServerTLSLayer._handshake_finished
    )
    HttpStream.state_consume_response_body = _reporting_body(  # type: ignore[method-assign]
        HttpStream.state_consume_response_body
    )
    HttpStream.state_stream_response_body = _reporting_body(  # type: ignore[method-assign]
        HttpStream.state_stream_response_body
    )


def _head_complete(buf: Any) -> bool:
    """Does a complete head start within the first HEAD_LIMIT bytes of this buffer?"""
    from h11._receivebuffer import blank_line_regex

    return blank_line_regex.search(buf._data, 0, HEAD_LIMIT + 3) is not None


def _reading_first(handle_event: Any) -> Any:
    """A client's first bytes wait in mitmproxy's NextLayer while the next_layer hook runs in
    its own task, read from the socket but not yet by the HTTP layer: they count as read here,
    so a burst of connections accepted meanwhile does not displace this one as silent."""
    from mitmproxy.proxy import events

    @functools.wraps(handle_event)
    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        if isinstance(event, events.DataReceived) and event.connection is self.context.client:
            for read in on_head_read:
                read(event.connection)
        yield from handle_event(self, event)

    return wrapper


def _bounded_head(read_headers: Any, refuse: Any) -> Any:
    from mitmproxy.proxy import events

    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        if isinstance(event, events.DataReceived) and refuse is _refuse_request_head:
            for read in on_head_read:  # before the head goes through the hooks
                read(self.conn)
        if (
            isinstance(event, events.DataReceived)
            and len(self.buf) > HEAD_LIMIT
            and not _head_complete(self.buf)
        ):
            yield from refuse(self)
            return
        yield from read_headers(self, event)
        if self.state == self.read_headers and self.buf:  # a head still arriving
            if len(self.buf) > HEAD_LIMIT:
                # h11 drops one leading empty line per read: a CRLF flood grows the buffer too.
                yield from refuse(self)
            elif refuse is _refuse_request_head:
                for started in on_head_started:
                    started(self.conn)

    return wrapper


def _end(self: Any) -> None:
    from h11._receivebuffer import ReceiveBuffer

    self.state = self.done
    self.buf = ReceiveBuffer()  # free what was held now, not when the connection goes


def _refuse_request_head(self: Any) -> Iterator[Any]:
    from mitmproxy.proxy import commands

    reason = Reason.REQUEST_TOO_LARGE
    detail = f"the request line and headers exceed {HEAD_LIMIT // 1024} KiB"
    yield commands.SendData(self.conn, _deny_bytes(reason, detail))
    yield commands.CloseConnection(self.conn)
    _end(self)
    audit_refusal(self.conn, reason, detail)


def _refuse_response_head(self: Any) -> Iterator[Any]:
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    yield commands.CloseConnection(self.conn)
    if self.stream_id is not None:
        # Worded as mitmproxy's own parse failures, so that error classifiers treat it alike.
        message = f"Cannot parse HTTP response: head exceeds {HEAD_LIMIT // 1024} KiB"
        yield ReceiveHttp(ResponseProtocolError(self.stream_id, message, 502))
    _end(self)


def _deny_bytes(reason: Reason, detail: str) -> bytes:
    """A whole HTTP/1 deny response, closing the connection, as the proxy's hooks write it."""
    return problem(reason, detail, close=True).http1()


def _timeout_answer(handle: Any) -> Any:
    """A stream the sweeper cut off answers 504 with a fixed message, whatever the socket said."""
    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        if isinstance(event, ResponseProtocolError):
            flow = getattr(self, "flow", None)
            message = timed_out_flows.pop(flow, None) if flow is not None else None
            if message is None and event.message.startswith(TIMEOUT_PREFIX):
                message = event.message
            if message is not None:
                code = STATUS[Reason.UPSTREAM_TIMEOUT]
                event = ResponseProtocolError(self.stream_id, message, code)
        yield from handle(self, event)

    return wrapper


def _reporting_body(state: Any) -> Any:
    """One of `HttpStream`'s response body states, reporting each piece that arrives."""
    from mitmproxy.proxy.layers.http._events import ResponseData

    @functools.wraps(state)
    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        if isinstance(event, ResponseData):
            for arrived in on_response_data:
                arrived(self.flow)
        yield from state(self, event)

    return wrapper


def _buffered(buffer: Any, frame: int, limit: int) -> bool:
    """Is more than `limit` queued in these deques of frames (each at most `frame` long)?"""
    if sum(map(len, buffer)) * frame <= limit:  # cheap upper bound first
        return False
    return sum(len(item.data) for queue in buffer for item in queue) > limit


def _bounded_h2_buffer(handle: Any) -> Any:
    """Reset a stream whose client stopped reading once too much is held for it."""
    import h2.errors
    from mitmproxy.net.http import status_codes
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import RequestProtocolError, ResponseData

    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        yield from handle(self, event)
        if not isinstance(event, ResponseData):
            return
        sid, conn = event.stream_id, self.h2_conn
        queue = conn.stream_buffers.get(sid)
        if not queue:  # the client keeps up: the common case costs this lookup
            return
        frame = conn.max_outbound_frame_size
        if not (
            _buffered((queue,), frame, H2_STREAM_BUFFER)
            or _buffered(conn.stream_buffers.values(), frame, H2_CONNECTION_BUFFER)
        ):
            return
        conn.reset_stream(sid, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)  # drops the queue
        yield commands.SendData(self.conn, conn.data_to_send())
        self.streams.pop(sid, None)
        message = "the client stopped reading: too much buffered for it"
        yield ReceiveHttp(RequestProtocolError(sid, message, status_codes.CLIENT_CLOSED_REQUEST))

    return wrapper


def _timeout_handshake(finished: Any) -> Any:
    def wrapper(self: Any, err: str | None) -> Iterator[Any]:
        if err is not None:
            err = timed_out_servers.get(self.conn, err)
        yield from finished(self, err)

    return wrapper


def audit_refusal(client: connection.Client, reason: Reason, detail: str) -> None:
    """The audit line of a connection refused or closed before any request hook ran."""
    peer = client.peername
    audit.emit(
        audit.REQUEST_EVENT,
        {
            audit.REQUEST_ID: None,
            audit.PRINCIPAL: None,
            audit.CLIENT: f"{peer[0]}:{peer[1]}" if peer else "",
            audit.DECISION: audit.DENY,
            audit.REASON: reason.value,
            audit.DETAIL: detail,
            audit.STATUS: STATUS[reason] if reason is Reason.REQUEST_TOO_LARGE else None,
        },
    )
