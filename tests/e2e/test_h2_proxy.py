"""HTTP/2 and one client connection: who is asking, and where the credential goes.

The proxy's own listener speaks HTTP/1.1 (in the clear or over TLS), so one client connection
carries one CONNECT; HTTP/2 is spoken inside a tunnel, to the one host the tunnel names.
"""

from __future__ import annotations

import os
import socket
import ssl

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.echoes import _leaks, _principal
from tests.e2e.raw import connect, exchange, h2_get, h2_streams, h2_tunnel, proxy_auth, read_reply
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

SECRET = b"h2-secret-" + os.urandom(6).hex().encode()


@pytest.fixture
def granted(proxy: Proxy):
    """A principal with a bearer grant on api.test (GET, /v1/) and another one on other.test."""

    def make(**kw) -> tuple[str, str]:
        agent = "h2agent-" + os.urandom(4).hex()
        token = proxy.store.add_principal(agent)
        for host in ("api.test", "other.test"):
            cred = f"{agent}-{host.split('.')[0]}"
            proxy.store.add_credential(cred, "bearer", [host], Secret(SECRET))
            proxy.store.add_grant(agent, ["GET"], credential=cred, paths=["/v1/"], **kw)
        proxy.wait_reload()
        return agent, token

    return make


def tls_to_proxy(proxy: Proxy, alpn: list[str]) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.check_hostname = False
    context.set_alpn_protocols(alpn)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    return context.wrap_socket(sock, server_hostname="proxy.test")


def test_tls_to_the_proxy_negotiates_http1_even_when_h2_is_offered(proxy: Proxy):
    with tls_to_proxy(proxy, ["h2", "http/1.1"]) as sock:
        assert sock.selected_alpn_protocol() == "http/1.1"


def test_tls_to_the_proxy_offering_only_h2_is_refused(proxy: Proxy, upstream: Upstream, granted):
    agent, token = granted()
    try:
        with tls_to_proxy(proxy, ["h2"]) as sock:
            assert sock.selected_alpn_protocol() != "h2"
    except (ssl.SSLError, ConnectionError):
        pass
    assert upstream.log.connections == 0


def test_an_https_proxy_url_works_over_http1(proxy: Proxy, upstream: Upstream, granted):
    agent, token = granted()
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.check_hostname = False
    url = f"https://{agent}:{token}@127.0.0.1:{proxy.port}"
    with httpx.Client(proxy=httpx.Proxy(url, ssl_context=context), verify=context) as client:
        reply = client.get("https://api.test/v1/x")
    assert reply.status_code == 200
    assert upstream.log.requests[0].header("authorization") == [f"Bearer {SECRET.decode()}"]


def test_h2_prior_knowledge_in_the_clear_is_not_a_proxy_connection(
    proxy: Proxy, upstream: Upstream, granted
):
    agent, token = granted()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(validate_outbound_headers=False))
    conn.initiate_connection()
    auth = proxy_auth(agent, token)
    for stream_id, target in ((1, "api.test:443"), (3, "other.test:443")):
        conn.send_headers(
            stream_id,
            [(":method", "CONNECT"), (":authority", target), ("proxy-authorization", auth)],
        )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        try:
            reply = read_reply(sock)
        except (ConnectionError, OSError):
            reply = None
    assert reply is None or reply.status >= 400
    assert upstream.log.connections == 0


def test_a_connect_inside_a_tunnel_is_refused(proxy: Proxy, upstream: Upstream, granted):
    agent, token = granted()
    third, third_token = granted()
    sock, reply = connect(proxy.port, "api.test:443", proxy_auth(agent, token))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    context.set_alpn_protocols(["http/1.1"])
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        inner = exchange(
            tls,
            b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n"
            + f"Proxy-Authorization: {proxy_auth(third, third_token)}\r\n\r\n".encode(),
        )
    assert inner.status == 400  # mitmproxy refuses it before any hook; the hook would too
    assert upstream.log.connections == 0


