"""Hostile requests over raw sockets: CONNECT authority, SNI, Host and target each forged.

Every case asserts the status, the reason code, and that the upstream received nothing.
A reason of None marks what mitmproxy's own HTTP parser refuses before any hook runs
(still a 4xx, still nothing upstream): credproxy's JSON `bad-request` (addon.wire), or a close.
"""

from __future__ import annotations

import os
import ssl

import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.raw import connect, exchange, h2_get, h2_tunnel, proxy_auth, tunnel
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

OK_HOST = "Host: api.test\r\n"
WS_HEADERS = "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


def req(line: str, headers: str = OK_HOST, body: str = "") -> bytes:
    return f"{line} HTTP/1.1\r\n{headers}\r\n{body}".encode("utf-8", "surrogateescape")


# (CONNECT authority, SNI, raw request or None for CONNECT-only, status, reason)
CASES = [
    # -- the CONNECT gate ---------------------------------------------------------------
    pytest.param(
        "evil.test:443", "evil.test", None, 403, "no-grant", id="CONNECT to an ungranted host"
    ),
    pytest.param(
        "api.test:8443", "api.test", None, 403, "no-grant", id="CONNECT to an ungranted port"
    ),
    pytest.param("api.test:0", "api.test", None, 400, None, id="CONNECT to port 0"),
    pytest.param(
        "api.test.:443", "api.test", None, 400, "bad-request", id="CONNECT with a trailing dot"
    ),
    pytest.param(
        "api.test:443@evil.test",
        "api.test",
        None,
        400,
        None,
        id="CONNECT with userinfo-like authority",
    ),
    pytest.param("user@api.test:443", "api.test", None, 400, None, id="CONNECT with userinfo"),
    pytest.param(
        "xn--pi-7ba.test:443",
        "xn--pi-7ba.test",
        None,
        400,
        None,
        id="CONNECT to an invalid punycode look-alike",
    ),
    pytest.param(
        "xn--pi-6kc.test:443",
        "xn--pi-6kc.test",
        None,
        400,
        "bad-request",
        id="CONNECT to a valid punycode look-alike",
    ),
    pytest.param(
        "\u0430pi.test:443", "api.test", None, 400, None, id="CONNECT to a Cyrillic look-alike"
    ),
    pytest.param("127.0.0.1:443", None, None, 403, "no-grant", id="CONNECT to loopback literal"),
    pytest.param(
        "2130706433:443", None, None, 403, "no-grant", id="CONNECT to decimal IPv4 literal"
    ),
    pytest.param("0x7f.1:443", None, None, 403, "no-grant", id="CONNECT to hex IPv4 literal"),
    pytest.param("0x7f000001:443", None, None, 403, "no-grant", id="CONNECT to one hex number"),
    pytest.param("127.1:443", None, None, 403, "no-grant", id="CONNECT to short-form IPv4"),
    pytest.param("0177.0.0.1:443", None, None, 403, "no-grant", id="CONNECT to octal IPv4"),
    pytest.param("[::1]:443", None, None, 403, "no-grant", id="CONNECT to IPv6 loopback"),
    pytest.param(
        "[::ffff:127.0.0.1]:443", None, None, 403, "no-grant", id="CONNECT to IPv4-mapped loopback"
    ),
    pytest.param(
        "[fe80::1%25lo]:443", None, None, 403, "no-grant", id="CONNECT to IPv6 with a zone id"
    ),
    pytest.param(
        "169.254.169.254:80", None, None, 403, "no-grant", id="CONNECT to the metadata service"
    ),
    # -- Host, SNI and authority binding ------------------------------------------------
    pytest.param(
        "api.test:443",
        "evil.test",
        req("GET /v1/x"),
        403,
        "host-mismatch",
        id="SNI names another host",
    ),
    pytest.param("api.test:443", None, req("GET /v1/x"), 403, "host-mismatch", id="no SNI"),
    pytest.param(
        "api.test:443",
        "api.test.",
        req("GET /v1/x"),
        403,
        "host-mismatch",
        id="SNI with a trailing dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: evil.test\r\n"),
        403,
        "host-mismatch",
        id="Host names another host",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: api.test:8443\r\n"),
        403,
        "host-mismatch",
        id="Host names another port",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: api.test:0443\r\n"),
        400,
        "bad-request",
        id="Host with a zero-padded port",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: api.test:0\r\n"),
        400,
        "bad-request",
        id="Host with port 0",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: api.test.\r\n"),
        400,
        "bad-request",
        id="Host with a trailing dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: user@api.test\r\n"),
        400,
        "bad-request",
        id="Host with userinfo",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: api.test\r\nHost: evil.test\r\n"),
        400,
        "bad-request",
        id="two Host headers",
    ),
    pytest.param(
        "api.test:443", "api.test", req("GET /v1/x", ""), 400, "bad-request", id="no Host header"
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", "Host: 127.0.0.1\r\n"),
        403,
        "host-mismatch",
        id="Host is an IP literal",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET https://evil.test/v1/x"),
        403,
        "host-mismatch",
        id="absolute-form names another host",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET https://api.test:8443/v1/x"),
        403,
        "host-mismatch",
        id="absolute-form names another port",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET https://user:pw@api.test/v1/x"),
        400,
        None,
        id="absolute-form with userinfo",
    ),
    # -- paths ------------------------------------------------------------------------
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/../admin"),
        403,
        "path-not-allowed",
        id="dot-dot traversal",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%2e%2e/admin"),
        403,
        "path-not-allowed",
        id="encoded dot-dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%2E%2E/admin"),
        403,
        "path-not-allowed",
        id="upper-case encoded dot-dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/.%2e/admin"),
        403,
        "path-not-allowed",
        id="half-encoded dot-dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%252e%252e/admin"),
        400,
        "bad-request",
        id="double-encoded dot-dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%25252e/admin"),
        400,
        "bad-request",
        id="triple-encoded dot",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1\\..\\admin"),
        400,
        "bad-request",
        id="backslash traversal",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%5c..%5cadmin"),
        400,
        "bad-request",
        id="encoded backslash traversal",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/..;/admin"),
        400,
        "bad-request",
        id="dot-dot-semicolon traversal",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1;x=1/items"),
        400,
        "bad-request",
        id="matrix parameter",
    ),
    pytest.param(
        "api.test:443", "api.test", req("GET /v1/a%3bb"), 400, "bad-request", id="encoded semicolon"
    ),
    pytest.param(
        "api.test:443", "api.test", req("GET /v1//items"), 400, "bad-request", id="empty segment"
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET //v1/items"),
        400,
        "bad-request",
        id="leading double slash",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%2f/items"),
        400,
        "bad-request",
        id="a segment that is only an encoded slash",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/a%2F..%2F..%2Fadmin"),
        400,
        "bad-request",
        id="dot-dot between encoded slashes",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%2e%2e%2fadmin"),
        400,
        "bad-request",
        id="encoded dot-dot before an encoded slash",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/a%2F%2Fb"),
        400,
        "bad-request",
        id="an empty part between encoded slashes",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/a%2F%5cb"),
        400,
        "bad-request",
        id="an encoded backslash beside an encoded slash",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /repos/group%2Fproject/issues"),
        403,
        "path-not-allowed",
        id="a star never matches a segment holding an encoded slash",
    ),
    pytest.param(
        "api.test:443", "api.test", req("GET /v1/%00"), 400, "bad-request", id="encoded NUL"
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%0d%0aX-Injected:%201"),
        400,
        "bad-request",
        id="encoded CRLF",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%c0%ae%c0%ae/admin"),
        400,
        "bad-request",
        id="overlong UTF-8 dots",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%ed%a0%80"),
        400,
        "bad-request",
        id="UTF-8 surrogate",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/%ef%bc%8e%ef%bc%8e/admin"),
        400,
        "bad-request",
        id="fullwidth dots",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x#frag"),
        400,
        "bad-request",
        id="fragment in the target",
    ),
    pytest.param(
        "api.test:443", "api.test", req("OPTIONS *"), 400, "bad-request", id="asterisk-form"
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /../v1/items"),
        400,
        "bad-request",
        id="climbing above the root",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /V1/items"),
        403,
        "path-not-allowed",
        id="path case change",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1"),
        403,
        "path-not-allowed",
        id="pattern /v1/ is strictly below",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1x/items"),
        403,
        "path-not-allowed",
        id="segment boundary",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v%31x/items"),
        403,
        "path-not-allowed",
        id="encoded digit across a boundary",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /repos/a/b/issues"),
        403,
        "path-not-allowed",
        id="star matches one segment only",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /repos//issues"),
        400,
        "bad-request",
        id="star never matches an empty segment",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x?y=1#frag"),
        400,
        "bad-request",
        id="fragment after the query",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/caf\u00e9"),
        400,
        "bad-request",
        id="raw non-ASCII in the target",
    ),
    # -- methods ----------------------------------------------------------------------
    pytest.param(
        "api.test:443",
        "api.test",
        req("get /v1/x"),
        403,
        "method-not-allowed",
        id="lower-case method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("Get /v1/x"),
        403,
        "method-not-allowed",
        id="mixed-case method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("DELETE /v1/x"),
        403,
        "method-not-allowed",
        id="ungranted method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("POST /v1/x", OK_HOST + "X-HTTP-Method-Override: DELETE\r\nContent-Length: 0\r\n"),
        403,
        "method-not-allowed",
        id="X-HTTP-Method-Override to an ungranted method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("POST /v1/x", OK_HOST + "X-HTTP-Method: PUT\r\nContent-Length: 0\r\n"),
        403,
        "method-not-allowed",
        id="X-HTTP-Method to an ungranted method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("POST /v1/x", OK_HOST + "X-Method-Override: PATCH\r\nContent-Length: 0\r\n"),
        403,
        "method-not-allowed",
        id="X-Method-Override to an ungranted method",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "X-HTTP-Method-Override: delete\r\n"),
        403,
        "method-not-allowed",
        id="lower-case override",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req(
            "GET /v1/x",
            OK_HOST + "Connection: Upgrade\r\nUpgrade: websocket\r\n" + WS_HEADERS,
        ),
        403,
        "upgrade-not-allowed",
        id="WebSocket upgrade without a websocket grant",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "Connection: Upgrade\r\nUpgrade: h2c\r\n"),
        403,
        "upgrade-not-allowed",
        id="h2c upgrade",
    ),
    # -- framing and header injection ---------------------------------------------------
    pytest.param(
        "api.test:443",
        "api.test",
        req(
            "POST /v1/x",
            OK_HOST + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
            "0\r\n\r\n",
        ),
        400,
        None,
        id="Content-Length with Transfer-Encoding",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("POST /v1/x", OK_HOST + "Content-Length: 1\r\nContent-Length: 2\r\n", "ab"),
        400,
        None,
        id="conflicting Content-Length",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("POST /v1/x", OK_HOST + "Transfer-Encoding: chunked, identity\r\n", "0\r\n\r\n"),
        400,
        None,
        id="obfuscated Transfer-Encoding",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "X-A: a\rb\r\n"),
        400,
        "bad-request",
        id="bare CR in a header value",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "X-A: a\x00b\r\n"),
        400,
        "bad-request",
        id="NUL in a header value",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "X A: b\r\n"),
        400,
        None,
        id="space in a header name",
    ),
    pytest.param(
        "api.test:443",
        "api.test",
        req("GET /v1/x", OK_HOST + "X-A: a\r\n b\r\n"),
        400,
        "bad-request",
        id="obsolete line folding",
    ),
]


