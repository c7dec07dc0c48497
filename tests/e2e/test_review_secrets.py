"""Hostile review: the secret and the credential's destination, attacked end to end.

A real `credproxy run`, three TLS upstreams on 127.0.0.1 reached through `--resolve`:

- api.test: the recording upstream of tests/e2e/upstream.py (what exactly arrived);
- raw.test: scripted raw HTTP/1 answers built from the stamped secret (misbehaving.py);
- ws.test: a WebSocket server whose messages echo the stamped Authorization;
- h2.test: scripted HTTP/2 answers (trailers) built from the stamped secret.

Tests under a "Was broken" comment reproduce a finding of the review: each failed on the code
it was written against. The others are attacks that held. Secrets are only ever asserted with
`not in`; nothing prints them.
"""

from __future__ import annotations

import base64
import gzip
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import wsproto.events as ev
from wsproto import WSConnection

from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.misbehaving import H2Upstream, RawUpstream, chunked, head, ok
from tests.e2e.raw import (
    connect,
    exchange,
    fetch,
    h2_get,
    h2_tunnel,
    proxy_auth,
    read_reply,
    recv_until,
    tunnel,
    ws_session,
)
from tests.e2e.servers import WsUpstream, authorization
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = ("sk-rv-" + os.urandom(8).hex()).encode()  # 22 bytes
STAMPED = b"Bearer " + SECRET


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


