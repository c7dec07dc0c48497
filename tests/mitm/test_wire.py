"""addon.mitm.wire: the classification of mitmproxy's error text, the pages, and the patches."""

from __future__ import annotations

import json
from typing import Any

import mitmproxy.proxy.layers.http as layers
import pytest
from mitmproxy.proxy.layers.http import _http1, _http2
from mitmproxy.proxy.layers.http._events import RequestProtocolError, ResponseProtocolError
from mitmproxy.test import taddons, tflow
from structlog.testing import capture_logs

from addon.core.reasons import Reason
from addon.mitm import wire
from tests.fakes import Chain, StaticLive, make_policy

SECRET = "sk-unit-0f1e2d3c"
P, U, T = "upstream-protocol-error", "upstream-unreachable", "upstream-tls-error"

UPSTREAM = [
    pytest.param(
        f"Cannot parse HTTP response: Bad HTTP response line: b'HTTP/1.1 2OO {SECRET}'",
        P,
        "bad-status-line",
        id="a bad status line is a protocol error",
    ),
    pytest.param(
        "Cannot parse HTTP response: Bad HTTP response line: b'DEBUG timeout tls ssl refused'",
        P,
        "bad-status-line",
        id="words in the quoted upstream bytes do not change the class",
    ),
    pytest.param(
        f"Cannot parse HTTP response: Invalid header line: b'X-Debug {SECRET}'",
        P,
        "bad-header-line",
        id="a header line without a colon is a protocol error",
    ),
    pytest.param(
        f"Cannot parse HTTP response: invalid content-length header: '{SECRET}'",
        P,
        "bad-content-length",
        id="a Content-Length that is no number is a protocol error",
    ),
    pytest.param(
        f"Cannot parse HTTP response: unknown transfer-encoding header: '{SECRET}'",
        P,
        "bad-transfer-coding",
        id="an unknown transfer coding is a protocol error",
    ),
    pytest.param(
        f"unexpected server response: b'HTTP/1.1 200 OK\\r\\nX-Debug-Auth: {SECRET}\\r\\n'",
        P,
        "truncated-head",
        id="a head cut off is a protocol error",
    ),
    pytest.param(
        "server closed connection", P, "closed-before-response", id="a close before any answer"
    ),
    pytest.param(
        f"HTTP/1 protocol error: illegal chunk header: bytearray(b'{SECRET}\\r\\n')",
        P,
        "bad-chunk",
        id="a chunk-size line that is no number is a protocol error",
    ),
    pytest.param(
        f"HTTP/2 protocol error: Received header value surrounded by whitespace b' {SECRET} '",
        P,
        "h2-protocol-error",
        id="an h2 library error is a protocol error",
    ),
    pytest.param(
        "Received transfer coding other than chunked from server, refusing to prevent request "
        "smuggling attacks. Disable the validate_inbound_headers option to skip this security "
        "check.",
        P,
        "bad-transfer-coding",
        id="a transfer coding other than chunked is a protocol error",
    ),
    pytest.param(
        f"Received invalid header name: b'X({SECRET})' from server, refusing to prevent request "
        "smuggling attacks. Disable the validate_inbound_headers option to skip this security "
        "check.",
        P,
        "invalid-headers",
        id="an invalid header name is a protocol error",
    ),
    pytest.param(
        "Certificate verify failed: unable to get local issuer certificate",
        T,
        "tls-verify-failed",
        id="a certificate that does not verify is a TLS error",
    ),
    pytest.param(
        "The remote server does not speak TLS.",
        T,
        "tls-handshake-failed",
        id="a server without TLS is a TLS error",
    ),
    pytest.param(
        "sslv3 alert handshake failure", T, "tls-handshake-failed", id="a TLS alert is a TLS error"
    ),
    pytest.param(
        "TLS Error: [('SSL routines', '', 'tlsv1 alert unknown ca')]",
        Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED,
        "client-cert-refused",
        id="the upstream not knowing the client certificate's CA refuses it",
    ),
    pytest.param(
        "tlsv13 alert certificate required",
        Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED,
        "client-cert-refused",
        id="an upstream wanting a client certificate refuses its absence",
    ),
    pytest.param(
        "[Errno 111] Connect call failed ('127.0.0.1', 1)",
        U,
        "connection-refused",
        id="a refused connection is unreachable",
    ),
    pytest.param(
        "[Errno -2] Name or service not known",
        "upstream-unresolvable",
        "name-not-resolved",
        id="a name that does not resolve at connect has its own reason",
    ),
    pytest.param(
        "[Errno 104] Connection reset by peer",
        U,
        "connection-reset",
        id="a reset connection is unreachable",
    ),
    pytest.param(
        "[Errno 104] Connect call failed ('127.0.0.1', 1)",
        U,
        "connection-reset",
        id="a connect reset before it completed is a reset, not a refusal",
    ),
    pytest.param(
        "connection closed",
        U,
        "connection-closed",
        id="a close or reset during the upstream TLS handshake is unreachable",
    ),
    pytest.param(
        "[Errno 113] No route to host", U, "no-route", id="no route to the host is unreachable"
    ),
    pytest.param(
        "upstream timeout: no connection in 10 s",
        "upstream-timeout",
        "connect-timeout",
        id="the connect deadline names its phase",
    ),
    pytest.param(
        "upstream timeout: no response in 30 s",
        "upstream-timeout",
        "response-timeout",
        id="the response deadline names its phase",
    ),
    pytest.param(
        "upstream timeout: the response stalled for 30 s",
        "upstream-timeout",
        "response-stalled",
        id="a stalled response names its phase",
    ),
    pytest.param(
        "upstream read timed out",
        "upstream-timeout",
        "timeout",
        id="a message that says timed out is a timeout",
    ),
    pytest.param(
        "Connection killed: credproxy: no allowed request for this connection",
        "internal-error",
        "no-allowed-request",
        id="a connection credproxy refused to open is an internal error",
    ),
    pytest.param(
        "Connection killed: credproxy: dial failed",
        "internal-error",
        "dial-failed",
        id="credproxy's own dial that raised is an internal error",
    ),
    pytest.param(
        "connection closed during the TLS handshake",
        "upstream-unreachable",
        "connection-closed",
        id="a close in credproxy's own handshake is a closed connection",
    ),
    pytest.param(
        "something mitmproxy never said before",
        P,
        "unknown",
        id="an unknown message is a protocol error of unknown class",
    ),
]

