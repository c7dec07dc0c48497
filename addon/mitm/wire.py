"""What mitmproxy itself puts on the wire: its error pages, 1xx answers, trailers, codings.

mitmproxy builds error pages from upstream bytes and has no hook to change them, so the
patches below replace a few of its internals. `install()` checks the shape of everything it
replaces and raises at start-up if mitmproxy changed: fail closed at start, never open later.

Every protocol error is classified into a `Failure`: a reason code, the status the agent is
answered with, and a fixed error class for the audit line. Upstream text goes no further. The
agent's answer is addon/observe/problem.py's, with the flow's request id where the stream knows it.

One module, about 460 lines: every replacement of what mitmproxy writes on the wire, with its
shape check, in one place a reviewer reads at once.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import mitmproxy.proxy.layers.http as layers
from mitmproxy import http
from mitmproxy.net.http import http1, status_codes
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http import SendHttp, _events, _http1, _http2
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    HttpEvent,
    RequestProtocolError,
    ResponseHeaders,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._http1 import Http1Server

from addon.core.reasons import STATUS, Reason
from addon.mitm import hop, once, via
from addon.mitm.bounds import TIMEOUT_PREFIX
from addon.observe.problem import Problem, problem
from addon.redaction.wsredact import REDACTORS

MARK = "[credproxy] "
REQUEST_TRAILERS = "request trailers are not supported"
RESPONSE_TRAILERS = "response trailers over HTTP/1 are not supported"
FOREIGN_CODING = "transfer coding other than chunked"
_TRAILERS_RAISED = "HTTP trailers are not implemented yet"
# The fixed message every protocol error carries, and the flow's id once its stream saw it.
_ID = r"[0-9a-f-]{1,64}"
_MARKED_RE = re.compile(rf"\[credproxy\] ([a-z-]+)/([a-z0-9-]+)(?: #({_ID}))?")
_ID_RE = re.compile(_ID)
_INFORMATIONAL_RE = re.compile(rb"HTTP/1\.[01][ \t]+1(?!01)[0-9][0-9](?![0-9])")
NO_RESPONSE = 444  # mitmproxy's "send nothing"
CLIENT_CLOSED = 499


@dataclass
class Informational(HttpEvent):
    """A 1xx answer (not 101) from the upstream, on its way to the agent before the final one."""

    response: http.Response


@dataclass(frozen=True)
class Failure:
    """A classified protocol error: no part of it comes from the peer's bytes."""

    reason: Reason | None  # None: the agent went away, there is nobody to answer
    error: str

    @property
    def status(self) -> int | None:
        return None if self.reason is None else STATUS.get(self.reason, 502)

    @property
    def message(self) -> str:
        reason = self.reason.value if self.reason is not None else "none"
        return f"{MARK}{reason}/{self.error}"

    @property
    def detail(self) -> str:
        if self.error in DETAILS:
            return DETAILS[self.error]
        return DETAILS[self.reason.value if self.reason is not None else "none"]


_P, _U, _T = Reason.UPSTREAM_PROTOCOL_ERROR, Reason.UPSTREAM_UNREACHABLE, Reason.UPSTREAM_TLS_ERROR
_B, _N = Reason.BAD_REQUEST, Reason.UPSTREAM_UNRESOLVABLE
_C = Reason.UPSTREAM_TLS_CLIENT_CERT_REFUSED
CLIENT_CERT_ALERTS = (
    "certificate required",
    "bad certificate",
    "unknown ca",
    "certificate expired",
    "certificate revoked",
    "certificate unknown",
    "unsupported certificate",
    "access denied",
)
Rule = tuple[str, Reason | None, str]  # (lower-case text, reason, error class)

