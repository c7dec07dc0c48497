"""A request refused in `requestheaders` is answered at once; its body is never held.

mitmproxy reads the whole body of a request whose response an addon set in `requestheaders`
into memory before it sends that response (`HttpStream.state_consume_request_body`, no
limit): a 192 MiB POST to a path that is not granted grew the proxy by 191 MiB. There is no
hook for this, so `install()` wraps the one state method that leads there.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from mitmproxy.proxy import commands
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._hooks import HttpResponseHeadersHook

from addon.mitm import once


@once
def install() -> None:
    """Wrap HttpStream's request-head state; raises if mitmproxy changed shape."""
    original = HttpStream.state_wait_for_request_headers
    for name in ("state_consume_request_body", "state_errored", "send_response", "check_killed"):
        if not callable(getattr(HttpStream, name, None)):
            raise RuntimeError(f"mitmproxy's HttpStream has no {name}: refusals cannot be bounded")

    def state_wait_for_request_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from original(self, event)
        if (
            not event.end_stream
            and self.flow.response is not None
            and self.client_state == self.state_consume_request_body
        ):
            yield from answer_now(self)

    HttpStream.state_wait_for_request_headers = state_wait_for_request_headers  # type: ignore[method-assign]


def answer_now(stream: Any) -> Generator[Any, Any, None]:
    """Send the refusal before the body, then drop the body as it arrives."""
    stream.client_state = stream.state_errored  # consumes every later event, holds nothing
    stream.flow.response.timestamp_start = time.time()
    yield HttpResponseHeadersHook(stream.flow)
    if (yield from stream.check_killed(True)):
        return
    yield from stream.send_response()
    stream.flow.live = False
    if not (stream.flow.request.is_http2 or stream.flow.request.is_http3):
        # FIN after the answer, and keep reading (and dropping) what the client still sends,
        # so that it sees the answer instead of a reset.
        yield commands.CloseTcpConnection(stream.context.client, half_close=True)
