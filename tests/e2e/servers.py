"""Test servers on 127.0.0.1: the accept loop they share, tarpits, a resetter and a WebSocket
upstream.

`Server` hands each accepted connection to `handle` in a thread of its own; `TlsServer`
completes the TLS handshake first and calls `serve`. Used as context managers, or closed
with `close()`.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any, Self

import wsproto.events as ev
from wsproto import ConnectionType, WSConnection

from tests.e2e.memory import BIG


def server_context(ca: Any, names: list[str], alpn: str | None = None) -> ssl.SSLContext:
    """A server-side TLS context with a certificate from `ca` (trustme) for `names`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    if alpn is not None:
        context.set_alpn_protocols([alpn])
    return context


def big_answer() -> bytes:
    """A 200 with a body of BIG bytes."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG + b"b" * BIG


class Server:
    """A TCP listener whose accept thread starts at once; `handle` gets each connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(sock,), daemon=True).start()

    def handle(self, sock: socket.socket) -> None:
        raise NotImplementedError


class TlsServer(Server):
    """Completes the TLS handshake with `context`, then `serve` talks to the client."""

    def __init__(self, context: ssl.SSLContext, timeout: float = 5) -> None:
        self.context = context
        self.timeout = timeout
        super().__init__()

    def handle(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout)
        try:
            with self.context.wrap_socket(sock, server_side=True) as tls:
                self.serve(tls)
        except (OSError, ssl.SSLError):
            pass

    def serve(self, tls: ssl.SSLSocket) -> None:
        raise NotImplementedError


class Tarpit(Server):
    """Accepts TCP connections and never answers; with `ca`, completes the TLS handshake,
    reads the request and sends `answer` (nothing by default), and still never closes."""

    def __init__(self, ca: Any = None, answer: bytes = b"") -> None:
        self.answer = answer
        self.context = None
        if ca is not None:
            self.context = server_context(ca, ["tlspit.test", "hugehead.test", "big.test"])
        self.held: list[Any] = []
        self.requests = 0
        super().__init__()

    def handle(self, sock: socket.socket) -> None:
        self.held.append(sock)
        if self.context is None:
            return
        try:
            tls = self.context.wrap_socket(sock, server_side=True)
            self.held.append(tls)
            if tls.recv(65536):
                self.requests += 1
                tls.sendall(self.answer)
        except OSError:
            pass

    def close(self) -> None:
        super().close()
        for conn in self.held:
            conn.close()


class Resetter(Server):
    """Accepts each TCP connection and resets it (RST, not FIN) at once."""

    def handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


Upgrade = Callable[[ssl.SSLSocket, WSConnection, ev.Request], None]


class WsUpstream(TlsServer):
    """A TLS WebSocket server: `upgrade(sock, ws, request)` answers each handshake (and may
    send messages); what the client sends is counted in `received`, a close ends it."""

    def __init__(self, ca: Any, name: str, upgrade: Upgrade, timeout: float = 10) -> None:
        self.upgrade = upgrade
        self.received = 0
        super().__init__(server_context(ca, [name]), timeout)

    def serve(self, tls: ssl.SSLSocket) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        while True:
            data = tls.recv(262144)
            if not data:
                return
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, ev.Request):
                    self.upgrade(tls, ws, event)
                elif isinstance(event, ev.Message):
                    self.received += len(event.data)
                elif isinstance(event, ev.CloseConnection):
                    return


def authorization(request: ev.Request) -> str:
    """The Authorization header of a WebSocket handshake, as the upstream received it."""
    return dict(request.extra_headers).get(b"authorization", b"").decode()
