"""Clients for the e2e tests: raw sockets for requests no well-behaved library will send,
HTTP/2 and WebSocket through a tunnel, and one GET over HTTP/1 (httpx) or HTTP/2 (h2)."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import wsproto.events as ev

    from tests.e2e.conftest import Proxy


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


def recv_until(
    sock: socket.socket | ssl.SSLSocket, marker: bytes = b"\r\n\r\n", data: bytes = b""
) -> bytes:
    """Read until `marker` is in what was read, or the peer closes; all that was read."""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_reply(sock: socket.socket | ssl.SSLSocket) -> Reply:
    data = recv_until(sock)
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


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Did the other side close `sock` (EOF or reset) within `within` seconds?"""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


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


def get(proxy: Proxy, who: tuple[str, str], host: str = "api.test", path: str = "/v1/x") -> Reply:
    """One GET through a fresh CONNECT tunnel, read with a raw TLS socket."""
    sock, reply = connect(proxy.port, f"{host}:443", proxy_auth(*who))
    if reply.status != 200:
        sock.close()
        return reply
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with context.wrap_socket(sock, server_hostname=host) as tls:
        tls.settimeout(10)
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return read_reply(tls)


# -- HTTP/2 inside a tunnel ------------------------------------------------------------------


def h2_tunnel(proxy: Proxy, auth: str, host: str) -> ssl.SSLSocket:
    """CONNECT to host:443 (asserted 200), then TLS offering only h2."""
    sock, reply = connect(proxy.port, f"{host}:443", auth)
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.set_alpn_protocols(["h2"])
    return context.wrap_socket(sock, server_hostname=host)


def h2_streams(
    tls: ssl.SSLSocket, requests: list[list[tuple[str, str]]]
) -> dict[int, tuple[int, dict[str, str]]]:
    """Send every request at once as streams of one HTTP/2 connection; their replies by id."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(validate_outbound_headers=False))
    conn.initiate_connection()
    ids = []
    for fields in requests:
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, fields, end_stream=True)
        ids.append(stream_id)
    tls.sendall(conn.data_to_send())
    replies: dict[int, tuple[int, dict[str, str]]] = {}
    ended: set[int] = set()
    while ended != set(ids):
        data = tls.recv(65536)
        if not data:
            raise ConnectionError("the proxy closed the h2 connection")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                fields = {k.decode(): v.decode() for k, v in event.headers}
                replies[event.stream_id] = (int(fields[":status"]), fields)
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                ended.add(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                raise ConnectionError("the proxy ended the h2 connection")
        tls.sendall(conn.data_to_send())
    return replies


@dataclass
class Answer:
    """What the agent received: the parsed answer and every byte of it, for the leak check."""

    version: str
    status: int | None
    headers: dict[str, str]
    body: bytes
    raw: bytes = b""
    broken: bool = False
    informational: list[dict[str, str]] = field(default_factory=list)
    fields: list[tuple[bytes, bytes]] = field(default_factory=list)  # h2: as received
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)  # h2

    def json(self) -> Any:
        return json.loads(self.body)


def h2_get(tls: ssl.SSLSocket, host: str, path: str, scheme: str = "https") -> Answer:
    """One GET as stream 1 of a new HTTP/2 connection on `tls`, read to its end."""
    import h2.connection
    import h2.events

    answer = Answer("HTTP/2", None, {}, b"")
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    request = [(":method", "GET"), (":scheme", scheme), (":authority", host), (":path", path)]
    conn.send_headers(1, request, end_stream=True)
    tls.sendall(conn.data_to_send())
    while True:
        data = tls.recv(65536)
        answer.raw += data
        if not data:
            answer.broken = True
            return answer
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.InformationalResponseReceived):
                hint = {k.decode(): v.decode() for k, v in event.headers}
                answer.informational.append(hint)
            elif isinstance(event, h2.events.ResponseReceived):
                answer.fields = list(event.headers)
                answer.headers = {k.decode(): v.decode() for k, v in event.headers}
                answer.status = int(answer.headers[":status"])
            elif isinstance(event, h2.events.TrailersReceived):
                answer.trailers = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                answer.body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, 1)
            elif isinstance(event, h2.events.StreamEnded):
                return answer
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                answer.broken = True
                return answer
        tls.sendall(conn.data_to_send())


def fetch(proxy: Proxy, agent: tuple[str, str], host: str, path: str, http2: bool) -> Answer:
    """GET https://host/path through the proxy, over HTTP/1 (httpx) or HTTP/2 (raw h2: httpx
    offers http/1.1 first, and mitmproxy takes the client's first choice)."""
    import httpx

    if http2:
        with h2_tunnel(proxy, proxy_auth(*agent), host) as tls:
            assert tls.selected_alpn_protocol() == "h2"
            return h2_get(tls, host, path)
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    with httpx.Client(proxy=proxy.url(*agent), verify=context, timeout=10) as c:
        with c.stream("GET", f"https://{host}{path}") as reply:
            head = f"{reply.status_code} {reply.reason_phrase}\n{reply.headers}\n".encode()
            body, broken = b"", False
            try:
                for chunk in reply.iter_raw():
                    body += chunk
            except httpx.HTTPError:
                broken = True
            headers = {k.lower(): v for k, v in reply.headers.items()}
            return Answer("HTTP/1.1", reply.status_code, headers, body, head + body, broken)


