"""A refused request's body costs the proxy nothing: answered at once, dropped unread.

Each case pushes a large body at a request the proxy refuses and measures the proxy's resident
memory (VmRSS from /proc) around it; a principal with a grant is served meanwhile.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess

import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.memory import Peak
from tests.e2e.raw import connect, proxy_auth, push, read_reply
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

BODY = 192 * 1024 * 1024
GROWTH_BOUND = 32 * 1024 * 1024


@pytest.fixture
def agent(proxy: Proxy) -> tuple[str, str]:
    name = "refuse-" + os.urandom(3).hex()
    token = proxy.store.add_principal(name)
    proxy.store.add_credential(name + "-c", "bearer", ["api.test"], Secret(b"refusal-secret"))
    proxy.store.add_grant(name, ["GET", "POST"], credential=name + "-c", paths=["/v1/"])
    proxy.wait_reload()
    return name, token


def served_meanwhile(proxy: Proxy, agent: tuple[str, str]) -> int:
    with proxy.client(*agent) as client:
        return client.get("https://api.test/v1/ok").status_code


def test_a_refused_upload_is_answered_before_its_body_and_not_held(
    proxy: Proxy, upstream: Upstream, agent
):
    with Peak(proxy.process.pid) as peak:
        sock, reply = connect(proxy.port, "api.test:443", proxy_auth(*agent))
        assert reply.status == 200
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        context.set_alpn_protocols(["http/1.1"])
        with context.wrap_socket(sock, server_hostname="api.test") as tls:
            head = f"POST /denied HTTP/1.1\r\nHost: api.test\r\nContent-Length: {BODY}\r\n\r\n"
            answer = push(tls, head.encode(), BODY)
        assert answer is not None
        assert (answer.status, answer.reason) == (403, "path-not-allowed")
        assert answer.headers.get("connection") == "close"
    assert peak.growth < GROWTH_BOUND
    assert upstream.log.requests == []
    assert served_meanwhile(proxy, agent) == 200


def test_a_refused_request_asking_to_continue_gets_its_answer_instead(
    proxy: Proxy, upstream: Upstream, agent
):
    head = (
        "POST http://api.test/v1/x HTTP/1.1\r\nHost: api.test\r\n"
        f"Proxy-Authorization: {proxy_auth(*agent)}\r\n"
        f"Content-Length: {BODY}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = read_reply(sock)
    assert (answer.status, answer.reason) == (403, "insecure-scheme")
    assert upstream.log.connections == 0


@pytest.mark.parametrize(
    ("framing", "sent"),
    [
        pytest.param(f"Content-Length: {BODY}", BODY, id="a declared body over the limit"),
        pytest.param("Transfer-Encoding: chunked", BODY, id="a chunked body of any length"),
    ],
)
def test_the_internal_endpoint_refuses_large_bodies_unread(proxy: Proxy, agent, framing, sent):
    with Peak(proxy.process.pid) as peak:
        head = (
            "POST http://credproxy.internal/access-requests HTTP/1.1\r\n"
            f"Host: credproxy.internal\r\nProxy-Authorization: {proxy_auth(*agent)}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            answer = push(sock, head.encode(), sent)
        assert answer is not None
        assert (answer.status, answer.reason) == (413, "body-too-large")
    assert peak.growth < GROWTH_BOUND
    assert served_meanwhile(proxy, agent) == 200


def test_curl_sees_the_refusal_of_a_streamed_upload(proxy: Proxy, upstream: Upstream, agent):
    with Peak(proxy.process.pid) as peak:
        url = proxy.url(*agent)
        feed = subprocess.Popen(["head", "-c", str(BODY), "/dev/zero"], stdout=subprocess.PIPE)
        result = subprocess.run(
            ["curl", "-sS", "-x", url, "--cacert", str(proxy.ca_file), "-X", "POST", "-T", "-"]
            + ["-o", "/dev/null", "-w", "%{http_code}", "--max-time", "30"]
            + ["https://api.test/denied"],
            stdin=feed.stdout,
            capture_output=True,
            timeout=60,
        )
        feed.kill()
        feed.wait()
        assert result.stdout == b"403", result.stderr
    assert peak.growth < GROWTH_BOUND
    assert upstream.log.requests == []