def get(host: str, path: str) -> list[tuple[str, str]]:
    return [(":method", "GET"), (":scheme", "https"), (":authority", host), (":path", path)]


def test_a_once_grant_used_from_eight_h2_streams_passes_exactly_once(
    proxy: Proxy, upstream: Upstream, granted
):
    agent, token = granted(once=True)
    with h2_tunnel(proxy, proxy_auth(agent, token), "api.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        replies = h2_streams(tls, [get("api.test", "/v1/once")] * 8)
    statuses = sorted(status for status, _ in replies.values())
    assert statuses == [200] + [403] * 7
    reasons = {f.get("x-credproxy-reason") for s, f in replies.values() if s == 403}
    assert reasons == {"grant-consumed"}
    assert len(upstream.log.requests) == 1


def test_h2_streams_in_one_tunnel_go_only_to_the_tunnels_host(
    proxy: Proxy, upstream: Upstream, granted
):
    agent, token = granted()
    with h2_tunnel(proxy, proxy_auth(agent, token), "api.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        replies = h2_streams(tls, [get("api.test", "/v1/a"), get("other.test", "/v1/b")])
    outcomes = sorted((s, f.get("x-credproxy-reason")) for s, f in replies.values())
    assert outcomes == [(200, None), (403, "host-mismatch")]
    assert [r.header("host") for r in upstream.log.requests] == [["api.test"]]
    assert upstream.log.snis == ["api.test"]


def test_each_tunnel_is_judged_by_its_own_credentials(proxy: Proxy, upstream: Upstream, granted):
    # Two CONNECTs, two principals, two hosts: each request is judged as the principal who
    # opened its own tunnel, and each credential rides a connection verified for its host.
    agent, token = granted()
    reader, reader_token = granted()
    with (
        h2_tunnel(proxy, proxy_auth(agent, token), "api.test") as first,
        h2_tunnel(proxy, proxy_auth(reader, reader_token), "other.test") as second,
    ):
        assert first.selected_alpn_protocol() == second.selected_alpn_protocol() == "h2"
        assert [s for s, _ in h2_streams(first, [get("api.test", "/v1/a")]).values()] == [200]
        assert [s for s, _ in h2_streams(second, [get("other.test", "/v1/b")]).values()] == [200]
    assert [(r.sni, r.header("host")) for r in upstream.log.requests] == [
        ("api.test", ["api.test"]),
        ("other.test", ["other.test"]),
    ]
    principals = [r["principal"] for r in proxy.requests() if r["decision"] == "allow"][-2:]
    assert principals == [agent, reader]


# -- one principal per client connection, one destination per tunnel -----------------------


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


# Plain-http proxy requests on one client connection belong to one principal, so two
# principals never share it or its upstream connections.
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


# -- a once-grant raced by the streams of one tunnel ---------------------------------------


def test_a_once_grant_raced_by_h2_streams_of_one_tunnel_serves_one(
    proxy_b: Proxy, names, upstream: Upstream
):
    """Twelve concurrent h2 streams in one tunnel, one once-grant: one 200, the rest
    grant-consumed, one request upstream."""
    name = names("once-h2")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=["api.test"], paths=["/v1/once"], once=True)
    proxy_b.wait_reload()
    request = [(":method", "GET"), (":scheme", "https"), (":authority", "api.test")]
    with h2_tunnel(proxy_b, proxy_auth(name, token), "api.test") as tls:
        tls.settimeout(5)
        replies = h2_streams(tls, [[*request, (":path", "/v1/once")]] * 12)
    statuses = {n: fields[":status"] for n, (_, fields) in replies.items()}
    reasons = {n: fields.get("x-credproxy-reason", "") for n, (_, fields) in replies.items()}
    assert sorted(statuses.values()) == ["200"] + ["403"] * 11
    assert sorted(reasons.values()) == [""] + ["grant-consumed"] * 11
    assert [r.target for r in upstream.log.requests] == ["/v1/once"]
