"""An empty body piece is not the end of a streamed body.

mitmproxy tells a stream function (`flow.request.stream` / `flow.response.stream` set to a
callable) that a body ended by calling it once with b"" on `RequestEndOfMessage` /
`ResponseEndOfMessage` (`HttpStream.state_stream_request_body` and
`state_stream_response_body`). It also calls it with each `RequestData` / `ResponseData`'s
bytes, and those can be empty: the HTTP/1 layer drops empty pieces (`_http1.py`: `if data:`),
but the HTTP/2 layer passes an empty DATA frame on as one. A stream function then sees the end
mid-body: the redactor flushes the start of a secret it held back, and the rest arrives in the
next piece unredacted; the MCP `tools/list` filter forwards an unfinished event unfiltered.
`install()` drops an empty piece before the body state (and its stream function) sees it.
There is no hook for a streamed body's pieces, so this is a patch.

The WebSocket layer passes whole messages to `websocket_message`, where an empty message is a
message, not an end: nothing to do there.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

from addon.mitm import once

_STATES = ("state_stream_request_body", "state_stream_response_body")


@once
def install() -> None:
    """Wrap HttpStream's two streaming body states; raises if mitmproxy changed them."""
    from mitmproxy.proxy.layers.http import HttpStream
    from mitmproxy.proxy.layers.http._events import (
        RequestData,
        RequestEndOfMessage,
        ResponseData,
        ResponseEndOfMessage,
    )

    ends = {
        "state_stream_request_body": RequestEndOfMessage,
        "state_stream_response_body": ResponseEndOfMessage,
    }
    for name in _STATES:
        state = getattr(HttpStream, name, None)
        source = inspect.getsource(state) if callable(state) else ""
        # The shape relied on: the end is its own event, and it calls the stream with b"".
        if ends[name].__name__ not in source or 'stream(b"")' not in source:
            raise RuntimeError(f"mitmproxy changed: HttpStream.{name}")
    HttpStream.state_stream_request_body = _skipping_empty(  # type: ignore[method-assign]
        HttpStream.state_stream_request_body, RequestData
    )
    HttpStream.state_stream_response_body = _skipping_empty(  # type: ignore[method-assign]
        HttpStream.state_stream_response_body, ResponseData
    )


def _skipping_empty(state: Any, data: type) -> Any:
    @functools.wraps(state)
    def wrapper(self: Any, event: Any) -> Iterator[Any]:
        if isinstance(event, data) and not getattr(event, "data", b"x"):
            return  # an empty piece says nothing; the end comes as its own event
        yield from state(self, event)

    return wrapper