# Messages that quote the peer's bytes, matched by their fixed start only: the quoted part
# is the peer's to choose. First match wins.
_TO = Reason.UPSTREAM_TIMEOUT
UPSTREAM_PREFIXES: tuple[Rule, ...] = (
    # The corporate proxy's refusals (addon/mitm/via.py's fixed phrases).
    *((f"{via.PREFIX} {error}", reason, error) for error, (reason, _) in via.ERRORS.items()),
    # addon/proxy/limits.py's deadlines, by phase (its own text: no peer bytes in it).
    (f"{TIMEOUT_PREFIX}: no connection", _TO, "connect-timeout"),
    (f"{TIMEOUT_PREFIX}: no response", _TO, "response-timeout"),
    (f"{TIMEOUT_PREFIX}: the response stalled", _TO, "response-stalled"),
    (f"{TIMEOUT_PREFIX}: the request body stalled", _TO, "request-body-stalled"),
    ("cannot parse http response: bad http response line", _P, "bad-status-line"),
    ("cannot parse http response: invalid header", _P, "bad-header-line"),
    ("cannot parse http response: invalid content-length", _P, "bad-content-length"),
    ("cannot parse http response: unknown transfer-encoding", _P, "bad-transfer-coding"),
    ("cannot parse http response: invalid transfer-encoding", _P, "bad-transfer-coding"),
    ("cannot parse http response", _P, "bad-response-head"),
    ("unexpected server response", _P, "truncated-head"),
    ("server closed connection", _P, "closed-before-response"),
    ("http/1 protocol error: illegal chunk header", _P, "bad-chunk"),
    ("http/1 protocol error", _P, "bad-body-framing"),
    (RESPONSE_TRAILERS.lower(), _P, "response-trailers"),
    ("response body exceeds", _P, "response-too-large"),
    ("http/2 connection closed", _P, "h2-connection-closed"),
    ("peer closed connection", _P, "closed-before-response"),
    ("stream reset by", _P, "h2-stream-reset"),
    ("http/2 protocol error", _P, "h2-protocol-error"),
    ("invalid http/2 response headers", _P, "h2-protocol-error"),
    ("received unexpected http/2 response", _P, "h2-protocol-error"),
    (f"received {FOREIGN_CODING}", _P, "bad-transfer-coding"),
    ("received ", _P, "invalid-headers"),  # validate_inbound_headers: "Received ... from server"
    # mitmproxy's words for a close or reset before the upstream TLS handshake completed.
    ("connection closed", _U, "connection-closed"),
    ("connection killed: credproxy: dial failed", Reason.INTERNAL_ERROR, "dial-failed"),
    ("connection killed: credproxy:", Reason.INTERNAL_ERROR, "no-allowed-request"),
    ("connection killed.", Reason.INTERNAL_ERROR, "killed"),
)
# Connect and TLS failures: no peer bytes in them, so a word anywhere counts.
UPSTREAM_WORDS: tuple[Rule, ...] = (
    ("timed out", Reason.UPSTREAM_TIMEOUT, "timeout"),
    ("timeout", Reason.UPSTREAM_TIMEOUT, "timeout"),
    ("certificate verify failed", _T, "tls-verify-failed"),
    # Alerts the upstream sent about the client's certificate (OpenSSL's words for them).
    *((f"alert {a}", _C, "client-cert-refused") for a in CLIENT_CERT_ALERTS),
    ("tls", _T, "tls-handshake-failed"),
    ("ssl", _T, "tls-handshake-failed"),
    ("alert", _T, "tls-handshake-failed"),
    # asyncio words every failed connect "Connect call failed": the errno tells them apart.
    ("[errno 104]", _U, "connection-reset"),
    ("connect call failed", _U, "connection-refused"),
    ("connection refused", _U, "connection-refused"),
    ("name or service not known", _N, "name-not-resolved"),
    ("name resolution", _N, "name-not-resolved"),
    ("nodename nor servname", _N, "name-not-resolved"),
    ("no address associated", _N, "name-not-resolved"),
    ("no route to host", _U, "no-route"),
    ("network is unreachable", _U, "no-route"),
    ("connection reset", _U, "connection-reset"),
    ("connection cancelled", _U, "connection-cancelled"),
)
CLIENT_PREFIXES: tuple[Rule, ...] = (
    ("the client stopped reading", None, "client-not-reading"),  # addon.limits' h2 bound
    ("client disconnected", None, "client-disconnected"),
    ("stream reset by client", None, "client-disconnected"),
    ("peer closed connection", None, "client-disconnected"),
    ("http/2 connection closed", None, "client-disconnected"),
    ("eof", None, "client-disconnected"),
    ("connection killed.", Reason.INTERNAL_ERROR, "killed"),
    (REQUEST_TRAILERS, _B, "request-trailers"),
    ("request body exceeds", _B, "request-too-large"),
    ("http/1 protocol error", _B, "bad-request-body"),
    ("http/2 protocol error", _B, "bad-request-h2"),
    ("invalid http/2 request headers", _B, "bad-request-h2"),
    ("http request has no host header", _B, "no-host"),
    ("received ", _B, "invalid-request-headers"),  # "Received ... from client"
)
# mitmproxy's own end of "Received {peer text} from client, refusing ...": the start is ours.
_FROM_CLIENT = (
    "from client, refusing to prevent request smuggling attacks. "
    "disable the validate_inbound_headers option to skip this security check."
)
_ALL_RULES = UPSTREAM_PREFIXES + UPSTREAM_WORDS + CLIENT_PREFIXES
_KNOWN = {(r.value if r is not None else "none", e) for _, r, e in _ALL_RULES} | {
    (_P.value, "unknown"),
    (_B.value, "bad-request-head"),
}
# What mitmproxy answers no one for: the connection is just closed (or the stream reset).
_UNANSWERED = frozenset({"killed", "bad-request-body", "bad-request-h2"})

