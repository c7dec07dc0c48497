"""Client certificates (scheme mtls): an upstream connection carries one grant's certificate
for one host, and serves no request that wants another certificate, or none.

mitmproxy picks an upstream connection for a request by address, TLS and upstream proxy
alone (`GetHttpConnection.connection_spec_matches`), inside `HttpLayer.get_connection`; no
hook sees that choice, and its one client certificate is a global option. Patched here, for
mitmproxy 11: `get_connection` (wrapping addon/mitm/reuse.py's) notes what the request's flow
presents (addon/schemes/mtls.py's CLIENT_CERTS) on its command and on the connection it
opens, and `connection_spec_matches` also wants the two to be the same (both none included).
Such a connection is never dialled by reuse.py (so never parked for another client
connection): mitmproxy's TLS layer opens it, and `ClientCerts.tls_start_server`, after
mitmproxy's tlsconfig, puts the certificate on that one TLS connection.

In TLS 1.3 the upstream refuses a client certificate (or its absence) after the client's
handshake is done: mitmproxy's `TLSLayer.receive_data` only logs the alert (and its
`receive_close` then takes the close for one already passed on: the request waited for ever;
the wrapper here passes it on), or the alert is lost to the reset of a socket closed with the
request unread. So `HttpStream.handle_protocol_error` (around addon/mitm/wire.py's)
words a request's failure as upstream-tls-client-cert-refused when its connection got such an
alert (noted by the wrapper of `receive_data`), or presented a certificate and was closed
before it answered anything. The alert's text is never passed on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

from mitmproxy import connection, ctx, tls
from mitmproxy.addons.tlsconfig import _default_ciphers
from mitmproxy.net import tls as net_tls
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as layers
from mitmproxy.proxy.layers import tls as tls_layers
from mitmproxy.proxy.layers.http._events import ResponseProtocolError
from OpenSSL import SSL, crypto

from addon.core.reasons import Reason
from addon.mitm import once, wire
from addon.observe import audit
from addon.schemes.mtls import CLIENT_CERTS, Presented

# On a GetHttpConnection command: what the request's connection must present (or None).
_WANTS = "_credproxy_client_cert"
# The certificate each upstream connection was opened to present.
HOLDS: WeakKeyDictionary[connection.Server, Presented] = WeakKeyDictionary()
# Server connections the upstream sent a client-certificate alert on, after the handshake.
REFUSED: WeakSet[connection.Server] = WeakSet()
# Connections presenting a certificate that the upstream answered on (it took the certificate).
ANSWERED: WeakSet[connection.Server] = WeakSet()
# The failures of a connection closed before its first answer.
_CLOSED = frozenset({"closed-before-response", "connection-reset", "truncated-head"})
REFUSAL = wire.Failure(Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED, "client-cert-refused")
MAX_CONTEXTS = 64


def wants(event: Any) -> bool:
    """Does this connection request want a client certificate?"""
    return getattr(event, _WANTS, None) is not None


class ClientCerts:
    """The addon: the certificate on the TLS of each connection opened for one."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[Any, ...], SSL.Context] = {}

    def tls_start_server(self, data: tls.TlsData) -> None:
        found = HOLDS.get(data.conn) if isinstance(data.conn, connection.Server) else None
        if found is None:
            return
        try:
            assert data.ssl_conn is not None
            # The certificate, its chain and key on this connection only: mitmproxy's
            # context is cached and shared by every upstream connection.
            data.ssl_conn.set_context(self._context(found))
        except Exception as e:  # noqa: BLE001 - fail closed: no TLS, the connection fails
            audit.logger().error(
                "hook.failed", hook="tls_start_server", error_type=type(e).__name__
            )
            data.ssl_conn = None

    def responseheaders(self, flow: Any) -> None:
        if flow.server_conn in HOLDS:
            ANSWERED.add(flow.server_conn)

    def done(self) -> None:
        self._contexts.clear()

    def _context(self, found: Presented) -> SSL.Context:
        """A context as mitmproxy's for the upstream (the same trust), with the certificate.

        The connection keeps its own verification, name, ciphers and versions; the new
        context gives it the certificate, chain and key, and the trust it verifies against.
        """
        options = ctx.options
        verify = net_tls.Verify.VERIFY_NONE if options.ssl_insecure else net_tls.Verify.VERIFY_PEER
        minimum = net_tls.Version[options.tls_version_server_min]
        ciphers = options.ciphers_server.split(":") if options.ciphers_server else None
        settings = dict(
            method=net_tls.Method.TLS_CLIENT_METHOD,
            min_version=minimum,
            max_version=net_tls.Version[options.tls_version_server_max],
            cipher_list=tuple(ciphers or _default_ciphers(minimum)),
            ecdh_curve=options.tls_ecdh_curve_server,
            verify=verify,
            ca_path=options.ssl_verify_upstream_trusted_confdir,
            ca_pemfile=options.ssl_verify_upstream_trusted_ca,
            client_cert=None,
            legacy_server_connect=options.ssl_insecure,
        )
        key = (found.tag[1], found.tag[2], *sorted(settings.items(), key=lambda i: i[0]))
        context = self._contexts.get(key)
        if context is None:
            # Not mitmproxy's cached function: this context is this credential's alone.
            context = net_tls.create_proxy_server_context.__wrapped__(**settings)
            chain = found.cert.chain
            context.use_certificate(crypto.X509.from_cryptography(chain[0]))
            for cert in chain[1:]:
                context.add_extra_chain_cert(crypto.X509.from_cryptography(cert))
            context.use_privatekey(crypto.PKey.from_cryptography_key(found.cert.key))
            context.check_privatekey()
            if len(self._contexts) >= MAX_CONTEXTS:
                self._contexts.clear()
            self._contexts[key] = context
        return context


