"""One-shot clients pay one handshake, not two: verified upstream connections outlive their client.

An agent that runs `curl` per tool call opens a client connection per request, and mitmproxy
opens (TCP, TLS, certificate check) and closes an upstream connection with each. Here the
upstream connection of an allowed HTTPS request from an HTTP/1 client is made by credproxy,
with TLS in the transport (verified as mitmproxy verifies: the trust bundle, the pinned name,
TLS 1.2 at least), and mitmproxy speaks HTTP/1.1 over it. When its client connection ends
while it is idle (the last response read whole, nothing buffered, kept alive, not cut off by
a deadline), it is parked for the next client connection with the same key: principal, host
name (SNI and certificate), vetted address and ALPN offer. Never across principals.

A parked connection carries nothing of a request (credentials are stamped per request). It
is closed after `idle` seconds, never handed out once the upstream closed it or sent anything
(it is closed then), and not parked beyond PER_KEY per key or TOTAL in all, nor after an
answer that began before its request was sent whole or a non-2xx answer to a request with a
body (the upstream may have left that body unread). HTTP/2 clients keep mitmproxy's own
upstream connections. `install()` patches mitmproxy's HttpLayer.get_connection and
ConnectionHandler.open_connection once, and raises at start-up if either changed shape.

Behind a corporate proxy (`run --upstream-proxy`, addon/mitm/via.py) every upstream
connection is dialled here, mitmproxy's own too (those without TLS in the transport: its TLS
layer then runs inside the tunnel), so that none leaves around the corporate proxy.

One module, about 530 lines: parking, reuse and the dial are one patch of mitmproxy's
connection handling, installed and checked together.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import inspect
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import certifi
from mitmproxy import ctx
from mitmproxy.addons.tlsconfig import _default_ciphers
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.net.tls import Version
from mitmproxy.proxy import events, server_hooks
from mitmproxy.proxy.layers import http as layers
from mitmproxy.proxy.layers.http import HttpClient, HTTPMode
from mitmproxy.proxy.layers.http._http1 import Http1Client
from mitmproxy.proxy.server import ConnectionHandler, ConnectionIO

from addon.mitm import clientcerts, once
from addon.mitm.bounds import timed_out_servers
from addon.mitm.connects import RESET
from addon.mitm.via import ProxyFailed, Route
from addon.observe import audit

if TYPE_CHECKING:
    from mitmproxy import connection, http


class Clients(Protocol):
    """The proxy's table of client connections (addon/proxy/state.py), as far as reuse reads
    it: whose connection it is, and whether it broke."""

    def get(self, client: connection.Client) -> Any: ...


# asyncio's TLS transport reads the socket into a bytearray of SSLProtocol.max_size (256 KiB)
# that each connection allocates (zeroed, so resident) and keeps for its life: 256 KiB of
# every held upstream connection (`bench.memory --trace`), where mitmproxy's own connections
# read into a buffer freed after each read. A smaller buffer costs downloads dearly (32 KiB:
# 0.65-0.74 x streaming mitmproxy against 0.92-0.94). The buffer only carries bytes from
# `recv_into` to `buffer_updated`, which copies them into the connection's MemoryBIO in the
# same call of the event loop (selector_events' _read_ready__get_buffer), so one buffer per
# thread serves every connection of that thread's loop: `_shared_read_buffer`.
_READ_BUFFERS = threading.local()
IDLE = 4.0  # seconds; under the 5 s keep-alive of Node's http server, the shortest common one
PER_KEY = 64
TOTAL = 256
_GONE = "client disconnected"  # mitmproxy's cancel message when the client connection ended
# Options under which credproxy's own TLS would not be mitmproxy's: then mitmproxy dials.
_DEFAULTS = {
    "ssl_insecure": False,
    "client_certs": None,
    "ciphers_server": None,
    "tls_version_server_max": "UNBOUNDED",
    "ssl_verify_upstream_trusted_confdir": None,
    "tls_ecdh_curve_server": None,
}
_MIN_VERSION = {
    "TLS1_2": ssl.TLSVersion.TLSv1_2,
    "TLS1_3": ssl.TLSVersion.TLSv1_3,
}
# The answer to a connection whose dial raised: audited as internal-error (addon/mitm/wire.py).
DIAL_FAILED = "Connection killed: credproxy: dial failed"
CLOSED_IN_HANDSHAKE = "connection closed during the TLS handshake"

Key = tuple[str, str, tuple[str, int], tuple[bytes, ...]]


@dataclass(slots=True)
class _Parked:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    timer: asyncio.TimerHandle | None = None


def offers(client_offers: Any) -> tuple[bytes, ...]:
    """The ALPN offer credproxy makes upstream: one of three, whatever the client listed
    (mitmproxy speaks HTTP/1.1 over the connection). Three offers, three TLS contexts."""
    for name in (b"http/1.1", b"http/1.0"):
        if name in client_offers:
            return (name,)
    return ()


def close(writer: asyncio.StreamWriter) -> None:
    """Close now. asyncio's TLS close would wait up to 30 s for the peer's close_notify,
    holding the socket and its buffers; mitmproxy's own path does not wait either."""
    writer.transport.abort()


