"""Raw-socket clients for requests no well-behaved library will send."""

from __future__ import annotations

import base64
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def reason(self) -> str | None:
        return self.headers.get("x-credproxy-reason")


def proxy_auth(principal: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{principal}:{token}".encode()).decode()


def read_reply(sock: socket.socket | ssl.SSLSocket) -> Reply:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        raise ConnectionError(f"no HTTP reply: {data[:80]!r}")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Reply(status, headers, body)


def connect(
    port: int, authority: str, auth: str | None, timeout: float = 10
) -> tuple[socket.socket, Reply]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if auth is not None:
        lines.append(f"Proxy-Authorization: {auth}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock, read_reply(sock)


def tunnel(port: int, authority: str, auth: str, sni: str | None, ca_file: Path) -> ssl.SSLSocket:
    """CONNECT to `authority`, then TLS with `sni` (forgeable); raises unless the CONNECT is 200."""
    sock, reply = connect(port, authority, auth)
    if reply.status != 200:
        sock.close()
        raise ConnectionRefusedError(f"CONNECT answered {reply.status} {reply.reason}")
    context = ssl.create_default_context(cafile=str(ca_file))
    context.check_hostname = False
    context.set_alpn_protocols(["http/1.1"])
    return context.wrap_socket(sock, server_hostname=sni)


def exchange(sock: socket.socket | ssl.SSLSocket, raw: bytes) -> Reply:
    sock.sendall(raw)
    return read_reply(sock)
