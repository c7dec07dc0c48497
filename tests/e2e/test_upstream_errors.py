"""Misbehaving upstreams: what the agent and the audit stream get when an answer is broken.

Each upstream echoes the stamped secret inside a broken answer. The agent must get
credproxy's problem document with a reason, never mitmproxy's page; the audit line a fixed
error class and the decision `error`, never a denial. Upstreams that cannot be used at all
(an untrusted certificate, a name that does not resolve, a refused or reset connection, a
tarpit) get their own reasons the same way.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trustme

from addon.redaction.redact import forms
from store.crypto import Secret
from tests.e2e.conftest import Proxy, start_proxy, stop_proxy
from tests.e2e.misbehaving import H2Upstream, RawUpstream, chunked, head
from tests.e2e.raw import Answer, exchange, fetch, proxy_auth, read_reply, recv_until, tunnel
from tests.e2e.servers import Resetter, Tarpit

pytestmark = pytest.mark.e2e

SECRET = ("sk-wire+" + os.urandom(8).hex()).encode()
HOSTS = ["h1.test", "h2.test", "badtls.test", "down.test"]
# Reached by name through the resolver, not --resolve: one that does not resolve, one that
# resolves to loopback (forbidden without --allow-private).
UNRESOLVABLE, LOOPBACK = "nowhere.invalid", "localhost"
OTHER_HOSTS = ["reset.test", "tarpit.test", "tlspit.test", UNRESOLVABLE, LOOPBACK]
TIMEOUTS = ["--connect-timeout", "1", "--upstream-timeout", "2"]
PROBLEM_FIELDS = {"type", "title", "status", "detail", "error", "reason", "request_id"}


OK_BODY = b'{"ok": true}'
OK = head(b"HTTP/1.1 200 OK", b"Content-Type: application/json", b"Content-Length: 12") + OK_BODY

SCRIPTS = {
    "/v1/bad-status": lambda s: head(b"HTTP/1.1 2OO " + s),
    "/v1/not-http": lambda s: head(b"DEBUG auth=" + s),
    "/v1/cut-head": lambda s: b"HTTP/1.1 200 OK\r\nX-Debug-Auth: " + s + b"\r\n",
    "/v1/no-colon": lambda s: head(b"HTTP/1.1 200 OK", b"X-Debug " + s),
    "/v1/bad-length": lambda s: head(b"HTTP/1.1 200 OK", b"Content-Length: " + s),
    "/v1/bad-name": lambda s: head(b"HTTP/1.1 200 OK", b"X(" + s + b"): 1", b"Content-Length: 0"),
    "/v1/bad-coding": lambda s: head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: " + s),
    "/v1/chunk-secret": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: chunked") + s + b"\r\n"
    ),
    "/v1/gzip-chunked": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: gzip, chunked")
        + chunked(gzip.compress(b'{"auth": "' + s + b'"}'))
    ),
    "/v1/gzip-eof": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: gzip")
        + gzip.compress(b'{"auth": "' + s + b'"}')
    ),
    "/v1/early-hints": lambda s: (
        head(b"HTTP/1.1 103 Early Hints", b"Link: </a.css>; rel=preload", b"X-Hint-Auth: " + s) + OK
    ),
    "/v1/continue-and-hints": lambda s: (
        head(b"HTTP/1.1 100 Continue")
        + head(b"HTTP/1.1 103 Early Hints", b"X-Hint-Auth: " + s)
        + OK
    ),
    "/v1/te": lambda s: OK,
    "/v1/response-trailers": lambda s: (
        head(b"HTTP/1.1 200 OK", b"Transfer-Encoding: chunked")
        + b"2\r\nok\r\n0\r\nX-Trailer-Auth: "
        + s
        + b"\r\n\r\n"
    ),
    "/v1/trailers": lambda s: b"",  # wait: credproxy must refuse before the body ends
}


def _h2_answer(headers: list[tuple[bytes, bytes]]) -> Any:
    def send(conn: Any, stream_id: int, secret: bytes) -> None:
        fields = [(k, v.replace(b"SECRET", secret)) for k, v in headers]
        conn.send_headers(stream_id, [(k.replace(b"SECRET", secret), v) for k, v in fields])

    return send


H2_SCRIPTS = {
    "/v1/h2-whitespace": _h2_answer([(b":status", b"200"), (b"x-debug", b" SECRET ")]),
    "/v1/h2-upper-name": _h2_answer([(b":status", b"200"), (b"X-SECRET", b"1")]),
}


@pytest.fixture(scope="module")
def servers(upstream_ca: trustme.CA) -> Iterator[dict[str, int]]:
    untrusted = trustme.CA()
    closed = socket.create_server(("127.0.0.1", 0))
    down_port = closed.getsockname()[1]
    closed.close()
    with (
        RawUpstream(upstream_ca, HOSTS, SCRIPTS) as h1,
        H2Upstream(upstream_ca, HOSTS, H2_SCRIPTS) as h2,
        RawUpstream(untrusted, HOSTS, SCRIPTS) as badtls,
        Resetter() as reset,
        Tarpit() as tarpit,
        Tarpit(upstream_ca) as tlspit,
    ):
        yield {  # type: ignore[misc]
            "h1": h1,
            "h2": h2,
            "badtls": badtls,
            "down": down_port,
            "reset": reset.port,
            "tarpit": tarpit.port,
            "tlspit": tlspit.port,
        }


@pytest.fixture(scope="module")
def wire_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    servers: dict[str, Any],
    upstream_ca: trustme.CA,
    initialised_home: Path,
) -> Iterator[Proxy]:
    ports = {
        "h1.test": servers["h1"].port,
        "h2.test": servers["h2"].port,
        "badtls.test": servers["badtls"].port,
        "down.test": servers["down"],
        "reset.test": servers["reset"],
        "tarpit.test": servers["tarpit"],
        "tlspit.test": servers["tlspit"],
    }
    resolve = [f"{name}=127.0.0.1:{port}" for name, port in ports.items()]
    home = tmp_path_factory.mktemp("wire")
    running = start_proxy(home, upstream_ca, resolve, TIMEOUTS, template=initialised_home)
    yield running
    stop_proxy(running)


@pytest.fixture(scope="module")
def agent(wire_proxy: Proxy) -> tuple[str, str]:
    name = "wire-" + os.urandom(3).hex()
    token = wire_proxy.store.add_principal(name)
    hosts = HOSTS + OTHER_HOSTS
    wire_proxy.store.add_credential(name + "-cred", "bearer", hosts, Secret(SECRET))
    wire_proxy.store.add_grant(name, ["GET", "POST"], credential=name + "-cred", paths=["/v1/"])
    wire_proxy.wait_reload()
    return name, token


def leaks(data: bytes | str) -> list[str]:
    """Which forms of the secret `data` holds (their names only: never print the secret)."""
    raw = data.encode("latin-1", "replace") if isinstance(data, str) else data
    found = [f"form {i}" for i, form in enumerate(forms(SECRET)) if form in raw]
    if quote(SECRET.decode(), safe="").encode() in raw or base64.b64encode(SECRET) in raw:
        found.append("encoded")
    return found


def agent_grant(proxy: Proxy, agent: tuple[str, str]) -> int:
    [found] = [g.id for g in proxy.store.list_grants() if g.principal == agent[0]]
    return found


def audit_line(proxy: Proxy, agent: tuple[str, str], path: str) -> dict[str, Any]:
    lines = [line for line in proxy.requests(agent[0]) if line["path"] == path]
    assert lines, "no audit line for this request"
    return lines[-1]


def assert_problem(
    reply: Answer, status: int, reason: str, error: str = "upstream-failed"
) -> dict[str, Any]:
    """credproxy's RFC 9457 answer with this status and reason, never mitmproxy's page."""
    assert reply.status == status
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["x-credproxy-reason"] == reason
    body: dict[str, Any] = reply.json()
    assert set(body) <= PROBLEM_FIELDS
    assert (body["type"], body["status"], body["reason"], body["error"]) == (
        "urn:credproxy:reason:" + reason,
        status,
        reason,
        error,
    )
    assert body["title"] and body["detail"]
    assert b"mitmproxy" not in reply.raw.lower() and b"<html" not in reply.raw.lower()
    return body


def assert_failure_line(
    proxy: Proxy, agent: tuple[str, str], path: str, body: dict[str, Any], expected: tuple
) -> None:
    """The audit line says `error` (never allow, never deny), and names the agent's request."""
    line = audit_line(proxy, agent, path)
    assert (line["decision"], line["status"], line["reason"], line["error"]) == expected
    assert body.get("request_id") == line["request_id"]