def _fresh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Open both ways, and nothing arrived that no request asked for."""
    buffered = getattr(reader, "_buffer", b"x")  # asyncio keeps unread bytes there
    return not (buffered or reader.at_eof() or writer.is_closing() or reader.exception())


class Pool:
    """Idle upstream connections by key, newest first; each closed after `idle` seconds."""

    def __init__(self, idle: float = IDLE, per_key: int = PER_KEY, total: int = TOTAL) -> None:
        self.idle = idle
        self.per_key = per_key
        self.total = total
        self._parked: dict[Key, list[_Parked]] = {}
        self._count = 0
        self.reused = 0  # connections handed out again
        self.parked = 0  # connections parked

    def __len__(self) -> int:
        return self._count

    def take(self, key: Key) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        found = self._parked.get(key)
        while found:
            item = found.pop()
            self._count -= 1
            if item.timer is not None:
                item.timer.cancel()
            if not found:
                del self._parked[key]
            if _fresh(item.reader, item.writer):
                self.reused += 1
                return item.reader, item.writer
            close(item.writer)
        return None

    def give(self, key: Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Park a connection; False if there is no room (the caller closes it)."""
        if self.idle <= 0 or self._count >= self.total or not _fresh(reader, writer):
            return False
        found = self._parked.setdefault(key, [])
        if len(found) >= self.per_key:
            return False
        item = _Parked(reader, writer)
        item.timer = asyncio.get_running_loop().call_later(self.idle, self._expire, key, item)
        found.append(item)
        self._count += 1
        self.parked += 1
        return True

    def _expire(self, key: Key, item: _Parked) -> None:
        found = self._parked.get(key)
        if found is not None and item in found:
            found.remove(item)
            self._count -= 1
            if not found:
                del self._parked[key]
        close(item.writer)

    def clear(self) -> None:
        for found in self._parked.values():
            for item in found:
                if item.timer is not None:
                    item.timer.cancel()
                close(item.writer)
        self._parked.clear()
        self._count = 0


