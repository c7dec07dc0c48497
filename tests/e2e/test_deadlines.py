"""Deadlines against slow peers: a body trickled or stalled, a head trickled inside a tunnel, a
refused body sent forever are all cut off; an answer whose bytes keep flowing is never cut.

The conftest's `proxy_b` runs with second-long deadlines: head 1 s, idle 2 s, connect 1 s,
upstream 2 s.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable

import pytest

from tests.e2e.conftest import Proxy, _internal_head
from tests.e2e.raw import closed_by_peer, connect, h2_get, h2_tunnel, proxy_auth, read_reply

pytestmark = pytest.mark.e2e


@pytest.fixture
def poster(proxy_b: Proxy, names: Callable[[str], str]) -> tuple[str, str]:
    name = names("poster")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET", "POST"], hosts=["api.test"])
    proxy_b.wait_reload()
    return name, token


def _trickle(sock: socket.socket | ssl.SSLSocket, seconds: float, gap: float) -> bool:
    """Send one byte every `gap` s for `seconds`; True if the proxy closed the connection."""
    deadline = time.monotonic() + seconds
    sock.settimeout(gap)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b" ")
        except OSError:
            return True
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


# -- slow writers --------------------------------------------------------------------------


# A body to credproxy.internal trickled a byte at a time has a deadline too.
def test_a_body_trickled_to_credproxy_internal_is_cut_off(proxy_b: Proxy, bystander):
    """16 KiB announced, one byte every 0.4 s: the head (1 s), idle (2 s) and upstream (2 s)
    deadlines are all long past after 8 s, yet the proxy holds the connection and its buffer."""
    with socket.create_connection(("127.0.0.1", proxy_b.port)) as sock:
        sock.sendall(_internal_head(bystander, "POST", "/access-requests", 16000) + b"{")
        assert _trickle(sock, seconds=8, gap=0.4)


# A request body that stops mid-way never holds the client and upstream connections for
# mitmproxy's 10 min.
def test_a_request_body_that_stalls_midway_is_cut_off(proxy_b: Proxy, poster):
    """Half of an announced body, then silence: nothing of head, idle or upstream timeout
    applies (the request hook, which starts the upstream timer, waits for the body's end)."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*poster))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        head = b"POST /v1/upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: 1000\r\n\r\n"
        tls.sendall(head + b"x" * 500)
        assert closed_by_peer(tls, within=8)  # type: ignore[arg-type]


def test_a_request_head_trickled_inside_a_tunnel_is_cut_off(proxy_b: Proxy, bystander):
    """The head deadline (1 s) counts from the first byte of a later head in a tunnel."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*bystander))
    assert reply.status == 200
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.sendall(b"GET /v1/x HTTP/1.1\r\nHost: api.test\r\n\r\n")
        assert read_reply(tls).status == 200
        tls.sendall(b"GET /v1/x HTTP/1.1\r\n")
        assert _trickle(tls, seconds=5, gap=0.2)


def test_a_refused_body_trickled_forever_is_cut_off_by_the_idle_deadline(proxy_b: Proxy, bystander):
    """A body to an ungranted path: answered at once, the body dropped, the connection closed
    within the idle deadline however slowly the client keeps sending."""
    sock, reply = connect(proxy_b.port, "api.test:443", proxy_auth(*bystander))
    context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
    with context.wrap_socket(sock, server_hostname="api.test") as tls:
        tls.sendall(b"POST /v1/x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100000\r\n\r\n")
        assert read_reply(tls).reason == "method-not-allowed"
        assert _trickle(tls, seconds=6, gap=0.3)


# -- slow upstreams ------------------------------------------------------------------------


# Every byte of a small response of known length resets the stall timer (--upstream-timeout),
# as it does for a streamed body: an answer whose bytes keep flowing is never cut.
@pytest.mark.parametrize("http2", [False, True], ids=["HTTP/1", "HTTP/2"])
def test_a_small_response_that_keeps_flowing_is_not_cut_as_a_stall(
    proxy_b: Proxy, names, http2: bool
):
    """README: 'Upstream stall mid-response (no data for) 30 s'. Here --upstream-timeout is
    2 s and a byte arrives every 0.25 s, for 10 s; held whole, it reaches the client at the
    end, so the client waits longer than `get`'s 10 s."""
    host = "drip2.test" if http2 else "drip.test"
    name = names("drip")
    token = proxy_b.store.add_principal(name)
    proxy_b.store.add_grant(name, ["GET"], hosts=[host])
    proxy_b.wait_reload()
    if http2:
        with h2_tunnel(proxy_b, proxy_auth(name, token), host) as tls:
            tls.settimeout(20)
            answer = h2_get(tls, host, "/v1/x")
        status, body = answer.status, answer.body
    else:
        sock, connected = connect(proxy_b.port, f"{host}:443", proxy_auth(name, token))
        assert connected.status == 200
        context = ssl.create_default_context(cafile=str(proxy_b.ca_file))
        with context.wrap_socket(sock, server_hostname=host) as tls:
            tls.settimeout(20)
            tls.sendall(f"GET /v1/x HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            reply = read_reply(tls)
        status, body = reply.status, reply.body
    assert (status, body) == (200, b"d" * 40)
    line = [r for r in proxy_b.requests(name) if r.get("host") == host][-1]
    assert (line["decision"], line.get("error")) == ("allow", None)
