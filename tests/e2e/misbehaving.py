"""TLS upstreams on 127.0.0.1 that misbehave on purpose, with answers built from the secret.

Each request's path picks a script; the script gets the bearer secret the proxy stamped and
returns the raw bytes (HTTP/1) or sends the frames (HTTP/2) of a broken answer that echoes it.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

Script = Callable[[bytes], bytes]
H2Script = Callable[[Any, int, bytes], None]  # (h2 connection, stream id, secret)


def _context(ca: Any, names: list[str], alpn: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    context.set_alpn_protocols([alpn])
    return context


def _secret(authorization: bytes) -> bytes:
    return authorization.removeprefix(b"Bearer ").strip()


class _Server:
    """Accepts TLS connections in a thread; `serve` handles one connection."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> _Server:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(sock,), daemon=True).start()

    def _run(self, sock: socket.socket) -> None:
        sock.settimeout(5)
        try:
            with self.context.wrap_socket(sock, server_side=True) as tls:
                self.serve(tls)
        except (OSError, ssl.SSLError):
            pass

    def serve(self, tls: ssl.SSLSocket) -> None:
        raise NotImplementedError


class RawUpstream(_Server):
    """HTTP/1: read one request, answer `scripts[path](secret)` verbatim, close."""

    def __init__(self, ca: Any, names: list[str], scripts: dict[str, Script]) -> None:
        super().__init__(_context(ca, names, "http/1.1"))
        self.scripts = scripts
        self.heads: list[list[tuple[bytes, bytes]]] = []

    def serve(self, tls: ssl.SSLSocket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = tls.recv(65536)
            if not chunk:
                return
            data += chunk
        head = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        path = head[0].split(b" ")[1].decode()
        fields = [tuple(line.split(b": ", 1)) for line in head[1:]]
        self.heads.append(fields)  # type: ignore[arg-type]
        headers = {k.lower(): v for k, v in fields}
        answer = self.scripts[path](_secret(headers.get(b"authorization", b"")))
        if not answer:  # nothing to say: wait for the proxy to give up
            while tls.recv(65536):
                pass
        tls.sendall(answer)


class H2Upstream(_Server):
    """HTTP/2: for each request, `scripts[path](conn, stream_id, secret)` sends the answer."""

    def __init__(self, ca: Any, names: list[str], scripts: dict[str, H2Script]) -> None:
        super().__init__(_context(ca, names, "h2"))
        self.scripts = scripts

    def serve(self, tls: ssl.SSLSocket) -> None:
        import h2.config
        import h2.connection
        import h2.events

        config = h2.config.H2Configuration(
            client_side=False, validate_outbound_headers=False, normalize_outbound_headers=False
        )
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        tls.sendall(conn.data_to_send())
        while True:
            data = tls.recv(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    headers = dict(event.headers)
                    script = self.scripts[headers[b":path"].decode()]
                    script(conn, event.stream_id, _secret(headers.get(b"authorization", b"")))
            tls.sendall(conn.data_to_send())