DETAILS = {
    _P.value: "the upstream's answer could not be parsed",
    _U.value: "the upstream could not be reached",
    _N.value: "the host does not resolve",
    _T.value: "the upstream's TLS certificate or handshake failed verification",
    _C.value: "the upstream refused the client certificate, or wanted one",
    Reason.UPSTREAM_TIMEOUT.value: "the upstream did not answer in time",
    Reason.INTERNAL_ERROR.value: "internal error",
    _B.value: "the request could not be parsed",
    "none": "the client went away",
    "bad-transfer-coding": "the upstream used a transfer coding other than chunked",
    "connection-refused": "the upstream refused the connection",
    "connection-reset": "the upstream reset the connection",
    "connection-closed": "the upstream closed or reset the connection before TLS completed",
    "tls-verify-failed": "the upstream's TLS certificate did not verify",
    "request-trailers": REQUEST_TRAILERS,
    "request-too-large": "the request body is too large",
    "minted-credentials": "the upstream's answer held AWS keys, which no agent may receive",
    **{error: detail for error, (_, detail) in via.ERRORS.items()},
}


def classify(message: str, client: bool = False) -> Failure:
    """Map mitmproxy's error text (upstream bytes inside, maybe) to a fixed Failure."""
    marked = _MARKED_RE.fullmatch(message)
    if marked is not None and marked.groups()[:2] in _KNOWN:
        reason, error, _ = marked.groups()
        return Failure(None if reason == "none" else Reason(reason), error)
    text = message.lower()
    if (
        client
        or text.startswith("request body")
        or (text.startswith("received ") and text.endswith(_FROM_CLIENT))
    ):
        rule = next((r for r in CLIENT_PREFIXES if text.startswith(r[0])), None)
        return Failure(_B, "bad-request-head") if rule is None else Failure(rule[1], rule[2])
    rule = next((r for r in UPSTREAM_PREFIXES if text.startswith(r[0])), None)
    rule = rule or next((r for r in UPSTREAM_WORDS if r[0] in text), None)
    return Failure(_P, "unknown") if rule is None else Failure(rule[1], rule[2])


def answers_agent(failure: Failure) -> bool:
    """Does the agent get credproxy's JSON for this failure (if no response has started)?"""
    return failure.reason is not None and failure.error not in _UNANSWERED


def page(code: int, message: str) -> Problem:
    """credproxy's answer in place of mitmproxy's HTML error page."""
    failure = classify(message, client=code < 500)
    marked = _MARKED_RE.fullmatch(message)
    request_id = marked.group(3) if marked is not None else None
    return problem(
        failure.reason or _B,
        failure.detail,
        status=failure.status or code,
        request_id=request_id,
        close=True,
    )


def tag(message: str, flow_id: str) -> str:
    """A fixed message with the flow's id, for the page the agent gets."""
    marked = _MARKED_RE.fullmatch(message)
    if marked is None or marked.group(3) is not None or not _ID_RE.fullmatch(flow_id):
        return message
    return f"{message} #{flow_id}"


def foreign_coding(fields: tuple[tuple[bytes, bytes], ...]) -> bool:
    """Does a response use a transfer coding other than chunked (gzip, identity, ...)?"""
    codings = [
        c.strip().lower()
        for n, v in fields
        if n.lower() == b"transfer-encoding"
        for c in v.split(b",")
    ]
    return any(c != b"chunked" for c in codings) or len(codings) > 1