# -- WebSocket inside a tunnel ---------------------------------------------------------------


def ws_session(proxy: Proxy, auth: str, host: str, target: str) -> tuple[bytes, list[ev.Event]]:
    """Everything the client received after TLS (raw bytes) and the WebSocket events, pings
    and closes answered, until the connection ends."""
    import wsproto.events as ev
    from wsproto import ConnectionType, WSConnection

    sock = tunnel(proxy.port, f"{host}:443", auth, host, proxy.ca_file)
    ws = WSConnection(ConnectionType.CLIENT)
    received, got = b"", []
    with sock:
        sock.settimeout(10)
        sock.sendall(ws.send(ev.Request(host=host, target=target)))
        while True:
            try:
                data = sock.recv(65536)
            except (OSError, ssl.SSLError):
                break
            if not data:
                break
            received += data
            ws.receive_data(data)
            for event in ws.events():
                got.append(event)
                if isinstance(event, ev.Ping | ev.CloseConnection):
                    try:
                        sock.sendall(ws.send(event.response()))
                    except (OSError, ssl.SSLError):
                        pass  # the proxy may close first: what it sent is what counts
    return received, got


def absolute_form(proxy: Proxy, auth: str, targets: list[tuple[str, str]]) -> list[Reply]:
    """Plain-proxy requests `GET URL` with `Host: HOST`, one after another on one connection."""
    replies = []
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        for url, host in targets:
            sock.sendall(
                f"GET {url} HTTP/1.1\r\nHost: {host}\r\n"
                f"Proxy-Authorization: {auth}\r\n\r\n".encode()
            )
            replies.append(read_reply(sock))
    return replies


_ZEROS = b"\0" * (1024 * 1024)


def push(sock: socket.socket | ssl.SSLSocket, head: bytes, total: int) -> Reply | None:
    """Send `head`, then up to `total` body bytes until the proxy answers or stops reading."""
    sock.sendall(head)
    sock.settimeout(0.0)
    sent = 0
    data = b""
    while sent < total:
        try:
            data += sock.recv(65536)
            break  # the answer has started: it came before the body
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        except OSError:
            return None
        try:
            sent += sock.send(_ZEROS[: min(len(_ZEROS), total - sent)])
        except (BlockingIOError, ssl.SSLWantWriteError):
            threading.Event().wait(0.001)
        except OSError:
            break
    sock.settimeout(10)

    class Prefixed:
        def __init__(self) -> None:
            self.buffer = data

        def recv(self, n: int) -> bytes:
            if self.buffer:
                out, self.buffer = self.buffer, b""
                return out
            return sock.recv(n)

    return read_reply(Prefixed())  # type: ignore[arg-type]