CLIENT = [
    pytest.param(
        f"Bad HTTP request line: b'GET / {SECRET} HTTP/1.1'",
        "bad-request",
        "bad-request-head",
        id="a malformed request line is a bad request",
    ),
    pytest.param(
        wire.REQUEST_TRAILERS,
        "bad-request",
        "request-trailers",
        id="request trailers are a bad request",
    ),
    pytest.param(
        "Client disconnected.", None, "client-disconnected", id="a client that left has no reason"
    ),
    pytest.param(
        "stream reset by client (CANCEL)",
        None,
        "client-disconnected",
        id="an h2 client that reset its stream has no reason",
    ),
    pytest.param(
        "HTTP/1 protocol error: illegal chunk header: bytearray(b'zz')",
        "bad-request",
        "bad-request-body",
        id="a malformed request body is a bad request",
    ),
]


@pytest.mark.parametrize(("message", "reason", "error"), UPSTREAM)
def test_upstream_messages_are_classified(message: str, reason: str, error: str):
    failure = wire.classify(message)
    assert (failure.reason, failure.error) == (Reason(reason), error)
    assert SECRET not in failure.message + failure.detail + failure.error


@pytest.mark.parametrize(("message", "reason", "error"), CLIENT)
def test_client_messages_are_classified(message: str, reason: str | None, error: str):
    failure = wire.classify(message, client=True)
    assert (failure.reason, failure.error) == (reason and Reason(reason), error)