H2_SCRIPTS = {
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


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(upstream_ca: trustme.CA) -> Iterator[dict[str, Any]]:
    with (
        Upstream(upstream_ca, ["api.test"]) as api,
        RawUpstream(upstream_ca, ["raw.test"], SCRIPTS) as raw,
        WsUpstream(upstream_ca, "ws.test", _ws_upgrade) as ws,
        H2Upstream(upstream_ca, ["h2.test"], H2_SCRIPTS) as h2,
    ):
        yield {"api": api, "raw": raw, "ws": ws, "h2": h2}


@pytest.fixture(scope="module")
def rproxy(
    tmp_path_factory: pytest.TempPathFactory,
    servers: dict[str, Any],
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    resolve = [
        f"api.test=127.0.0.1:{servers['api'].port}",
        f"raw.test=127.0.0.1:{servers['raw'].port}",
        f"ws.test=127.0.0.1:{servers['ws'].port}",
        f"h2.test=127.0.0.1:{servers['h2'].port}",
    ]
    home = tmp_path_factory.mktemp("review-a")
    running = start_proxy(home, upstream_ca, resolve, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture
def api(servers: dict[str, Any]) -> Upstream:
    time.sleep(0.05)
    servers["api"].log.clear()
    return servers["api"]


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


def _overrides(api: Upstream, method: str) -> list[Any]:
    """The upstream requests that carried a method override naming `method`."""
    names = {"x-http-method-override", "x-http-method", "x-method-override"}
    return [
        r
        for r in api.log.requests
        if any(k.lower().replace("_", "-") in names and v == method for k, v in r.headers)
    ]


# -- findings: method override -------------------------------------------------------------


# Was broken (hostile review): a method override is checked against any grant, so a once-grant
# for it is never burnt and serves any number of overridden requests
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-HTTP-Method-Override",
            id="an override that a once-grant allows is used "
            "over a standing GET grant again and again",
        )
    ],
)
def test_override_never_burns_the_once_grant_it_relies_on(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(
        principal, ["DELETE"], credential=cred, hosts=["api.test"], paths=["/v1/"], once=True
    )
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    statuses = [_get(rproxy, (principal, token), "api.test", head).status for _ in range(3)]
    # A once-grant serves exactly one request: at most one overridden DELETE goes upstream.
    overridden = len(_overrides(api, "DELETE"))
    assert overridden <= 1, statuses


# Was broken (hostile review): a method override granted only by a pass-through grant is sent
# with another grant's credential: the credential is used for a method it was never granted
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-HTTP-Method-Override",
            id="DELETE granted only without the credential "
            "still goes upstream with the GET grant's credential",
        ),
        pytest.param("X-HTTP-Method", id="the same through X-HTTP-Method"),
    ],
)
def test_override_granted_without_a_credential_carries_the_credential(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(principal, ["DELETE"], hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    stamped = [
        r
        for r in _overrides(api, "DELETE")
        if any(SECRET.decode() in v for v in r.header("authorization"))
    ]
    count = len(stamped)
    assert count == 0, "the credential went upstream on a DELETE no credential grant allows"


# Was broken (hostile review): a method override granted only with another credential is sent
# with the GET grant's credential: that credential is used for a method it was never granted
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X-Method-Override",
            id="DELETE granted only with another credential goes upstream with the GET one's",
        ),
    ],
)
def test_override_granted_with_another_credential_carries_this_one(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    other = names("rva-other")
    rproxy.store.add_credential(other, "bearer", ["api.test"], Secret(b"sk-other-" + SECRET[6:]))
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.store.add_grant(principal, ["DELETE"], credential=other, paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    stamped = [
        r
        for r in _overrides(api, "DELETE")
        if any(v == "Bearer " + SECRET.decode() for v in r.header("authorization"))
    ]
    count = len(stamped)
    assert count == 0, "the GET-only credential went upstream on a DELETE"


# Was broken (hostile review): X_HTTP_Method_Override (underscores) is not checked, and CGI/WSGI
# backends read it as X-HTTP-Method-Override
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(
            "X_HTTP_Method_Override",
            id="an override header spelled with underscores names an ungranted method and passes",
        ),
        pytest.param("X_Method_Override", id="X_Method_Override likewise"),
    ],
)
def test_override_spelled_with_underscores_is_checked(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: DELETE\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    overridden = len(_overrides(api, "DELETE"))
    assert overridden == 0, reply.status


# Was broken (hostile review): path-override headers (X-Original-URL, X-Rewrite-URL) pass
# unchecked: a backend that honours them routes a stamped request to a path no grant allows
@pytest.mark.parametrize(
    "header",
    [
        pytest.param("X-Original-URL", id="X-Original-URL names an ungranted path and passes"),
        pytest.param("X-Rewrite-URL", id="X-Rewrite-URL names an ungranted path and passes"),
    ],
)
def test_path_override_headers_are_checked_like_the_path(
    rproxy: Proxy, api: Upstream, names, header: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/public"]
    )
    rproxy.wait_reload()
    head = f"GET /v1/public HTTP/1.1\r\nHost: api.test\r\n{header}: /admin/keys\r\n\r\n"
    _get(rproxy, (principal, token), "api.test", head)
    overridden = len([r for r in api.log.requests if r.header(header)])
    assert overridden == 0


@pytest.mark.parametrize(
    ("header", "value"),
    [
        pytest.param("X-HTTP-Method-Override", "DELETE", id="an ungranted override is refused"),
        pytest.param("x-method-override", "delete", id="a lower-case override value is refused"),
        pytest.param("X-HTTP-Method", "GET, DELETE", id="a list of methods is refused"),
    ],
)
def test_override_to_an_ungranted_method_is_refused(
    rproxy: Proxy, api: Upstream, names, header: str, value: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"], paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/items/7 HTTP/1.1\r\nHost: api.test\r\n{header}: {value}\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    assert reply.status in (400, 403)
    forwarded = len(api.log.requests)
    assert forwarded == 0


# -- findings: WebSocket -------------------------------------------------------------------


def _ws_text(events: list[ev.Event]) -> str:
    return "".join(e.data for e in events if isinstance(e, ev.TextMessage))


@pytest.fixture
def ws_agent(rproxy: Proxy, names) -> tuple[str, str]:
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET"], credential=cred, hosts=["ws.test"], paths=["/v1/"], websocket=True
    )
    rproxy.wait_reload()
    return principal, token


# Was broken (hostile review): the cross-message check only remembers the previous message's
# tail and skips control frames: a secret over three messages, or a message and a close/ping,
# arrives whole
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("three", id="the secret in three server messages reaches the agent"),
        pytest.param("close-split", id="a message's tail and the close reason make the secret"),
        pytest.param("ping-split", id="a message's tail and a ping payload make the secret"),
    ],
)
def test_a_secret_spread_over_websocket_frames_never_reaches_the_agent(
    rproxy: Proxy, ws_agent, mode: str
):
    received, got = ws_session(rproxy, proxy_auth(*ws_agent), "ws.test", f"/v1/ws/{mode}")
    assert b"101" in received
    text = ""  # everything the agent got, in order: messages, close reasons, ping payloads
    for e in got:
        if isinstance(e, ev.TextMessage):
            text += e.data
        elif isinstance(e, ev.CloseConnection):
            text += e.reason or ""
        elif isinstance(e, ev.Ping | ev.Pong):
            text += bytes(e.payload).decode("latin-1")
    whole = SECRET.decode() in text
    assert not whole, "the agent can put the secret back together"


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("two", id="the secret in two server messages: the second never arrives"),
        pytest.param("pong", id="an unsolicited pong echoing the secret is redacted"),
        pytest.param("eager", id="a message in the same write as the 101 is redacted"),
    ],
)
def test_websocket_forms_across_two_messages_and_in_pongs_held(rproxy: Proxy, ws_agent, mode: str):
    received, got = ws_session(rproxy, proxy_auth(*ws_agent), "ws.test", f"/v1/ws/{mode}")
    assert b"101" in received
    whole = SECRET.decode() in _ws_text(got)
    assert not whole, "the agent can put the secret back together"
    leaked = _leaks(received)
    assert not leaked, "the agent received the secret"
    if mode == "pong":
        pongs = [bytes(e.payload) == b"[REDACTED]" for e in got if isinstance(e, ev.Pong)]
        assert pongs == [True]
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


