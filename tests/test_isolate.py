"""The --isolate forwarder's head rewrite: the session's Proxy-Authorization, never the agent's."""

from __future__ import annotations

import pytest

from addon.isolate import with_credentials

AUTH = "Basic YWdlbnQ6dG9r"


def test_connect_gets_the_sessions_credentials_in_place_of_any_sent() -> None:
    head = b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\nProxy-Authorization: Basic eA=="
    assert with_credentials(head, AUTH) == (
        b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
        b"Proxy-Authorization: Basic YWdlbnQ6dG9r\r\n\r\n"
    )


def test_a_plain_request_is_stamped_and_closed_after_its_answer() -> None:
    head = (
        b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\nConnection: keep-alive\r\n"
        b"PROXY-AUTHORIZATION: Basic eA==\r\nProxy-Connection: keep-alive"
    )
    out = with_credentials(head, AUTH)
    assert out is not None
    lines = out.split(b"\r\n")
    assert lines[0] == b"GET http://plain.test/ HTTP/1.1"
    assert [
        line for line in lines if b"uthorization" in line.lower() or b"onnection" in line.lower()
    ] == [
        b"Proxy-Authorization: Basic YWdlbnQ6dG9r",
        b"Connection: close",
    ]


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"\x16\x03\x01\x02\x00", id="TLS to the proxy port"),
        pytest.param(b"GET / HTTP/2.0", id="not HTTP/1"),
        pytest.param(b"GET  HTTP/1.1", id="a malformed request line"),
    ],
)
def test_anything_else_is_refused(head: bytes) -> None:
    assert with_credentials(head, AUTH) is None