# -- the patches -----------------------------------------------------------------------

# What install() replaced: name -> mitmproxy's original.
_originals: dict[str, Callable[..., Any]] = {}


def _need(owner: Any, name: str) -> Any:
    value = getattr(owner, name, None)
    if value is None:
        raise RuntimeError(f"mitmproxy changed: {getattr(owner, '__name__', owner)}.{name}")
    return value


@once
def install() -> None:
    """Patch mitmproxy's HTTP layers; raises RuntimeError if their shape changed."""
    for cls in (_events.RequestProtocolError, _events.ResponseProtocolError):
        params = list(inspect.signature(cls.__init__).parameters)
        if params != ["self", "stream_id", "message", "code"]:
            raise RuntimeError(f"mitmproxy changed: {cls.__name__}.__init__{params}")
    read_body = _need(_http1.Http1Connection, "read_body")
    if _TRAILERS_RAISED not in inspect.getsource(read_body):
        raise RuntimeError("mitmproxy changed: Http1Connection.read_body and its trailers")
    h2_names = set(dir(_http2.Http2Server)).union(
        *(getattr(k, "__annotations__", {}) for k in _http2.Http2Server.__mro__)
    )
    for name in ("is_closed", "is_open_for_us", "h2_conn", "conn"):
        if name not in h2_names:
            raise RuntimeError(f"mitmproxy changed: Http2Server.{name}")
    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [
        # Protocol-error text quotes peer bytes: every error event carries a fixed one.
        (_events.RequestProtocolError, "__init__", _fixed_error(client=True)),
        (_events.ResponseProtocolError, "__init__", _fixed_error(client=False)),
        # HTTP/1 agents: mitmproxy's HTML error page becomes credproxy's JSON.
        (_http1, "make_error_response", lambda _: _h1_error_response),
        # HTTP/2 agents: the same page, which h2 sends from Http2Connection._handle_event.
        (_http2.Http2Server, "_handle_event", _h2_error_page),
        # The stream knows its flow: the page names the request id of the audit line.
        (layers.HttpStream, "handle_protocol_error", _tag_errors),
        (layers.HttpStream, "check_invalid", _tag_sent_errors),
        # A response transfer coding other than chunked would reach the agent unredacted.
        (layers, "validate_headers", _refuse_codings),
        # mitmproxy takes a 1xx as the final response: pass each on (redacted) to the agent,
        # as a proxy must (RFC 9110, 15.2), and read the real one after it.
        (_http1.Http1Client, "read_headers", _pass_informational),
        (layers.HttpStream, "_handle_event", _forward_informational),
        # HTTP/1 trailers raise NotImplementedError inside mitmproxy: refuse them cleanly.
        (_http1.Http1Connection, "read_body", _refuse_trailers),
    ]
    for owner, name, make in patches:
        original = _need(owner, name)
        _originals[f"{owner.__name__}.{name}"] = original
        setattr(owner, name, make(original))


def replaced() -> dict[str, Callable[..., Any]]:
    """What install() replaced: name -> mitmproxy's original."""
    return dict(_originals)


def _fixed_error(client: bool) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def make(original: Callable[..., None]) -> Callable[..., None]:
        default = 400 if client else 502

        def __init__(self: Any, stream_id: int, message: str, code: int = default) -> None:
            original(self, stream_id, message, code)
            failure = classify(message, client=client or code < 500)
            self.message = failure.message
            if not client and code not in (NO_RESPONSE, CLIENT_CLOSED) and failure.status:
                self.code = failure.status

        return __init__

    return make


def _h1_error_response(status_code: int, message: str = "") -> bytes:
    return page(status_code, message).http1()


def _tag_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    def handle_protocol_error(self: Any, event: Any) -> Generator[Any, Any, None]:
        event.message = tag(event.message, self.flow.id)
        yield from original(self, event)

    return handle_protocol_error


def _tag_sent_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    """The same for a method that sends its error to the agent itself (invalid headers)."""

    def wrapper(self: Any, *args: Any) -> Generator[Any, Any, Any]:
        sending = original(self, *args)
        sent = None
        while True:
            try:
                command = sending.send(sent)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, SendHttp) and isinstance(command.event, ResponseProtocolError):
                command.event.message = tag(command.event.message, self.flow.id)
            sent = yield command

    return wrapper