# -- findings: framing of long bodiless answers --------------------------------------------


@pytest.fixture
def raw_agent(rproxy: Proxy, names) -> tuple[str, str]:
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(
        principal, ["GET", "HEAD"], credential=cred, hosts=["raw.test"], paths=["/v1/"]
    )
    rproxy.wait_reload()
    return principal, token


# Was broken (hostile review): a 304 announcing over 64 KiB is re-framed as chunked and gets a
# '0' chunk, a body a 304 cannot have: the agent's keep-alive connection is desynchronised
@pytest.mark.parametrize(
    "path", [pytest.param("/v1/not-modified", id="a 304 with Content-Length 100000")]
)
def test_a_long_304_keeps_the_connection_in_step(rproxy: Proxy, raw_agent, path: str):
    sock = tunnel(rproxy.port, "raw.test:443", proxy_auth(*raw_agent), "raw.test", rproxy.ca_file)
    with sock:
        sock.settimeout(10)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: raw.test\r\n\r\n".encode())
        head, _, rest = recv_until(sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 304")
        sock.sendall(b"GET /v1/after HTTP/1.1\r\nHost: raw.test\r\n\r\n")
        time.sleep(0.3)
        second = rest
        while len(second) < 12:
            chunk = sock.recv(65536)
            if not chunk:
                break
            second += chunk
    assert second.startswith(b"HTTP/1.1 200"), "the next answer is not where the agent reads it"


# Was broken (hostile review): a HEAD answer announcing over 64 KiB loses its Content-Length
# (re-framed as chunked)
@pytest.mark.parametrize("path", [pytest.param("/v1/big-head", id="HEAD of a 100000-byte body")])
def test_a_head_answer_keeps_its_content_length(rproxy: Proxy, raw_agent, path: str):
    sock = tunnel(rproxy.port, "raw.test:443", proxy_auth(*raw_agent), "raw.test", rproxy.ca_file)
    with sock:
        sock.settimeout(10)
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: raw.test\r\n\r\n".encode())
        head = recv_until(sock).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-length: 100000" in head.lower()


# -- findings: the audit stream --------------------------------------------------------------


# Was broken (hostile review): mitmproxy's 'Cannot parse ClientHello' warning hex-dumps the
# client's raw bytes into the audit stream, unauthenticated
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("proxy", id="bytes sent to the proxy itself reach the audit stream as hex"),
        pytest.param("tunnel", id="bytes sent inside a tunnel reach the audit stream as hex"),
    ],
)
def test_raw_client_bytes_never_reach_the_audit_stream(rproxy: Proxy, raw_agent, where: str):
    marker = b"query-value-" + os.urandom(8).hex().encode()  # 28 bytes
    record = b"\x16\x03\x01" + (len(marker) + 4).to_bytes(2, "big")
    hello = b"\x01" + len(marker).to_bytes(3, "big") + marker
    if where == "proxy":
        sock = socket.create_connection(("127.0.0.1", rproxy.port), timeout=5)
    else:
        sock, reply = connect(rproxy.port, "raw.test:443", proxy_auth(*raw_agent))
        assert reply.status == 200
    with sock:
        sock.sendall(record + hello)
        try:
            sock.recv(100)
        except OSError:
            pass
    out = rproxy.output()
    dumped = marker.hex() in out or marker.decode() in out
    assert not dumped, "the client's raw bytes are in the audit stream"


