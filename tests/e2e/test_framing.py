"""Answers that carry no body keep their framing: a 304 or a HEAD answer announcing a long body
is never re-framed as chunked, so the agent's keep-alive connection stays in step."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import Proxy
from tests.e2e.raw import proxy_auth, recv_until, tunnel

pytestmark = pytest.mark.e2e


# A 304 announcing over 64 KiB is never re-framed as chunked: a '0' chunk, a body a 304 cannot
# have, would put the agent's keep-alive connection out of step.
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


# A HEAD answer announcing over 64 KiB keeps its Content-Length (never re-framed as chunked).
@pytest.mark.parametrize("path", [pytest.param("/v1/big-head", id="HEAD of a 100000-byte body")])
def test_a_head_answer_keeps_its_content_length(rproxy: Proxy, raw_agent, path: str):
    sock = tunnel(rproxy.port, "raw.test:443", proxy_auth(*raw_agent), "raw.test", rproxy.ca_file)
    with sock:
        sock.settimeout(10)
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: raw.test\r\n\r\n".encode())
        head = recv_until(sock).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-length: 100000" in head.lower()