def assert_no_leak(proxy: Proxy, *received: bytes | str) -> None:
    for data in received:
        assert leaks(data) == [], "the agent received the secret"
    assert leaks(proxy.output()) == [], "the audit stream holds the secret"
    assert "Traceback" not in proxy.output()


BROKEN_HEADS = [
    pytest.param("/v1/bad-status", "bad-status-line", id="a status line 2OO followed by it"),
    pytest.param("/v1/not-http", "bad-status-line", id="a non-HTTP debug line quoting it"),
    pytest.param("/v1/cut-head", "truncated-head", id="a head cut off after a header with it"),
    pytest.param("/v1/no-colon", "bad-header-line", id="a header line without a colon"),
    pytest.param("/v1/bad-length", "bad-content-length", id="Content-Length is the secret"),
    pytest.param("/v1/bad-name", "invalid-headers", id="a header name made of it"),
    pytest.param("/v1/bad-coding", "bad-transfer-coding", id="Transfer-Encoding is the secret"),
]


@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
@pytest.mark.parametrize(("path", "error"), BROKEN_HEADS)
def test_a_broken_head_echoing_the_secret_gets_credproxys_json(
    wire_proxy: Proxy, agent, path: str, error: str, http2: bool
):
    reply = fetch(wire_proxy, agent, "h1.test", path, http2)
    body = assert_problem(reply, 502, "upstream-protocol-error")
    expected = ("error", 502, "upstream-protocol-error", error)
    assert_failure_line(wire_proxy, agent, path, body, expected)
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/h2-whitespace", id="an h2 header value with whitespace around it"),
        pytest.param("/v1/h2-upper-name", id="an h2 upper-case header name made of it"),
    ],
)
def test_an_h2_protocol_error_built_from_the_secret_gets_credproxys_json(
    wire_proxy: Proxy, agent, path: str
):
    reply = fetch(wire_proxy, agent, "h2.test", path, http2=True)
    body = assert_problem(reply, 502, "upstream-protocol-error")
    expected = ("error", 502, "upstream-protocol-error", "h2-protocol-error")
    assert_failure_line(wire_proxy, agent, path, body, expected)
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_a_chunk_size_line_made_of_the_secret_stays_out_of_the_audit(
    wire_proxy: Proxy, agent, http2: bool
):
    reply = fetch(wire_proxy, agent, "h1.test", "/v1/chunk-secret", http2)
    # The head went out before the body broke: the stream can only end, cut short.
    assert (reply.status, reply.broken) == (200, True)
    line = audit_line(wire_proxy, agent, "/v1/chunk-secret")
    assert (line["decision"], line["status"], line["reason"], line["error"]) == (
        "error",
        200,
        "upstream-protocol-error",
        "bad-chunk",
    )
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize(
    ("host", "status", "reason", "error"),
    [
        pytest.param(
            "badtls.test",
            502,
            "upstream-tls-error",
            "tls-verify-failed",
            id="a certificate from an untrusted CA",
        ),
        pytest.param(
            "down.test",
            502,
            "upstream-unreachable",
            "connection-refused",
            id="nothing listening on the upstream port",
        ),
        pytest.param(
            "reset.test",
            502,
            "upstream-unreachable",
            # Which one depends on whether the reset arrives before asyncio sees the connect
            # complete or during the TLS handshake.
            ("connection-reset", "connection-closed"),
            id="an upstream that resets the connection",
        ),
        pytest.param(
            UNRESOLVABLE,
            502,
            "upstream-unresolvable",
            "name-not-resolved",
            id="a name that does not resolve",
        ),
        pytest.param(
            "tarpit.test",
            504,
            "upstream-timeout",
            "connect-timeout",
            id="an upstream that never completes TLS",
        ),
        pytest.param(
            "tlspit.test",
            504,
            "upstream-timeout",
            "response-timeout",
            id="an upstream that never answers",
        ),
    ],
)
@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_an_upstream_that_cannot_be_used_gets_its_own_reason(
    wire_proxy: Proxy,
    agent,
    host: str,
    status: int,
    reason: str,
    error: str | tuple[str, ...],
    http2: bool,
):
    reply = fetch(wire_proxy, agent, host, "/v1/bad-status", http2)
    body = assert_problem(reply, status, reason)
    line = audit_line(wire_proxy, agent, "/v1/bad-status")
    if isinstance(error, tuple):
        assert line["error"] in error
        error = line["error"]
    expected = ("error", status, reason, error)
    assert_failure_line(wire_proxy, agent, "/v1/bad-status", body, expected)
    assert (line["host"], line["grant_id"]) == (host, agent_grant(wire_proxy, agent))
    assert "detail" not in line or line["detail"] == body["detail"]
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_a_name_that_resolves_to_a_forbidden_address_stays_a_denial(
    wire_proxy: Proxy, agent, http2: bool
):
    reply = fetch(wire_proxy, agent, LOOPBACK, "/v1/bad-status", http2)
    body = assert_problem(reply, 403, "destination-forbidden", error="denied")
    line = [r for r in wire_proxy.requests(agent[0]) if r["host"] == LOOPBACK][-1]
    assert (line["decision"], line["status"], line["reason"]) == (
        "deny",
        403,
        "destination-forbidden",
    )
    assert (body["request_id"], line["grant_id"]) == (line["request_id"], None)
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/gzip-chunked", id="Transfer-Encoding gzip, chunked"),
        pytest.param("/v1/gzip-eof", id="Transfer-Encoding gzip, read until close"),
    ],
)
@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_a_transfer_coding_other_than_chunked_is_refused(
    wire_proxy: Proxy, agent, path: str, http2: bool
):
    reply = fetch(wire_proxy, agent, "h1.test", path, http2)
    body = assert_problem(reply, 502, "upstream-protocol-error")
    expected = ("error", 502, "upstream-protocol-error", "bad-transfer-coding")
    assert_failure_line(wire_proxy, agent, path, body, expected)
    assert_no_leak(wire_proxy, reply.raw)