@once
def install() -> None:
    """Patch mitmproxy; raises RuntimeError if what is patched changed shape."""
    source = inspect.getsource(layers.HttpLayer)  # the method itself is reuse.py's by now
    for needed in ("self.connections[context.server]", "connection_spec_matches"):
        if needed not in source:
            raise RuntimeError("mitmproxy changed: HttpLayer.get_connection")
    if "self.address == connection.address" not in inspect.getsource(
        layers.GetHttpConnection.connection_spec_matches
    ):
        raise RuntimeError("mitmproxy changed: GetHttpConnection.connection_spec_matches")
    if "TLS Error" not in inspect.getsource(tls_layers.TLSLayer.receive_data):
        raise RuntimeError("mitmproxy changed: TLSLayer.receive_data")
    tls_layers.TLSLayer.receive_data = _alerts(  # type: ignore[method-assign]
        tls_layers.TLSLayer.receive_data
    )
    layers.HttpStream.handle_protocol_error = _refusals(  # type: ignore[method-assign]
        layers.HttpStream.handle_protocol_error
    )
    layers.HttpLayer.get_connection = _get_connection(  # type: ignore[method-assign]
        layers.HttpLayer.get_connection
    )
    layers.GetHttpConnection.connection_spec_matches = _matches(  # type: ignore[method-assign]
        layers.GetHttpConnection.connection_spec_matches
    )


def _matches(original: Callable[..., bool]) -> Callable[..., bool]:
    def connection_spec_matches(self: Any, conn: Any) -> bool:
        if not original(self, conn):
            return False
        want: Presented | None = getattr(self, _WANTS, None)
        held = HOLDS.get(conn)
        if want is None or held is None:
            return want is None and held is None
        return want.tag == held.tag

    return connection_spec_matches


def _get_connection(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_connection(self: Any, event: Any, *, reuse: bool = True) -> Generator[Any, Any, Any]:
        source = self.command_sources.get(event)
        flow = getattr(source, "flow", None)
        want = CLIENT_CERTS.get(flow) if flow is not None else None
        if want is None:
            return (yield from original(self, event, reuse=reuse))
        setattr(event, _WANTS, want)
        before = set(self.connections)
        for command in original(self, event, reuse=reuse):
            _claim(self.connections, before, want)
            yield command
        _claim(self.connections, before, want)
        return None

    return get_connection


def _claim(connections: dict[Any, Any], before: set[Any], want: Presented) -> None:
    """A connection opened for this request presents its certificate."""
    for server in connections.keys() - before:
        if server not in HOLDS:
            HOLDS[server] = want


def alerted(server: connection.Server, text: str) -> None:
    """A TLS error on an upstream connection after its handshake: a client-certificate alert
    marks it (OpenSSL's words, as mitmproxy's log or Python's SSLError give them)."""
    text = text.lower().replace("_", " ")
    if any(f"alert {a}" in text for a in wire.CLIENT_CERT_ALERTS):
        REFUSED.add(server)


def _alerts(original: Callable[..., Any]) -> Callable[..., Any]:
    def receive_data(self: Any, data: bytes) -> Generator[Any, Any, None]:
        failed = False
        for command in original(self, data):
            if (
                isinstance(command, commands.Log)
                and isinstance(self.conn, connection.Server)
                and command.message.startswith("TLS Error")
            ):
                alerted(self.conn, command.message)
                failed = True
            yield command
        if (
            failed
            and self.tls.get_shutdown() & SSL.RECEIVED_SHUTDOWN
            and self.conn.state & connection.ConnectionState.CAN_READ
        ):
            # A fatal alert sets this flag, which mitmproxy's receive_close takes for a close
            # already passed on: the request would wait for ever. Passed on here, once.
            self.conn.state &= ~connection.ConnectionState.CAN_READ
            yield from self.event_to_child(events.ConnectionClosed(self.conn))

    return receive_data


def _refusals(original: Callable[..., Any]) -> Callable[..., Any]:
    def handle_protocol_error(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, ResponseProtocolError) and _refused(self.flow.server_conn, event):
            event.message = REFUSAL.message
        yield from original(self, event)

    return handle_protocol_error


def _refused(server: connection.Server, event: Any) -> bool:
    if server in REFUSED:
        return True
    return (
        server in HOLDS and server not in ANSWERED and wire.classify(event.message).error in _CLOSED
    )
