"""Upstreams that echo the stamped secret in every form, and the checks that it never came back.

Three scripted TLS upstreams build their answers from the secret they were sent: raw HTTP/1
(misbehaving.py), HTTP/2 with trailers, and WebSocket messages echoing the Authorization. The
conftest fixture `rproxy` puts them behind one proxy, beside the recording upstream on api.test.
Secrets are only ever asserted with `not in`; nothing prints them.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wsproto.events as ev
from wsproto import WSConnection

from store.crypto import Secret
from tests.e2e.misbehaving import chunked, head, ok
from tests.e2e.raw import exchange, proxy_auth, tunnel
from tests.e2e.servers import authorization

if TYPE_CHECKING:
    from tests.e2e.conftest import Proxy

SECRET = ("sk-rv-" + os.urandom(8).hex()).encode()  # 22 bytes


def _mixed_escapes(secret: bytes) -> bytes:
    """Each byte of the secret escaped another way: literal, %hh, %HH, \\u00hh, \\u00HH."""
    out = b""
    for i, byte in enumerate(secret):
        kind = i % 5
        if kind == 0:
            out += bytes((byte,))
        elif kind == 1:
            out += b"%%%02x" % byte
        elif kind == 2:
            out += b"%%%02X" % byte
        elif kind == 3:
            out += b"\\u00%02x" % byte
        else:
            out += b"\\u00%02X" % byte
    return out


def _references(secret: bytes) -> bytes:
    """Each byte of the secret an HTML/XML character reference of another spelling."""
    spellings = (b"&#%d;", b"&#%03d;", b"&#x%x;", b"&#X%04X;", b"&#x%02X;")
    return b"".join(spellings[i % 5] % byte for i, byte in enumerate(secret))


def _raw_deflate(data: bytes) -> bytes:
    """Deflate without the zlib header, as some servers send `Content-Encoding: deflate`."""
    import zlib

    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


SCRIPTS: dict[str, Callable[[bytes], bytes]] = {
    "/v1/not-modified": lambda s: head(
        b"HTTP/1.1 304 Not Modified", b'ETag: "v1"', b"Content-Length: 100000"
    ),
    "/v1/after": lambda s: ok(b'{"after": true}'),
    "/v1/big-head": lambda s: head(
        b"HTTP/1.1 200 OK", b"Content-Type: application/json", b"Content-Length: 100000"
    ),
    "/v1/mixed-held": lambda s: ok(b'{"echo": "' + _mixed_escapes(s) + b'"}'),
    "/v1/mixed-streamed": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: chunked")
        + chunked(
            b'{"echo": "'
            + _mixed_escapes(s)
            + b'", "b64": "'
            + base64.urlsafe_b64encode(s).rstrip(b"=")
            + b'"}',
            3,
        )
    ),
    "/v1/html-streamed": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Content-Type: text/html", b"Transfer-Encoding: chunked")
        + chunked(b"<p>key: " + _references(s) + b"</p><p>" + s[:2] + _references(s[2:]), 3)
    ),
    "/v1/gzip-streamed": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Content-Encoding: gzip", b"Transfer-Encoding: chunked")
        + chunked(gzip.compress(b"token=" + s + b"&again=" + base64.b64encode(s)), 5)
    ),
    "/v1/reason": lambda s: head(b"HTTP/1.1 200 " + s, b"Content-Length: 0"),
    "/v1/header-name": lambda s: head(
        b"HTTP/1.1 200 OK",
        b"X-" + s + b": 1",
        b"X-Echo: " + _mixed_escapes(s),
        b"Content-Length: 0",
    ),
    "/v1/large-held-edge": lambda s: ok(b"x" * (64 * 1024 - len(s) - 3) + b'"' + s + b'"'),
    "/v1/raw-deflate": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Content-Encoding: deflate", b"Transfer-Encoding: chunked")
        + chunked(_raw_deflate(b"token=" + s), 7)
    ),
}


def _h2_trailers(length: bool) -> Any:
    """An h2 answer whose trailers echo the secret, in a value and in a name."""

    def send(conn: Any, stream_id: int, secret: bytes) -> None:
        head = [(b":status", b"200"), (b"content-type", b"application/grpc")]
        if length:
            head.append((b"content-length", b"2"))
        conn.send_headers(stream_id, head)
        conn.send_data(stream_id, b"ok")
        trailers = [(b"grpc-status", b"2"), (b"grpc-message", b"bad key " + _mixed_escapes(secret))]
        conn.send_headers(stream_id, [*trailers, (b"x-" + secret, b"1")], end_stream=True)

    return send


def _h2_body_then_trailer(conn: Any, stream_id: int, secret: bytes) -> None:
    """A streamed body ending in the start of the secret, a trailer holding the rest."""
    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    conn.send_data(stream_id, b"key: " + secret[:9])
    conn.send_headers(stream_id, [(b"grpc-message", secret[9:])], end_stream=True)


def _h2_empty_frame_split(conn: Any, stream_id: int, secret: bytes) -> None:
    """A streamed body with the secret split around an empty DATA frame: mitmproxy hands the
    empty frame on as b"", the marker of a stream's end to a stream function."""
    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"text/plain")])
    conn.send_data(stream_id, b"echo: " + secret[:9])
    conn.send_data(stream_id, b"")
    conn.send_data(stream_id, secret[9:] + b" end", end_stream=True)


