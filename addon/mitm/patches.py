"""Every patch of mitmproxy's internals, installed in the order they wrap each other."""

from __future__ import annotations

from collections.abc import Callable

from addon.mitm import (
    bounds,
    clientcerts,
    connects,
    emptydata,
    framing,
    hop,
    refusals,
    reuse,
    websocket,
    wire,
)

# Where two patches replace the same function, the later one wraps the earlier: reuse wraps
# connects' ConnectionHandler.open_connection, and bounds wraps what wire replaced of
# Http1Client.read_headers, HttpStream.handle_protocol_error and Http2Server._handle_event;
# clientcerts wraps reuse's HttpLayer.get_connection (it marks what reuse must not dial).
# emptydata wraps what bounds replaced of HttpStream.state_stream_response_body, so an empty
# piece is dropped before anything sees it.
ORDER = (wire, connects, reuse, clientcerts, framing, hop, refusals, bounds, emptydata, websocket)


def install_all(*above: Callable[[], None]) -> None:
    """Install every patch here, then `above`: the installs of patches that live beside the
    state they read in a higher wing (addon/proxy/signing.py), each wearing `@once` too.

    Raises: RuntimeError if mitmproxy changed the shape of anything a patch replaces.
    """
    for patch in ORDER:
        patch.install()
    for install in above:
        install()