def test_received_from_client_is_a_client_failure_even_without_the_flag():
    message = (
        "Received invalid header name: b'X(from server, refusing)' from client, refusing to "
        "prevent request smuggling attacks. Disable the validate_inbound_headers option to "
        "skip this security check."
    )
    assert wire.classify(message).reason is Reason.BAD_REQUEST


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        pytest.param(P, 502, id="a protocol error answers 502"),
        pytest.param(U, 502, id="an unreachable upstream answers 502"),
        pytest.param("upstream-unresolvable", 502, id="a name that does not resolve answers 502"),
        pytest.param(T, 502, id="a TLS failure answers 502"),
        pytest.param("upstream-timeout", 504, id="a timeout answers 504"),
    ],
)
def test_upstream_reasons_have_their_status(reason: str, status: int):
    assert wire.Failure(Reason(reason), "x").status == status


def test_every_fixed_message_classifies_back_to_itself():
    rules = wire.UPSTREAM_PREFIXES + wire.UPSTREAM_WORDS + wire.CLIENT_PREFIXES
    for _, reason, error in rules:
        failure = wire.Failure(reason, error)
        assert wire.classify(failure.message) == failure
        assert wire.classify(failure.message, client=True) == failure


def test_a_forged_fixed_message_is_not_trusted():
    assert wire.classify("[credproxy] internal-error/made-up").error == "unknown"


def test_the_page_is_credproxys_problem_document_without_the_message():
    answer = wire.page(502, f"Cannot parse HTTP response: Bad HTTP line {SECRET}")
    assert answer.status == 502
    assert dict(answer.headers)[b"content-type"] == b"application/problem+json"
    assert dict(answer.headers)[b"x-credproxy-reason"] == P.encode()
    assert json.loads(answer.body) == {
        "type": "urn:credproxy:reason:" + P,
        "title": "Upstream answer unusable",
        "status": 502,
        "detail": "the upstream's answer could not be parsed",
        "error": "upstream-failed",
        "reason": P,
    }
    assert SECRET.encode() not in answer.body


def test_a_client_parse_error_page_is_a_400_bad_request():
    answer = wire.page(400, f"Invalid header line: b'{SECRET}'")
    body = json.loads(answer.body)
    assert (answer.status, body["status"], body["reason"]) == (400, 400, "bad-request")
    assert body["error"] == "denied"
    assert SECRET.encode() not in answer.body


def test_a_tagged_message_names_the_request_and_keeps_its_class():
    failure = wire.Failure(Reason.UPSTREAM_TLS_ERROR, "tls-verify-failed")
    tagged = wire.tag(failure.message, "0b9c1d2e-aaaa-4bbb-8ccc-0123456789ab")
    assert wire.classify(tagged) == failure
    assert wire.tag(tagged, "ffff") == tagged, "tagged once"
    assert json.loads(wire.page(502, tagged).body)["request_id"] == (
        "0b9c1d2e-aaaa-4bbb-8ccc-0123456789ab"
    )
    # Only credproxy's fixed text is tagged, and only with an id's characters.
    assert wire.tag(f"Bad line {SECRET}", "0b9c") == f"Bad line {SECRET}"
    assert wire.tag(failure.message, "x y") == failure.message


@pytest.mark.parametrize(
    ("value", "foreign"),
    [
        pytest.param(b"chunked", False, id="chunked alone passes"),
        pytest.param(b"gzip, chunked", True, id="gzip before chunked is foreign"),
        pytest.param(b"gzip", True, id="gzip alone is foreign"),
        pytest.param(b"identity", True, id="identity is foreign"),
        pytest.param(b"chunked, chunked", True, id="chunked twice is foreign"),
    ],
)
def test_foreign_transfer_codings(value: bytes, foreign: bool):
    assert wire.foreign_coding(((b"Transfer-Encoding", value),)) is foreign


# -- the patches -----------------------------------------------------------------------


