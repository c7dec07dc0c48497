"""A real TLS upstream on 127.0.0.1 that records exactly what it received."""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    sni: str | None

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


# What an app answers: status, header fields, body; None leaves the request to the default.
Answer = tuple[int, list[tuple[str, str]], bytes]
App = Callable[[Received], Answer | None]


@dataclass
class Log:
    connections: int = 0
    snis: list[str | None] = field(default_factory=list)
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.connections = 0
            self.snis.clear()
            self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def read_body(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            return self.rfile.read(length) if length else b""
        parts = []
        while True:
            size = int(self.rfile.readline().strip(), 16)
            if size == 0:
                self.rfile.readline()
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _handle(self) -> None:
        body = self.read_body()
        sni = getattr(self.connection, "credproxy_sni", None)
        received = Received(self.command, self.path, list(self.headers.items()), body, sni)
        with self.server.log.lock:
            self.server.log.requests.append(received)
        answer = self.server.app(received) if self.server.app is not None else None
        if answer is not None:
            return self._answer(*answer)
        if self.path.startswith("/sse"):
            return self._sse()
        encoding = None
        if self.path.startswith("/echo-auth"):
            payload = json.dumps({"authorization": self.headers.get("authorization")}).encode()
            if "gzip" in self.path:
                # Compressed although the proxy asked for identity: redaction must still work.
                payload, encoding = gzip.compress(payload), "gzip"
            if "large" in self.path:
                # Longer than the proxy buffers: streamed, redacted chunk by chunk.
                pad = "x" * 100_000
                auth = self.headers.get("authorization")
                payload = json.dumps({"authorization": auth, "pad": pad, "again": auth}).encode()
        else:
            payload = json.dumps({"ok": True, "path": self.path}).encode()
        self.send_response(200)
        if "echo-auth" in self.path:
            self.send_header("x-echo", self.headers.get("authorization") or "")
        if encoding:
            self.send_header("content-encoding", encoding)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _answer(self, status: int, fields: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for name, value in fields:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _sse(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(3):
            data = f"data: event-{i}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            time.sleep(self.server.sse_gap)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver listens with a backlog of 5: a hundred parallel connects overflowed it,
    # and a dropped SYN is retried after 1, 2, 4 ... s, past --connect-timeout on a slow
    # machine (a 504 in CI). Tests that mean to overflow a backlog make their own server.
    request_queue_size = 1024
    log: Log
    context: ssl.SSLContext
    app: App | None = None
    sse_gap: float = 0.4

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        with self.log.lock:
            self.log.connections += 1
        # The handshake runs in the handler's thread, on first read.
        return self.context.wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False, suppress_ragged_eofs=True
        ), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def context_for(ca: Any, names: list[str], on_sni: Callable[[str | None], None]) -> ssl.SSLContext:
    """HTTP/1.1 over TLS for `names`; each connection's SNI goes to `on_sni` and is kept on
    the socket (`credproxy_sni`)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    context.set_alpn_protocols(["http/1.1"])

    def remember_sni(sslobj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        on_sni(name)
        sslobj.credproxy_sni = name  # type: ignore[attr-defined]

    context.sni_callback = remember_sni  # type: ignore[assignment]
    return context


class Upstream:
    """Serves HTTPS for every name in `names` with a certificate from `ca` (trustme).

    `app`, if given, answers first; what it leaves (None) gets the default answers.
    """

    def __init__(self, ca: Any, names: list[str], app: App | None = None) -> None:
        self.log = Log()

        def remember_sni(name: str | None) -> None:
            with self.log.lock:
                self.log.snis.append(name)

        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.log = self.log
        self.server.context = context_for(ca, names, remember_sni)
        self.server.app = app
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Upstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