def _h2_tools_list_split(conn: Any, stream_id: int, secret: bytes) -> None:
    """An MCP server's event stream listing a tool the grant leaves out, its event split
    around an empty DATA frame."""
    listing = {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {"tools": [{"name": "ok"}, {"name": "drop_repo"}]},
    }
    event = b"data: " + json.dumps(listing).encode() + b"\n\n"
    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"text/event-stream")])
    conn.send_data(stream_id, event[:30])
    conn.send_data(stream_id, b"")
    conn.send_data(stream_id, event[30:], end_stream=True)


H2_SCRIPTS = {
    "/v1/empty-frame-split": _h2_empty_frame_split,
    "/v1/mcp-empty-frame": _h2_tools_list_split,
    "/v1/trailers-held": _h2_trailers(True),
    "/v1/trailers-streamed": _h2_trailers(False),
    "/v1/body-then-trailer": _h2_body_then_trailer,
}


# -- the WebSocket upstream ----------------------------------------------------------------


def _ws_script(mode: str, auth: str) -> list[ev.Event]:
    secret = auth.removeprefix("Bearer ")
    if mode == "three":
        # The secret spread over three server messages: start, middle, end.
        return [
            ev.TextMessage("x Bearer " + secret[:5]),
            ev.TextMessage(secret[5:13]),
            ev.TextMessage(secret[13:] + " y"),
        ]
    if mode == "two":
        return [ev.TextMessage("x Bearer " + secret[:9]), ev.TextMessage(secret[9:] + " y")]
    if mode == "pong":
        return [ev.Pong(auth.encode())]
    if mode == "close-split":
        return [ev.TextMessage("x Bearer " + secret[:9]), ev.CloseConnection(1000, secret[9:])]
    if mode == "ping-split":
        return [ev.TextMessage("x Bearer " + secret[:9]), ev.Ping(secret[9:].encode())]
    raise AssertionError(mode)


def _ws_upgrade(sock: ssl.SSLSocket, ws: WSConnection, request: ev.Request) -> None:
    """Each connection plays the script its path names."""
    accept = ws.send(ev.AcceptConnection())
    auth = authorization(request)
    mode = request.target.rsplit("/", 1)[1]
    if mode == "eager":
        # The 101 and a first message echoing it in one write.
        sock.sendall(accept + ws.send(ev.TextMessage(auth)))
        script = []
    else:
        sock.sendall(accept)
        script = _ws_script(mode, auth)
    if mode != "close-split":
        script += [ev.TextMessage("done"), ev.CloseConnection(1000, "bye")]
    for step in script:
        sock.sendall(ws.send(step))
        time.sleep(0.05)  # one message per read on the proxy's side


# -- the agent and the checks --------------------------------------------------------------


def _principal(proxy: Proxy, names: Callable[[str], str]) -> tuple[str, str, str]:
    """A principal and a bearer credential for every test host; (name, token, credential)."""
    principal, cred = names("rva"), names("rva-cred")
    token = proxy.store.add_principal(principal)
    hosts = ["api.test", "raw.test", "ws.test", "h2.test"]
    proxy.store.add_credential(cred, "bearer", hosts, Secret(SECRET))
    return principal, token, cred


def _leaks(data: bytes | str) -> bool:
    raw = data.encode("latin-1", "replace") if isinstance(data, str) else data
    b64 = base64.b64encode(SECRET)
    forms = (SECRET, b64, b64.rstrip(b"="), base64.urlsafe_b64encode(SECRET).rstrip(b"="))
    return any(form in raw for form in forms)


def _get(proxy: Proxy, agent: tuple[str, str], host: str, head: str) -> Any:
    sock = tunnel(proxy.port, f"{host}:443", proxy_auth(*agent), host, proxy.ca_file)
    with sock:
        return exchange(sock, head.encode())