@pytest.fixture(scope="module")
def agent(proxy: Proxy) -> tuple[str, str]:
    name = "hostile-" + os.urandom(3).hex()
    token = proxy.store.add_principal(name)
    cred = name + "-cred"
    proxy.store.add_credential(cred, "bearer", ["api.test"], Secret(b"hostile-secret"))
    proxy.store.add_grant(name, ["GET", "POST"], credential=cred, paths=["/v1/", "/repos/*/issues"])
    proxy.wait_reload()
    return name, token


def test_there_are_at_least_sixty_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize(("authority", "sni", "raw", "status", "reason"), CASES)
def test_hostile(proxy: Proxy, upstream: Upstream, agent, authority, sni, raw, status, reason):
    auth = proxy_auth(*agent)
    if raw is None:
        sock, reply = connect(proxy.port, authority, auth)
        sock.close()
    else:
        sock = tunnel(proxy.port, authority, auth, sni, proxy.ca_file)
        with sock:
            try:
                reply = exchange(sock, raw)
            except (ConnectionError, ssl.SSLError, OSError):
                reply = None
        if reply is None:
            assert reason is None, "the proxy closed the connection instead of answering"
            assert upstream.log.connections == 0
            return
    assert (reply.status, reply.reason) == (status, reason or "bad-request")
    assert upstream.log.connections == 0
    assert upstream.log.requests == []