class Reuse:
    """The addon: which connections credproxy dials, its TLS contexts, and the pool."""

    def __init__(
        self,
        clients: Clients,
        idle: float = IDLE,
        connect_timeout: float = 10.0,
        route: Route | None = None,
    ) -> None:
        self.clients = clients
        self.route = route  # the corporate proxy, if there is one
        self.connect_timeout = connect_timeout
        self.pool = Pool(idle)
        self.usable = False  # mitmproxy's TLS options are ones credproxy's TLS matches
        self._cafile: str | None = None
        self._minimum = ssl.TLSVersion.TLSv1_2
        self._minimum_name = "TLS1_2"
        self._contexts: dict[tuple[bytes, ...], ssl.SSLContext] = {}

    # -- mitmproxy hooks -------------------------------------------------------------

    def running(self) -> None:
        self.configure(set())  # options set before credproxy's addons were added

    def configure(self, updated: set[str]) -> None:
        options = ctx.options
        version = getattr(options, "tls_version_server_min", "")
        minimum = _MIN_VERSION.get(version)
        self.usable = minimum is not None and all(
            getattr(options, option, None) == wanted for option, wanted in _DEFAULTS.items()
        )
        cafile = getattr(options, "ssl_verify_upstream_trusted_ca", None)
        if cafile != self._cafile or minimum != self._minimum:
            self._cafile, self._minimum = cafile, minimum or ssl.TLSVersion.TLSv1_2
            self._minimum_name = version if minimum is not None else "TLS1_2"
            self._contexts.clear()
            self.pool.clear()  # verified with the old trust: dial again

    def done(self) -> None:
        self.pool.clear()

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """An answer that began before its request was sent whole, or any answer but a 2xx to
        a request with a body (an error, a redirect): the upstream may not have read that
        body, and would take what is left of it for the next request, which may be another
        client's. Never parked."""
        server = flow.server_conn
        if server not in _layers:
            return
        try:
            request, response = flow.request, flow.response
            assert response is not None
            has_body = "transfer-encoding" in request.headers or request.headers.get(
                "content-length", "0"
            ).strip() not in ("", "0")
            if (
                request.timestamp_end is None
                or response.timestamp_start is None
                or response.timestamp_start < request.timestamp_end
                or (has_body and not 200 <= response.status_code < 300)
            ):
                _spoiled.add(server)
        except Exception as e:  # noqa: BLE001 - fail closed: never parked
            _spoiled.add(server)
            audit.logger().error("hook.failed", hook="reuse", error_type=type(e).__name__)

    # -- used by the patches ---------------------------------------------------------

    def eligible(self, client: connection.Client, event: Any) -> bool:
        """An HTTPS request of an HTTP/1 client, straight to the upstream, presenting no client
        certificate (addon/mitm/clientcerts.py: such a connection is never parked)."""
        return (
            self.usable
            and not clientcerts.wants(event)
            and self.pool.idle > 0
            and event.tls
            and event.via is None
            and event.transport_protocol == "tcp"
            and client.alpn != b"h2"
            and b"h2" not in client.alpn_offers
        )

    def key(self, client: connection.Client, server: connection.Server) -> Key | None:
        """Whose, to which name at which address, offering what; None: not to be shared."""
        state = self.clients.get(client)
        if state is None or state.broken or server.sni is None or server.address is None:
            return None
        principal = state.tunnel.principal if state.tunnel is not None else state.principal
        if principal is None:
            return None
        host, port = server.address
        return principal, server.sni, (host, port), tuple(server.alpn_offers)

    def context(self, offers: tuple[bytes, ...]) -> ssl.SSLContext:
        found = self._contexts.get(offers)
        if found is None:
            found = ssl.create_default_context(cafile=self._cafile or certifi.where())
            found.minimum_version = self._minimum
            found.hostname_checks_common_name = False  # as mitmproxy: the SAN names, never the CN
            found.set_ciphers(":".join(_default_ciphers(Version[self._minimum_name])))
            if offers:
                found.set_alpn_protocols([o.decode("ascii") for o in offers])
            self._contexts[offers] = found
        return found

    async def open(
        self, server: connection.Server, tls: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new connection to the server's vetted address, or through the corporate proxy
        by the name it was pinned for; TLS for that name in the transport if `tls`.

        Raises: OSError, ProxyFailed, ValueError.
        """
        assert server.address is not None
        name = server.sni
        if name is None:
            raise ValueError("no name pinned for this connection")
        context = self.context(tuple(server.alpn_offers)) if tls else None
        # addon/proxy/limits.py's --connect-timeout cuts it first; this is the backstop.
        handshake = self.connect_timeout + 5
        if self.route is not None and not self.route.direct(name, server.address):
            return await self.route.open(name, server.address[1], context, handshake)
        if context is None:
            return await asyncio.open_connection(*server.address)
        return await asyncio.open_connection(
            *server.address,
            ssl=context,
            server_hostname=name,
            ssl_handshake_timeout=handshake,
            ssl_shutdown_timeout=1.0,
        )


_active: Reuse | None = None
# The HttpClient layer of each connection credproxy dials: is it idle? Held weakly both ways:
# the layer refers to its connection, and a strong value would keep the key alive for ever.
_layers: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
# Connections whose last exchange may have left bytes in the upstream (responseheaders).
_spoiled: weakref.WeakSet[Any] = weakref.WeakSet()


def activate(reuse: Reuse | None) -> None:
    global _active
    _active = reuse


@once
def install() -> None:
    """Patch mitmproxy; raises RuntimeError if what is patched changed shape."""
    get_connection = layers.HttpLayer.get_connection
    source = inspect.getsource(get_connection)
    for needed in ("stack /= tls.ServerTLSLayer(context)", "self.waiting_for_establishment"):
        if needed not in source:
            raise RuntimeError("mitmproxy changed: HttpLayer.get_connection")
    for name in ("handle_connection", "drain_writers", "max_conns", "transports"):
        if name not in inspect.getsource(ConnectionHandler):
            raise RuntimeError(f"mitmproxy changed: ConnectionHandler.{name}")
    protocol = asyncio.sslproto.SSLProtocol
    for needed in ("self._ssl_buffer = bytearray(self.max_size)", "self._ssl_buffer_view"):
        if needed not in inspect.getsource(protocol.__init__):
            raise RuntimeError("asyncio changed: SSLProtocol.__init__")
    if "self._incoming.write(self._ssl_buffer_view[:nbytes])" not in inspect.getsource(
        protocol.buffer_updated
    ):
        raise RuntimeError("asyncio changed: SSLProtocol.buffer_updated")
    # Process-wide: credproxy's own TLS connections (this dial, webhooks, token endpoints)
    # are the only asyncio TLS in the process; mitmproxy does TLS with pyOpenSSL.
    protocol.__init__ = _shared_read_buffer(protocol.__init__)  # type: ignore[method-assign]
    layers.HttpLayer.get_connection = _get_connection(get_connection)  # type: ignore[method-assign]
    ConnectionHandler.open_connection = _open_connection(  # type: ignore[method-assign]
        ConnectionHandler.open_connection
    )


def _get_connection(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_connection(self: Any, event: Any, *, reuse: bool = True) -> Generator[Any, Any, Any]:
        active = _active
        if (
            active is None
            or self.mode != HTTPMode.transparent
            or not active.eligible(self.context.client, event)
            or (reuse and any(event.connection_spec_matches(c) for c in self.connections))
            or (
                event.connection_spec_matches(self.context.server)
                and self.context.server not in self.connections
                and (self.context.server.connected or self.context.server.error)
            )
        ):
            return (yield from original(self, event, reuse=reuse))
        # mitmproxy's own steps for a new connection, without its TLS layer: the TLS is in
        # the transport credproxy dials (below).
        context = self.context.fork()
        server = context.server = Server(address=event.address, transport_protocol="tcp")
        server.tls = True
        if event.address == self.context.server.address:
            server.sni = self.context.server.sni or self.context.client.sni or event.address[0]
        else:
            server.sni = event.address[0]  # addon/proxy/pinning.py pins the granted name
        client = self.context.client
        server.alpn_offers = offers(client.alpn_offers)
        stack = HttpClient(context)
        _layers[server] = weakref.ref(stack)
        self.connections[server] = stack
        self.waiting_for_establishment[server].append(event)
        yield from self.event_to_child(stack, events.Start())

    return get_connection


def _shared_read_buffer(original: Callable[..., None]) -> Callable[..., None]:
    """SSLProtocol.__init__, then the thread's one read buffer in place of its own."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        view = getattr(_READ_BUFFERS, "view", None)
        if view is None or len(view) < self.max_size:
            view = _READ_BUFFERS.view = memoryview(bytearray(self.max_size))
        self._ssl_buffer, self._ssl_buffer_view = view.obj, view

    return __init__


def _open_connection(original: Callable[..., Any]) -> Callable[..., Any]:
    async def open_connection(self: Any, command: Any) -> Any:
        active = _active
        if active is None:
            return await original(self, command)
        if command.connection in _layers:
            await _dial(self, command, active, tls=True)
        elif active.route is not None:
            await _dial(self, command, active, tls=False)
        else:
            return await original(self, command)

    return open_connection


async def _dial(handler: Any, command: Any, active: Reuse, tls: bool) -> None:
    """mitmproxy's open_connection, with TLS in the transport and the pool in front of it;
    without `tls`, a plain transport (maybe a tunnel) that mitmproxy's TLS layer runs over,
    never parked."""
    server = command.connection
    hook_data = server_hooks.ServerConnectionHookData(client=handler.client, server=server)
    await handler.handle_hook(server_hooks.ServerConnectHook(hook_data))  # pins the SNI
    if err := server.error:
        await handler.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
        await handler.server_event(
            events.OpenConnectionCompleted(command, f"Connection killed: {err}")
        )
        return
    key = active.key(handler.client, server) if tls else None
    async with handler.max_conns[server.address]:
        server.timestamp_start = time.time()
        taken = active.pool.take(key) if key is not None else None
        try:
            if server.transport_protocol != "tcp":
                raise ValueError("only TCP is dialled")  # http3 is off: never through here
            if taken is None:
                reader, writer = await active.open(server, tls)
            else:
                reader, writer = taken
            peername = writer.get_extra_info("peername")
            if peername is None:  # reset before asyncio set the transport up
                close(writer)
                raise ConnectionResetError(RESET)
        except Exception as e:  # noqa: BLE001 - fail closed: the request gets an answer
            if isinstance(e, ProxyFailed):
                err = str(e)  # a fixed phrase: addon/mitm/via.py
            elif isinstance(e, OSError):
                err = str(e) or CLOSED_IN_HANDSHAKE  # asyncio's bare ConnectionResetError()
            else:
                err = DIAL_FAILED
                audit.logger().error("hook.failed", hook="dial", error_type=type(e).__name__)
            server.error = err
            await handler.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await handler.server_event(events.OpenConnectionCompleted(command, err))
            return
        except asyncio.CancelledError as e:
            err = str(e) or "connection cancelled"
            server.error = err
            await handler.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await handler.server_event(events.OpenConnectionCompleted(command, err))
            raise
        server.timestamp_tcp_setup = time.time()
        if tls:
            server.timestamp_tls_setup = server.timestamp_tcp_setup
        server.state = ConnectionState.OPEN
        server.peername = peername
        server.sockname = writer.get_extra_info("sockname")
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is not None:
            alpn = ssl_object.selected_alpn_protocol()
            server.alpn = alpn.encode("ascii") if alpn else None
            server.tls_version = ssl_object.version()
            cipher = ssl_object.cipher()
            server.cipher = cipher[0] if cipher else None
        handler.transports[server] = ConnectionIO(
            handler=asyncio.current_task(), reader=reader, writer=writer
        )
        await handler.handle_hook(server_hooks.ServerConnectedHook(hook_data))
        await handler.server_event(events.OpenConnectionCompleted(command, None))
        try:
            await _serve(handler, server, key, active, tls)
        finally:
            server.timestamp_end = time.time()
            await handler.handle_hook(server_hooks.ServerDisconnectedHook(hook_data))


def _idle(server: Any) -> bool:
    """Has the HTTP/1 client layer finished its last exchange, keeping the connection?"""
    found = _layers.get(server)
    child = getattr(found() if found is not None else None, "child_layer", None)
    return (
        isinstance(child, Http1Client)
        and child.stream_id is None
        and child.state == child.read_headers
        and not child.buf
        and not child.request_done
        and not child.response_done
        and server.state is ConnectionState.OPEN
        and server.error is None
        and server not in timed_out_servers
        and server not in _spoiled
    )


async def _serve(handler: Any, server: Any, key: Key | None, active: Reuse, tls: bool) -> None:
    """mitmproxy's handle_connection; a connection idle when its client went is parked."""
    io = handler.transports[server]
    reader, writer = io.reader, io.writer
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            data = await reader.read(65535)
            if not data:
                break
        except OSError as e:
            if isinstance(e, ssl.SSLError):  # an alert: a client certificate wanted?
                clientcerts.alerted(server, str(e))
            break
        except asyncio.CancelledError as e:
            cancelled = e
            break
        await handler.server_event(events.DataReceived(server, data))
        try:
            await handler.drain_writers()
        except asyncio.CancelledError as e:
            cancelled = e
            break
    parked = (
        cancelled is not None
        and cancelled.args == (_GONE,)
        and key is not None
        and _idle(server)
        and active.pool.give(key, reader, writer)
    )
    if parked:
        handler.transports.pop(server, None)  # from here on, nothing of mitmproxy's reaches it
    if cancelled is None:
        server.state &= ~ConnectionState.CAN_READ
    else:
        server.state = ConnectionState.CLOSED
    await handler.server_event(events.ConnectionClosed(server))
    if server.state is ConnectionState.CAN_WRITE:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as e:
            cancelled = e
    if not parked:
        if tls:
            close(writer)
        else:
            with contextlib.suppress(OSError):
                writer.close()  # plain TCP, as mitmproxy closes it: what was written goes
        handler.transports.pop(server, None)
    if cancelled:
        raise cancelled
