"""TLS and upstream pinning: the upstream SNI is the granted name, whatever the agent says.

The client's SNI is compared with its tunnel's host (a mismatch refuses every request in
it, addon/core/verdict.py); the proxy's own TLS listener speaks HTTP/1.1 only; an upstream
connection is made only for an allowed request, with that request's host as its SNI.
A failing hook here marks the connection broken (every request on it is refused) or
refuses the upstream connection.
"""

from __future__ import annotations

from mitmproxy import tls
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layer import Layer
from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.layers.tls import ClientTLSLayer

from addon.observe import audit
from addon.proxy.state import Clients
from store.rules.grammar import BadAuthority, is_ip, normalize_host


class Pinning:
    def __init__(self, clients: Clients) -> None:
        self.clients = clients

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        client = data.context.client
        try:
            tunnel = self.clients.tunnel(client)
            if tunnel is None:
                return
            # Upstream SNI is the tunnel's host, whatever the client's hello names.
            data.context.server.sni = tunnel.host
            sni = data.client_hello.sni
            if sni is None:
                tunnel.sni_mismatch = not is_ip(tunnel.host)
            else:
                try:
                    tunnel.sni_mismatch = normalize_host(sni) != tunnel.host
                except BadAuthority:
                    tunnel.sni_mismatch = True
        except Exception as e:  # noqa: BLE001 - fail closed: every request on it is denied
            audit.logger().error("hook.failed", hook="tls_clienthello", error_type=type(e).__name__)
            self.clients.state(client).broken = True

    def tls_start_client(self, data: tls.TlsData) -> None:
        """TLS to the proxy's own listener speaks HTTP/1.1 only, never HTTP/2.

        On an HTTP/2 connection to the proxy, mitmproxy shares one client and one server
        connection object between all CONNECT streams: a principal, a tunnel or an SNI bound
        to the connection would be another stream's. One CONNECT per connection keeps them
        apart. (mitmproxy means to force this too, but its check misses our layer stack.)
        """
        client = data.context.client
        try:
            if _is_tls_to_the_proxy(data.context.layers):
                assert data.ssl_conn is not None
                data.ssl_conn.get_app_data()["client_alpn"] = b"http/1.1"
        except Exception as e:  # noqa: BLE001 - fail closed: every request on it is denied
            audit.logger().error(
                "hook.failed", hook="tls_start_client", error_type=type(e).__name__
            )
            self.clients.state(client).broken = True

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            assert data.server.address is not None
            host, port = data.server.address
            state = self.clients.get(data.client)
            name = state.upstream.get((host, port)) if state is not None else None
            if name is None:
                # Every upstream connection follows an allowed request; anything else is a bug.
                data.server.error = "credproxy: no allowed request for this connection"
                return
            data.server.sni = name
        except Exception as e:  # noqa: BLE001 - fail closed: the connection is not made
            audit.logger().error("hook.failed", hook="server_connect", error_type=type(e).__name__)
            data.server.error = "credproxy: internal error"


def _is_tls_to_the_proxy(layers: list[Layer]) -> bool:
    """Is the client TLS being set up the proxy's own, not a tunnel's (no HTTP layer before it)?

    The HTTP layer above this TLS layer may already be in the list; only what precedes the
    last client TLS layer tells.
    """
    last = max(i for i, layer in enumerate(layers) if isinstance(layer, ClientTLSLayer))
    return not any(isinstance(layer, HttpLayer) for layer in layers[:last])