def test_the_agents_te_header_never_reaches_an_http1_upstream(wire_proxy: Proxy, agent, servers):
    """Not even `trailers`: credproxy refuses trailers over HTTP/1 (addon/mitm/hop.py keeps it
    from HTTP/2 agents for HTTP/2 upstreams only)."""
    sock = tunnel(wire_proxy.port, "h1.test:443", proxy_auth(*agent), "h1.test", wire_proxy.ca_file)
    with sock:
        raw = b"GET /v1/te HTTP/1.1\r\nHost: h1.test\r\nTE: gzip, trailers\r\n\r\n"
        reply = exchange(sock, raw)
    assert reply.status == 200
    te = [v for k, v in servers["h1"].heads[-1] if k.lower() == b"te"]
    assert te == []


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/early-hints", id="103 Early Hints then 200"),
        pytest.param("/v1/continue-and-hints", id="100 Continue, 103 Early Hints, then 200"),
    ],
)
@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_the_final_answer_follows_informational_ones(
    wire_proxy: Proxy, agent, path: str, http2: bool
):
    reply = fetch(wire_proxy, agent, "h1.test", path, http2)
    assert reply.status == 200
    assert reply.json() == {"ok": True}
    line = audit_line(wire_proxy, agent, path)
    assert (line["decision"], line["status"]) == ("allow", 200)
    assert_no_leak(wire_proxy, reply.raw)
    if http2:
        # The hint reaches the agent, its echo of the secret redacted; 100 is mitmproxy's own.
        assert [h[":status"] for h in reply.informational] == ["103"]
        assert reply.informational[0]["x-hint-auth"] == "[REDACTED]"