# -- attacks that held: redaction ------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/mixed-held", id="a held body with every byte escaped another way"),
        pytest.param("/v1/mixed-streamed", id="a chunked body in 3-byte chunks, mixed escapes"),
        pytest.param("/v1/gzip-streamed", id="a gzip body in 5-byte chunks despite identity"),
        pytest.param("/v1/html-streamed", id="HTML character references in 3-byte chunks"),
        pytest.param("/v1/reason", id="the reason phrase is the secret"),
        pytest.param("/v1/header-name", id="a header name holds it, a value escapes it"),
        pytest.param("/v1/large-held-edge", id="a held body of exactly 64 KiB ending in it"),
    ],
)
@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_echoes_in_every_promised_form_are_redacted(
    rproxy: Proxy, raw_agent, path: str, http2: bool
):
    reply = fetch(rproxy, raw_agent, "raw.test", path, http2)
    assert reply.status == 200
    leaked = _leaks(reply.raw) or _mixed_escapes(SECRET) in reply.raw
    leaked = leaked or _references(SECRET) in reply.raw or _references(SECRET[2:]) in reply.raw
    assert not leaked, "the agent received the secret"
    if path in ("/v1/mixed-held", "/v1/mixed-streamed", "/v1/gzip-streamed", "/v1/html-streamed"):
        marked = b"[REDACTED]" in reply.body
        assert marked
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


# -- attacks that held: destination binding --------------------------------------------------


def test_a_second_connect_inside_a_tunnel_is_refused(rproxy: Proxy, api: Upstream, names):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"])
    rproxy.wait_reload()
    sock, reply = connect(rproxy.port, "raw.test:443", proxy_auth(principal, token))
    with sock:
        assert reply.status == 403  # raw.test is not granted to this principal
        # The same connection: CONNECT to a granted host, then plaintext CONNECT inside it.
        sock.sendall(
            b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
            + f"Proxy-Authorization: {proxy_auth(principal, token)}\r\n\r\n".encode()
        )
        assert read_reply(sock).status == 200
        inner = (
            b"CONNECT raw.test:443 HTTP/1.1\r\nHost: raw.test:443\r\n"
            + f"Proxy-Authorization: {proxy_auth(principal, token)}\r\n\r\n".encode()
        )
        try:
            answer = exchange(sock, inner)
            assert answer.status in (400, 403, 407)
        except (ConnectionError, OSError):
            pass
    forwarded = len(api.log.requests)
    assert forwarded == 0


def test_plaintext_inside_a_tunnel_never_gets_the_credential(rproxy: Proxy, api: Upstream, names):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"])
    rproxy.wait_reload()
    sock, reply = connect(rproxy.port, "api.test:443", proxy_auth(principal, token))
    with sock:
        assert reply.status == 200
        answer = exchange(sock, b"GET /v1/x HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
    assert answer.status == 403
    assert answer.reason == "insecure-scheme"
    forwarded = len(api.log.requests)
    assert forwarded == 0


def test_h2_scheme_http_inside_a_tls_tunnel_still_gets_https_rules(
    rproxy: Proxy, api: Upstream, names
):
    """`:scheme http` on a TLS tunnel: mitmproxy takes the scheme from the connection."""
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["api.test"])
    rproxy.wait_reload()
    with h2_tunnel(rproxy, proxy_auth(principal, token), "api.test") as tls:
        answer = h2_get(tls, "api.test", "/v1/echo-auth", scheme="http")
    status, body = answer.status, answer.body
    assert status is not None
    leaked = _leaks(body)
    assert not leaked, "the agent received the secret"
    for r in api.log.requests:
        assert r.sni == "api.test"


