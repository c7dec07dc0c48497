"""An HTTP/2 request body forwarded over HTTP/1 always has a framing.

HTTP/2 frames a body by itself, so a request may come without `Content-Length`. mitmproxy's
HTTP/1 client then writes the head with neither length nor chunking and the body after it:
the upstream reads the body as the next request, one no grant allowed and no audit line
names. `install()` makes such a request chunked before its head is written, and drops its
`TE: trailers`: credproxy refuses trailers over HTTP/1, so none is invited (addon/mitm/hop.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any

from mitmproxy.proxy.layers.http._events import RequestHeaders
from mitmproxy.proxy.layers.http._http1 import Http1Client

from addon.mitm import once

_CONVERTS = "Convert to an HTTP/1 request."


@once
def install() -> None:
    """Wrap Http1Client.send; raises if mitmproxy changed it."""
    original = Http1Client.send
    if _CONVERTS not in inspect.getsource(original):
        raise RuntimeError("mitmproxy changed: Http1Client.send")
    Http1Client.send = _framed(original)  # type: ignore[method-assign]


def unframed(request: Any, end_stream: bool) -> bool:
    """Does this request carry a body that HTTP/1 could not delimit?"""
    if end_stream or not (request.is_http2 or request.is_http3):
        return False
    return "content-length" not in request.headers and "transfer-encoding" not in request.headers


def _framed(original: Callable[..., Generator[Any, Any, None]]) -> Callable[..., Any]:
    # Not a generator itself: it hands back mitmproxy's, one frame less on every command.
    def send(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, RequestHeaders) and (event.request.is_http2 or event.request.is_http3):
            if unframed(event.request, event.end_stream):
                # The client sees this request object as its own: its chunks are framed too.
                event.request.headers["transfer-encoding"] = "chunked"
            event.request.headers.pop("te", None)
        return original(self, event)

    return send
