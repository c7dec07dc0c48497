"""TLS upstreams on 127.0.0.1 that misbehave on purpose, with answers built from the secret.

Each request's path picks a script; the script gets the bearer secret the proxy stamped and
returns the raw bytes (HTTP/1) or sends the frames (HTTP/2) of a broken answer that echoes it.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any

from tests.e2e.raw import recv_until
from tests.e2e.servers import TlsServer, server_context

# The answer's bytes, or pieces of it sent one by one (a generator may sleep between them).
Script = Callable[[bytes], bytes | Iterable[bytes]]
# (h2 connection, stream id, secret); a generator's frames are sent at each step (it may sleep)
H2Script = Callable[[Any, int, bytes], Iterable[None] | None]


def head(*lines: bytes) -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n"


def ok(body: bytes, *extra: bytes) -> bytes:
    return head(b"HTTP/1.1 200 OK", *extra, b"Content-Length: %d" % len(body)) + body


def chunked(body: bytes, size: int | None = None) -> bytes:
    """`body` as chunks of `size` bytes (one chunk by default), then the last chunk."""
    size = size or len(body) or 1
    out = b""
    for i in range(0, len(body), size):
        piece = body[i : i + size]
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
    return out + b"0\r\n\r\n"


def _secret(authorization: bytes) -> bytes:
    return authorization.removeprefix(b"Bearer ").strip()


class RawUpstream(TlsServer):
    """HTTP/1: read one request, answer `scripts[path](secret)` verbatim, wait `linger`
    seconds, close."""

    def __init__(
        self, ca: Any, names: list[str], scripts: dict[str, Script], linger: float = 0
    ) -> None:
        self.scripts = scripts
        self.linger = linger
        self.heads: list[list[tuple[bytes, bytes]]] = []
        super().__init__(server_context(ca, names, "http/1.1"))

    def serve(self, tls: ssl.SSLSocket) -> None:
        data = recv_until(tls)
        if b"\r\n\r\n" not in data:
            return
        lines = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        path = lines[0].split(b" ")[1].decode()
        fields = [tuple(line.split(b": ", 1)) for line in lines[1:]]
        self.heads.append(fields)  # type: ignore[arg-type]
        headers = {k.lower(): v for k, v in fields}
        answer = self.scripts[path](_secret(headers.get(b"authorization", b"")))
        if isinstance(answer, bytes):
            if not answer:  # nothing to say: wait for the proxy to give up
                while tls.recv(65536):
                    pass
            tls.sendall(answer)
        else:
            for piece in answer:
                tls.sendall(piece)
        time.sleep(self.linger)


class H2Upstream(TlsServer):
    """HTTP/2: for each request, `scripts[path](conn, stream_id, secret)` sends the answer;
    a script that is a generator has what it queued sent at each step."""

    def __init__(self, ca: Any, names: list[str], scripts: dict[str, H2Script]) -> None:
        self.scripts = scripts
        super().__init__(server_context(ca, names, "h2"))

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
                    steps = script(
                        conn, event.stream_id, _secret(headers.get(b"authorization", b""))
                    )
                    for _ in steps or ():
                        tls.sendall(conn.data_to_send())
            tls.sendall(conn.data_to_send())