def test_a_raw_deflate_body_echoing_the_secret_is_never_delivered(rproxy: Proxy, raw_agent):
    """`deflate` without its zlib header cannot be decoded: fail closed, nothing decoded leaks."""
    reply = fetch(rproxy, raw_agent, "raw.test", "/v1/raw-deflate", False)
    leaked = _leaks(reply.raw) or _raw_deflate(b"token=" + SECRET) in reply.raw
    assert not leaked, "the agent received the secret"
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


# Was broken (hostile review): an undecodable Content-Encoding raises inside the stream
# callable: mitmproxy's connection handler crashes, the agent hangs until a timeout, the audit
# blames the client
@pytest.mark.parametrize(
    "path", [pytest.param("/v1/raw-deflate", id="deflate without its zlib header")]
)
def test_an_undecodable_body_ends_the_agents_stream_at_once(rproxy: Proxy, raw_agent, path: str):
    import httpx

    context = ssl.create_default_context(cafile=str(rproxy.ca_file))
    start = time.monotonic()
    with httpx.Client(proxy=rproxy.url(*raw_agent), verify=context, timeout=6) as client:
        try:
            with client.stream("GET", f"https://raw.test{path}") as reply:
                for _ in reply.iter_raw():
                    pass
        except httpx.HTTPError:
            pass
    took = time.monotonic() - start
    lines = [line for line in rproxy.requests(raw_agent[0]) if line["path"] == path]
    reason = lines[-1].get("reason") if lines else None
    crashed = "mitmproxy has crashed" in rproxy.output()
    assert (took < 3, reason, crashed) == (True, "upstream-protocol-error", False)


# Was broken (hostile review): the client's slot for a query credential is only cleared between
# '&': a ';'-separated parameter of the same name reaches the upstream beside the stamped one
@pytest.mark.parametrize(
    "query",
    [
        pytest.param("a=1;key=agent-value", id="a ';'-separated key parameter is not dropped"),
    ],
)
def test_the_query_slot_is_replaced_whatever_the_separator(
    rproxy: Proxy, api: Upstream, names, query: str
):
    principal, cred = names("rva-q"), names("rva-qcred")
    token = rproxy.store.add_principal(principal)
    rproxy.store.add_credential(cred, "query", ["api.test"], Secret(SECRET), param_name="key")
    rproxy.store.add_grant(principal, ["GET"], credential=cred, paths=["/v1/"])
    rproxy.wait_reload()
    reply = _get(
        rproxy,
        (principal, token),
        "api.test",
        f"GET /v1/x?{query} HTTP/1.1\r\nHost: api.test\r\n\r\n",
    )
    assert reply.status == 200
    [received] = api.log.requests
    pairs = received.target.partition("?")[2].replace(";", "&").split("&")
    keys = sum(1 for pair in pairs if pair.split("=", 1)[0] == "key")
    assert keys == 1, "the upstream sees the agent's value for the credential's parameter"