@pytest.mark.parametrize("path", ["/v1/early-hints", "/v1/continue-and-hints"])
def test_a_103_reaches_an_http1_agent_redacted_before_the_final_answer(
    wire_proxy: Proxy, agent, path: str
):
    sock = tunnel(wire_proxy.port, "h1.test:443", proxy_auth(*agent), "h1.test", wire_proxy.ca_file)
    with sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: h1.test\r\n\r\n".encode())
        data = recv_until(sock, b'"ok"')
    hint, _, final = data.partition(b"\r\n\r\n")
    assert hint.startswith(b"HTTP/1.1 103 Early Hints\r\n")
    assert b"x-hint-auth: [redacted]" in hint.lower()
    assert final.startswith(b"HTTP/1.1 200 ")
    assert_no_leak(wire_proxy, data)


def test_request_trailers_are_refused_with_a_reason(wire_proxy: Proxy, agent):
    sock = tunnel(wire_proxy.port, "h1.test:443", proxy_auth(*agent), "h1.test", wire_proxy.ca_file)
    request = (
        b"POST /v1/trailers HTTP/1.1\r\nHost: h1.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    with sock:
        reply = exchange(sock, request)
    assert (reply.status, reply.reason) == (400, "bad-request")
    assert reply.headers["content-type"] == "application/problem+json"
    assert json.loads(reply.body)["detail"] == "request trailers are not supported"
    line = audit_line(wire_proxy, agent, "/v1/trailers")
    assert (line["status"], line["reason"], line["error"]) == (
        400,
        "bad-request",
        "request-trailers",
    )
    assert "NotImplementedError" not in wire_proxy.output()
    assert_no_leak(wire_proxy)


@pytest.mark.parametrize("http2", [False, True], ids=["agent over HTTP/1", "agent over HTTP/2"])
def test_http1_response_trailers_end_the_stream_cleanly(wire_proxy: Proxy, agent, http2: bool):
    reply = fetch(wire_proxy, agent, "h1.test", "/v1/response-trailers", http2)
    assert (reply.status, reply.broken) == (200, True)
    line = audit_line(wire_proxy, agent, "/v1/response-trailers")
    assert (line["decision"], line["status"], line["reason"], line["error"]) == (
        "error",
        200,
        "upstream-protocol-error",
        "response-trailers",
    )
    assert "NotImplementedError" not in wire_proxy.output()
    assert_no_leak(wire_proxy, reply.raw)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b"GET /v1/x HTTP/1.1\r\nHost: h1.test\r\nBad token-ECHO\r\n\r\n", id="no colon"
        ),
        pytest.param(b"GET /v1/x token-ECHO HTTP/1.1\r\nHost: h1.test\r\n\r\n", id="four words"),
        pytest.param(
            b"GET /v1/x HTTP/1.1\r\nHost: h1.test\r\nContent-Length: token-ECHO\r\n\r\n",
            id="a Content-Length that is no number",
        ),
    ],
)
def test_a_malformed_request_head_gets_a_json_400_without_its_bytes(
    wire_proxy: Proxy, agent, servers, raw: bytes
):
    sock = tunnel(wire_proxy.port, "h1.test:443", proxy_auth(*agent), "h1.test", wire_proxy.ca_file)
    with sock:
        sock.sendall(raw)
        reply = read_reply(sock)
    assert (reply.status, reply.reason) == (400, "bad-request")
    assert reply.headers["content-type"] == "application/problem+json"
    assert b"token-ECHO" not in reply.body and "token-ECHO" not in str(reply.headers)


# -- an undecodable body -------------------------------------------------------------------


# An undecodable Content-Encoding ends the agent's stream at once with a reason that blames
# the upstream; raised inside the stream callable, it would crash mitmproxy's connection
# handler and leave the agent hanging until a timeout.
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