def test_a_well_formed_request_passes(proxy: Proxy, upstream: Upstream, agent):
    sock = tunnel(proxy.port, "API.test:443", proxy_auth(*agent), "api.test", proxy.ca_file)
    with sock:
        reply = exchange(sock, req("GET /v1/%7Euser/./x", "Host: API.TEST:443\r\n"))
    assert reply.status == 200
    [received] = upstream.log.requests
    assert received.target == "/v1/~user/x"
    assert received.header("authorization") == ["Bearer hostile-secret"]


def test_an_encoded_slash_reaches_the_upstream_encoded(proxy: Proxy, upstream: Upstream, agent):
    sock = tunnel(proxy.port, "api.test:443", proxy_auth(*agent), "api.test", proxy.ca_file)
    with sock:
        reply = exchange(sock, req("GET /v1/@scope%2fname/-/x?q=%2f"))
    assert reply.status == 200
    [received] = upstream.log.requests
    assert received.target == "/v1/@scope%2Fname/-/x?q=%2f"
    [line] = [r for r in proxy.requests(agent[0]) if r["path"] == "/v1/@scope%2Fname/-/x"]
    assert line["decision"] == "allow"


def test_an_encoded_slash_from_an_h2_client_reaches_the_upstream_encoded(
    proxy: Proxy, upstream: Upstream, agent
):
    with h2_tunnel(proxy, proxy_auth(*agent), "api.test") as tls:
        answer = h2_get(tls, "api.test", "/v1/group%2fproject/issues")
    assert answer.status == 200
    [received] = upstream.log.requests
    assert received.target == "/v1/group%2Fproject/issues"