# Was broken (hostile review): a header credential's slot is cleared by exact name only: the
# same name with underscores, which CGI/WSGI backends read as the slot, reaches the upstream
@pytest.mark.parametrize(
    "sent", [pytest.param("X_Api_Key", id="X_Api_Key beside the stamped X-Api-Key")]
)
def test_the_header_slot_is_replaced_whatever_the_spelling(
    rproxy: Proxy, api: Upstream, names, sent: str
):
    principal, cred = names("rva-h"), names("rva-hcred")
    token = rproxy.store.add_principal(principal)
    rproxy.store.add_credential(
        cred, "header", ["api.test"], Secret(SECRET), header_name="X-Api-Key"
    )
    rproxy.store.add_grant(principal, ["GET"], credential=cred, paths=["/v1/"])
    rproxy.wait_reload()
    head = f"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n{sent}: agent-value\r\n\r\n"
    reply = _get(rproxy, (principal, token), "api.test", head)
    assert reply.status == 200
    [received] = api.log.requests
    slots = sum(1 for k, _ in received.headers if k.lower().replace("_", "-") == "x-api-key")
    assert slots == 1, "the upstream sees the agent's value in the credential's slot"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/trailers-held", id="h2 trailers of a held answer are redacted"),
        pytest.param("/v1/trailers-streamed", id="h2 trailers of a streamed answer are redacted"),
    ],
)
def test_h2_trailers_echoing_the_secret_are_redacted(rproxy: Proxy, names, path: str):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["h2.test"], paths=["/v1/"])
    rproxy.wait_reload()
    with h2_tunnel(rproxy, proxy_auth(principal, token), "h2.test") as tls:
        answer = h2_get(tls, "h2.test", path)
    fields, trailers = answer.fields, answer.trailers
    assert dict(fields).get(b":status") == b"200"
    seen = b"\n".join(k + b": " + v for k, v in trailers)
    leaked = _leaks(seen) or _mixed_escapes(SECRET) in seen
    assert not leaked, "the agent received the secret in a trailer"
    assert b"grpc-message: bad key [REDACTED]" in seen
    logged = _leaks(rproxy.output())
    assert not logged, "the audit stream holds the secret"


# Was broken (hostile review): plain-http proxy requests authenticate one by one: one client
# connection carries two principals, and their upstream connections are shared
@pytest.mark.parametrize(
    "target",
    [
        pytest.param(
            "http://credproxy.internal/access-requests/1",
            id="a second principal's request on the first's keep-alive connection is served",
        )
    ],
)
def test_one_client_connection_carries_one_principal(rproxy: Proxy, names, target: str):
    agents = []
    for _ in range(2):
        principal = names("rva-p") + os.urandom(2).hex()
        agents.append((principal, rproxy.store.add_principal(principal)))
    rproxy.wait_reload()
    sock = socket.create_connection(("127.0.0.1", rproxy.port), timeout=10)
    statuses = []
    with sock:
        for agent in agents:
            head = (
                f"GET {target} HTTP/1.1\r\nHost: credproxy.internal\r\n"
                f"Proxy-Authorization: {proxy_auth(*agent)}\r\n\r\n"
            )
            try:
                statuses.append(exchange(sock, head.encode()).status)
            except (ConnectionError, OSError):
                statuses.append(None)
    # The second principal on the same connection must be refused (or the connection closed).
    assert statuses[1] in (None, 400, 407), statuses


def _h2_get(proxy: Proxy, agent: tuple[str, str], host: str, path: str) -> tuple[bytes, bytes]:
    """(body, trailers as 'name: value' lines) of one h2 GET through a tunnel."""
    with h2_tunnel(proxy, proxy_auth(*agent), host) as tls:
        answer = h2_get(tls, host, path)
    return answer.body, b"\n".join(k + b": " + v for k, v in answer.trailers)


# Was broken (hostile review): the streamed body's held-back tail is flushed before the trailers
# are redacted alone: a secret split between the body's end and a trailer reaches the agent
@pytest.mark.parametrize(
    "path",
    [pytest.param("/v1/body-then-trailer", id="the body ends with its start, a trailer the rest")],
)
def test_a_secret_split_between_body_and_trailers_never_reaches_the_agent(
    rproxy: Proxy, names, path: str
):
    principal, token, cred = _principal(rproxy, names)
    rproxy.store.add_grant(principal, ["GET"], credential=cred, hosts=["h2.test"], paths=["/v1/"])
    rproxy.wait_reload()
    body, trailers = _h2_get(rproxy, (principal, token), "h2.test", path)
    joined = body.removeprefix(b"key: ") + trailers.removeprefix(b"grpc-message: ")
    whole = SECRET in joined
    assert not whole, "the agent can put the secret back together"