def test_install_replaces_what_it_says():
    wire.install()
    owners = {
        "RequestProtocolError.__init__": (RequestProtocolError, "__init__"),
        "ResponseProtocolError.__init__": (ResponseProtocolError, "__init__"),
        f"{_http1.__name__}.make_error_response": (_http1, "make_error_response"),
        "Http2Server._handle_event": (_http2.Http2Server, "_handle_event"),
        f"{layers.__name__}.validate_headers": (layers, "validate_headers"),
        "Http1Client.read_headers": (_http1.Http1Client, "read_headers"),
        "HttpStream._handle_event": (layers.HttpStream, "_handle_event"),
        "HttpStream.handle_protocol_error": (layers.HttpStream, "handle_protocol_error"),
        "HttpStream.check_invalid": (layers.HttpStream, "check_invalid"),
        "Http1Connection.read_body": (_http1.Http1Connection, "read_body"),
    }
    replaced = wire.replaced()
    assert set(replaced) == set(owners)
    for key, (owner, name) in owners.items():
        assert getattr(owner, name) is not replaced[key], key
    assert b"application/problem+json" in _http1.make_error_response(502, f"Bad HTTP {SECRET}")
    wire.install()  # a second call changes nothing
    assert wire.replaced() == replaced


def test_protocol_error_events_carry_fixed_text():
    wire.install()
    text = f"Cannot parse HTTP response: Bad HTTP response line: {SECRET}"
    upstream = ResponseProtocolError(1, text)
    client = RequestProtocolError(1, f"Bad HTTP request line: b'{SECRET}'")
    assert SECRET not in upstream.message and SECRET not in client.message
    assert wire.classify(upstream.message).error == "bad-status-line"
    assert wire.classify(client.message).reason is Reason.BAD_REQUEST
    assert ResponseProtocolError(1, "[Errno 110] Connect timed out").code == 504
    assert ResponseProtocolError(1, "killed", 444).code == 444


def test_install_fails_at_start_when_mitmproxy_changed(monkeypatch: pytest.MonkeyPatch):
    def read_body(self: Any, event: Any) -> Any:
        yield from ()

    monkeypatch.setattr(_http1.Http1Connection, "read_body", read_body)
    with pytest.raises(RuntimeError, match="mitmproxy changed"):
        wire.install.__wrapped__()  # type: ignore[attr-defined]  # the shape check, unguarded


# -- the hooks in addon/proxy/trail.py and addon/proxy/responses.py ---------------------------


def test_the_error_hook_audits_a_fixed_class_never_the_upstream_text():
    addon = Chain(StaticLive(make_policy()))
    lines: list[dict[str, Any]] = []
    addon.trail.write = lambda _, decision, **f: lines.append({"decision": decision, **f})  # type: ignore[method-assign]
    with taddons.context(addon), capture_logs() as logs:
        flow = tflow.tflow(err=True)
        flow.error.msg = f"Cannot parse HTTP response: Bad HTTP response line: b'{SECRET}'"
        addon.trail.begin(flow).allowed = True
        addon.error(flow)
    [line] = lines
    assert line == {"decision": "error", "status": 502, "reason": P, "error": "bad-status-line"}
    assert SECRET not in json.dumps(logs, default=str)


def test_a_streamed_body_cut_by_a_failure_is_audited_as_an_error_not_an_allow():
    addon = Chain(StaticLive(make_policy()))
    lines: list[dict[str, Any]] = []
    addon.trail.write = lambda _, decision, **f: lines.append({"decision": decision, **f})  # type: ignore[method-assign]
    with taddons.context(addon):
        flow = tflow.tflow(resp=True)
        rec = addon.trail.begin(flow)
        rec.allowed = True
        rec.failure = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "undecodable-body")
        addon.trail.response(flow)
    assert lines == [{"decision": "error", "status": 200, "reason": P, "error": "undecodable-body"}]


def test_responseheaders_kills_a_response_with_a_foreign_transfer_coding():
    addon = Chain(StaticLive(make_policy()))
    with taddons.context(addon):
        flow = tflow.tflow(resp=True)
        flow.response.headers["transfer-encoding"] = "gzip, chunked"
        pending = addon.trail.begin(flow)
        pending.allowed = True
        addon.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."
    assert pending.failure == wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "bad-transfer-coding")