@pytest.mark.parametrize(
    ("inner", "status", "reason"),
    [
        pytest.param(None, 200, None, id="the tunnel's own credentials: dropped, passes"),
        pytest.param(("someone", "else"), 407, "auth-required", id="invalid credentials: refused"),
        pytest.param("third", 407, "auth-required", id="another principal's: refused"),
    ],
)
def test_proxy_authorization_inside_a_tunnel_is_never_another_principal(
    proxy: Proxy, upstream: Upstream, agent, inner, status, reason
):
    if inner is None:
        inner = agent
    elif inner == "third":
        name = "third-" + os.urandom(3).hex()
        inner = (name, proxy.store.add_principal(name))
        proxy.store.add_grant(name, ["GET"], hosts=["api.test"])
        proxy.wait_reload()
    sock = tunnel(proxy.port, "api.test:443", proxy_auth(*agent), "api.test", proxy.ca_file)
    with sock:
        auth = f"Proxy-Authorization: {proxy_auth(*inner)}\r\n"
        reply = exchange(sock, req("GET /v1/x", OK_HOST + auth))
    assert (reply.status, reply.reason) == (status, reason)
    assert all(r.header("proxy-authorization") == [] for r in upstream.log.requests)
    assert len(upstream.log.requests) == (status == 200)


def _h2_request(
    sock: ssl.SSLSocket, headers: list[tuple[str, str]]
) -> tuple[int | None, dict[str, str]]:
    """One HTTP/2 request with exactly these header fields; (None, {}) on a connection error."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(validate_outbound_headers=False))
    conn.initiate_connection()
    conn.send_headers(1, headers, end_stream=True)
    sock.sendall(conn.data_to_send())
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the proxy closed the h2 connection")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                fields = {k.decode(): v.decode() for k, v in event.headers}
                return int(fields[":status"]), fields
            if isinstance(event, h2.events.ConnectionTerminated):
                return None, {}
        sock.sendall(conn.data_to_send())


REFUSED = ((None, None), (403, "host-mismatch"))


@pytest.mark.parametrize(
    ("authority", "host", "outcomes"),
    [
        pytest.param("api.test", "api.test", ((200, None),), id="both name the granted host"),
        pytest.param("api.test", "evil.test", REFUSED, id=":authority granted, Host another"),
        pytest.param("evil.test", "api.test", REFUSED, id="Host granted, :authority another"),
    ],
)
def test_h2_authority_and_host_header_must_agree(
    proxy: Proxy, upstream: Upstream, agent, authority: str, host: str, outcomes
):
    with h2_tunnel(proxy, proxy_auth(*agent), "api.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        status, fields = _h2_request(
            tls,
            [
                (":method", "GET"),
                (":scheme", "https"),
                (":authority", authority),
                (":path", "/v1/x"),
                ("host", host),
            ],
        )
    # mitmproxy's h2 stack refuses a mismatch itself (PROTOCOL_ERROR); the hook checks both
    # names too (tests/test_proxy.py), so that a change of stack cannot open the gap.
    assert (status, fields.get("x-credproxy-reason")) in outcomes
    if status != 200:
        assert upstream.log.connections == 0