def _h2_error_page(original: Callable[..., Any]) -> Callable[..., Any]:
    def _handle_event(self: Any, event: Any) -> Generator[Any, Any, None]:
        sid = getattr(event, "stream_id", None)
        if (
            isinstance(event, ResponseProtocolError)
            and event.code != NO_RESPONSE
            and not self.is_closed(sid)
            and self.is_open_for_us(sid)
            and not self.h2_conn.streams[sid].state_machine.headers_sent
        ):
            answer = page(event.code, event.message)
            fields = [f for f in answer.headers if f[0] != b"connection"]  # h2 has none
            self.h2_conn.send_headers(sid, [(b":status", b"%d" % answer.status), *fields])
            self.h2_conn.send_data(sid, answer.body, end_stream=True)
            yield commands.SendData(self.conn, self.h2_conn.data_to_send())
            return
        yield from original(self, event)

    return _handle_event


def _refuse_codings(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def validate_headers(message: Any) -> None:
        original(message)
        if isinstance(message, http.Response) and foreign_coding(message.headers.fields):
            raise ValueError(FOREIGN_CODING)

    return validate_headers


def _pass_informational(original: Callable[..., Any]) -> Callable[..., Any]:
    def informational(self: Any, event: Any) -> Generator[Any, Any, None]:
        # 101 stays: it is final for an upgrade. Each other 1xx goes to the stream whole,
        # as an Informational event, and the real response is read after it.
        while _INFORMATIONAL_RE.match(bytes(self.buf)):
            lines = self.buf.maybe_extract_lines()
            if lines is None:
                break  # not complete yet: wait for more
            try:
                response = http1.read_response_head([bytes(x) for x in lines])
            except ValueError:
                continue  # a malformed hint is dropped; the final response decides
            yield ReceiveHttp(Informational(self.stream_id, response))
        yield from original(self, event)

    # Not a generator itself: the common case hands back mitmproxy's own, one frame less on
    # every command it yields.
    def read_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        if (
            isinstance(event, events.DataReceived)
            and self.request is not None
            and _INFORMATIONAL_RE.match(bytes(self.buf))
        ):
            return informational(self, event)
        return original(self, event)  # type: ignore[no-any-return]

    return read_headers


def _forward_informational(original: Callable[..., Any]) -> Callable[..., Any]:
    def _handle_event(self: Any, event: Any) -> Generator[Any, Any, None]:
        # Not a generator itself: every other event goes to mitmproxy's own, one frame less
        # on each command it yields.
        if not isinstance(event, Informational):
            return original(self, event)  # type: ignore[no-any-return]
        return informational(self, event)

    def informational(self: Any, event: Informational) -> Generator[Any, Any, None]:
        request = self.flow.request
        # 100 answers an Expect that mitmproxy already answered itself; HTTP/1.0 knows no 1xx.
        if event.response.status_code == 100 or request.http_version == "HTTP/1.0":
            return
        if self.flow.response is not None:
            return  # refused, or the final response is already here
        response = event.response.copy()
        response.headers.fields = hop.strip(response.headers.fields)[0]
        redactor = REDACTORS.get(self.flow)
        if redactor is not None:
            response.headers.fields = redactor.headers(response.headers.fields)
        response.reason = status_codes.RESPONSES.get(response.status_code, "Informational")
        yield SendHttp(ResponseHeaders(self.stream_id, response, False), self.context.client)

    return _handle_event


def _refuse_trailers(original: Callable[..., Any]) -> Callable[..., Any]:
    def read_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        try:
            yield from original(self, event)
        except NotImplementedError as e:
            if _TRAILERS_RAISED not in str(e):
                raise
            self.state = self.done
            if isinstance(self, Http1Server):
                if self.response is None:  # nothing sent to the agent yet: answer it
                    yield commands.SendData(self.conn, _h1_error_response(400, REQUEST_TRAILERS))
                yield commands.CloseConnection(self.conn)
                yield ReceiveHttp(RequestProtocolError(self.stream_id, REQUEST_TRAILERS))
            else:
                yield commands.CloseConnection(self.conn)
                yield ReceiveHttp(ResponseProtocolError(self.stream_id, RESPONSE_TRAILERS))

    return read_body
