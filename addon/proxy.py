"""The mitmproxy hooks: turn each flow into a call to the policy, and the decision back.

Every hook is wrapped so that an exception denies (or kills) the flow: mitmproxy's addon
manager would otherwise log it and let the flow through.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from mitmproxy import connection, ctx, exceptions, http, tls
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layer import Layer
from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.layers.tls import ClientTLSLayer

from addon import audit, wire, wsredact
from addon.access import HOW_TO_ASK, INTERNAL_HOST, MAX_BODY, RECORDED_REASONS, AccessRequests
from addon.guard import DestinationGuard
from addon.hosts import ResolveMap
from addon.live import LivePolicy
from addon.metrics import Metrics, StreakAlerts
from addon.policy import DEFAULT_PORTS, STATUS, Decision, Policy, Reason, Request, Rule
from addon.redact import Decoder, Redactor
from addon.stamping import slot, stamp_query
from store.errors import CredproxyError
from store.grammar import (
    BadAuthority,
    BadPath,
    canonicalize,
    is_ip,
    normalize_host,
    parse_authority,
)

REQUIRED_OPTIONS = {
    "connection_strategy": "lazy",
    "rawtcp": False,
    "http3": False,
    "onboarding": False,
    "ssl_insecure": False,
    "ignore_hosts": [],
    "allow_hosts": [],
    "proxyauth": None,
    "stream_large_bodies": None,
    "validate_inbound_headers": True,  # addon.wire refuses response transfer codings there
}
METHOD_OVERRIDES = frozenset((b"x-http-method-override", b"x-http-method", b"x-method-override"))
# Headers some frameworks take as the real target (IIS, Symfony, Zend): never forwarded.
PATH_OVERRIDES = frozenset((b"x-original-url", b"x-rewrite-url"))
_OVERRIDES = METHOD_OVERRIDES | PATH_OVERRIDES
DNS_TIMEOUT = 5.0
# Responses of known length up to this size are held whole and redacted in one piece;
# anything longer, chunked or compressed is streamed and redacted chunk by chunk.
BUFFER_LIMIT = 64 * 1024
_TOKEN_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
class Tunnel:
    """What a CONNECT bound to its client connection."""

    principal: str
    host: str
    port: int
    sni_mismatch: bool = False


@dataclass(slots=True)
class Pending:
    """One request's audit line, filled in as the flow moves."""

    start: float
    request_id: str
    client: str
    principal: str | None = None
    method: str | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    rule: Rule | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    redactor: Redactor | None = None
    decoder: Decoder | None = None
    internal: bool = False
    buffered: bool = False
    streamed: bool = False  # the response head has gone to the agent
    failure: wire.Failure | None = None


class Denied(Exception):
    """Raised inside a hook to end it with a deny; carries a fixed reason and detail."""

    def __init__(self, reason: Reason, detail: str, extra: dict[str, Any] | None = None) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.detail = detail
        self.extra = extra or {}


def _guard_flow(hook: F) -> F:
    """Fail closed: any exception in a request-side hook becomes an internal-error deny."""

    @functools.wraps(hook)
    async def wrapper(self: Credproxy, flow: http.HTTPFlow) -> None:
        try:
            result = hook(self, flow)
            if result is not None:
                await result
        except Denied as d:
            self.deny(flow, d.reason, d.detail, d.extra)
        except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it denies
            self.log.error("hook.failed", hook=hook.__name__, error_type=type(e).__name__)
            try:
                self.deny(flow, Reason.INTERNAL_ERROR, "internal error")
            except Exception:  # noqa: BLE001 - last resort: drop the connection
                flow.kill()

    return wrapper  # type: ignore[return-value]


def _guard_response(hook: F) -> F:
    """Fail closed on the response side: the response was not vetted, so the flow dies."""

    @functools.wraps(hook)
    def wrapper(self: Credproxy, flow: http.HTTPFlow) -> None:
        try:
            hook(self, flow)
        except Exception as e:  # noqa: BLE001 - the fail-closed wrapper: it kills the flow
            self.log.error("hook.failed", hook=hook.__name__, error_type=type(e).__name__)
            flow.kill()

    return wrapper  # type: ignore[return-value]


class Credproxy:
    def __init__(
        self,
        live: LivePolicy,
        resolve: ResolveMap | None = None,
        guard: DestinationGuard | None = None,
        alert_streak: int = 20,
    ) -> None:
        self.live = live
        self.resolve = resolve or ResolveMap({})
        self.guard = guard or DestinationGuard()
        self.log = audit.logger()
        self.metrics = Metrics(
            snapshot_age=lambda: time.monotonic() - getattr(live, "last_ok", 0.0),
            store_up=lambda: bool(getattr(live, "store_up", False)),
        )
        live.on_reload = self.metrics.reloads.inc
        self.alerts = StreakAlerts(alert_streak, self.log)
        self.access = AccessRequests(live, self.log)
        self.tunnels: dict[str, Tunnel] = {}
        # client id -> the principal of its plain-proxy (absolute-form) requests
        self.plain_principals: dict[str, str] = {}
        self.broken_clients: set[str] = set()
        # (client id, dialled address) -> the host name to use as upstream SNI.
        self.upstream_names: dict[tuple[str, tuple[str, int]], str] = {}
        self.pending: dict[str, Pending] = {}
        self._poller: Any = None

    # -- lifecycle -------------------------------------------------------------------

    def configure(self, updated: set[str]) -> None:
        for name, wanted in REQUIRED_OPTIONS.items():
            if name in updated and getattr(ctx.options, name) != wanted:
                raise exceptions.OptionsError(f"credproxy requires {name}={wanted!r}")

    def running(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self.live.run())

    def done(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        audit.drain()

    def client_disconnected(self, client: connection.Client) -> None:
        self.tunnels.pop(client.id, None)
        self.plain_principals.pop(client.id, None)
        self.broken_clients.discard(client.id)
        for key in [k for k in self.upstream_names if k[0] == client.id]:
            del self.upstream_names[key]

    # -- CONNECT ---------------------------------------------------------------------

    @_guard_flow
    def http_connect(self, flow: http.HTTPFlow) -> None:
        pending = self._begin(flow)
        pending.method = "CONNECT"
        pending.host, pending.port = flow.request.host, flow.request.port
        headers = _RequestHeaders.scan(flow.request.headers.fields)
        principal = self._authenticate(flow, headers.get_all(b"proxy-authorization"))
        pending.principal = principal
        policy = self._policy()
        if flow.request.is_http2:
            raise Denied(Reason.BAD_REQUEST, "CONNECT over HTTP/2 to the proxy is not supported")
        if flow.client_conn.id in self.tunnels or flow.client_conn.id in self.broken_clients:
            raise Denied(Reason.BAD_REQUEST, "CONNECT inside a tunnel")
        if self.plain_principals.get(flow.client_conn.id, principal) != principal:
            raise Denied(Reason.AUTH_REQUIRED, "credentials differ from the connection's")
        try:
            host, port = normalize_host(flow.request.host), flow.request.port
        except BadAuthority as e:
            raise Denied(Reason.BAD_REQUEST, "invalid CONNECT authority") from e
        pending.host = host
        if not policy.may_connect(principal, host, port):
            raise Denied(Reason.NO_GRANT, "no grant for this host and port")
        self.tunnels[flow.client_conn.id] = Tunnel(principal, host, port)
        self.pending.pop(flow.id, None)

    # -- TLS and upstream connections ------------------------------------------------

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        client_id = data.context.client.id
        try:
            tunnel = self.tunnels.get(client_id)
            if tunnel is None:
                return
            # Upstream SNI is the tunnel's host, whatever the client's hello names.
            data.context.server.sni = tunnel.host
            sni = data.client_hello.sni
            if sni is None:
                tunnel.sni_mismatch = not is_ip(tunnel.host)
            else:
                try:
                    tunnel.sni_mismatch = normalize_host(sni) != tunnel.host
                except BadAuthority:
                    tunnel.sni_mismatch = True
        except Exception as e:  # noqa: BLE001 - fail closed: every request on it is denied
            self.log.error("hook.failed", hook="tls_clienthello", error_type=type(e).__name__)
            self.broken_clients.add(client_id)

    def tls_start_client(self, data: tls.TlsData) -> None:
        """TLS to the proxy's own listener speaks HTTP/1.1 only, never HTTP/2.

        On an HTTP/2 connection to the proxy, mitmproxy shares one client and one server
        connection object between all CONNECT streams: a principal, a tunnel or an SNI bound
        to the connection would be another stream's. One CONNECT per connection keeps them
        apart. (mitmproxy means to force this too, but its check misses our layer stack.)
        """
        client_id = data.context.client.id
        try:
            if _is_tls_to_the_proxy(data.context.layers):
                assert data.ssl_conn is not None
                data.ssl_conn.get_app_data()["client_alpn"] = b"http/1.1"
        except Exception as e:  # noqa: BLE001 - fail closed: every request on it is denied
            self.log.error("hook.failed", hook="tls_start_client", error_type=type(e).__name__)
            self.broken_clients.add(client_id)

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            assert data.server.address is not None
            host, port = data.server.address
            name = self.upstream_names.get((data.client.id, (host, port)))
            if name is None:
                # Every upstream connection follows an allowed request; anything else is a bug.
                data.server.error = "credproxy: no allowed request for this connection"
                return
            data.server.sni = name
        except Exception as e:  # noqa: BLE001 - fail closed: the connection is not made
            self.log.error("hook.failed", hook="server_connect", error_type=type(e).__name__)
            data.server.error = "credproxy: internal error"

    # -- requests --------------------------------------------------------------------

    @_guard_flow
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        pending = self._begin(flow)
        pending.method = request.data.method.decode("latin-1")
        pending.host, pending.port = request.host, request.port
        headers = _RequestHeaders.scan(request.headers.fields)
        tunnel = self.tunnels.get(flow.client_conn.id)
        if tunnel is None:
            principal = self._authenticate(flow, headers.get_all(b"proxy-authorization"))
            # One client connection, one principal: its upstream connections are shared.
            if self.plain_principals.setdefault(flow.client_conn.id, principal) != principal:
                raise Denied(Reason.AUTH_REQUIRED, "credentials differ from the connection's")
            if request.is_http2:
                # Streams of one HTTP/2 connection to the proxy would share its state.
                raise Denied(Reason.BAD_REQUEST, "HTTP/2 to the proxy is not supported")
        else:
            if b"proxy-authorization" in headers.index:
                request.headers.pop("proxy-authorization", None)
                # Never judge one principal's request as another's: credentials inside the
                # tunnel must be the tunnel's own, or the request is refused.
                named = self._principal(headers.get_all(b"proxy-authorization"))
                if named != tunnel.principal:
                    raise Denied(Reason.AUTH_REQUIRED, "credentials differ from the tunnel's")
            principal = tunnel.principal
        pending.principal = principal
        policy = self._policy()
        if principal not in policy.principals():
            raise Denied(Reason.AUTH_REQUIRED, "the principal no longer exists")
        if flow.client_conn.id in self.broken_clients:
            raise Denied(Reason.INTERNAL_ERROR, "internal error")

        host, port, scheme = self._bind_destination(flow, tunnel, pending, headers)
        method = _method(request.data.method)
        try:
            path, query = canonicalize(request.data.path)
        except BadPath as e:
            raise Denied(Reason.BAD_REQUEST, e.detail) from e
        pending.path = path
        headers.check_framing()

        facts = Request(host, port, scheme, method, path, upgrade=b"upgrade" in headers.index)
        now = datetime.now(UTC)
        if tunnel is None and host == INTERNAL_HOST:
            _check_internal_body(request)
            pending.internal = True
            return  # answered in the request hook, with the body; never forwarded
        decision = policy.decide(principal, facts, now)
        if not decision.allowed:
            assert decision.reason is not None
            extra = None
            if decision.reason in RECORDED_REASONS:
                asked = await self.access.on_denial(principal, host, port, method, path)
                if asked is not None:
                    extra = {"access_request": asked, "how_to_ask": HOW_TO_ASK}
            raise Denied(decision.reason, decision.detail, extra)
        rule = decision.rule
        assert rule is not None
        for name, value in headers.overrides():
            if name in PATH_OVERRIDES:
                raise Denied(Reason.BAD_REQUEST, "path-override headers are not allowed")
            # The grant whose credential is stamped (and whose once-use is spent) must allow
            # the override itself: another grant allowing it would lend this one's credential.
            if not rule.allows_method(_method(value.strip())):
                raise Denied(Reason.METHOD_NOT_ALLOWED, "the method override is not granted")
        address = self.resolve.lookup(host, port) or await self._vet(host, port)
        await self._consume(rule)
        pending.rule = rule
        if b"te" in headers.index:
            request.headers.fields = wire.only_trailers(request.headers.fields)
        if b"sec-websocket-extensions" in headers.index:
            # No permessage-deflate: a frame of it inflates without bound inside wsproto.
            request.headers.pop("sec-websocket-extensions")
        self._forward(flow, policy, rule, host, path, query, address)

    async def _vet(self, host: str, port: int) -> tuple[str, int]:
        """Resolve once here and dial exactly that address: no second lookup to rebind."""
        try:
            answers = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                DNS_TIMEOUT,
            )
        except (OSError, TimeoutError) as e:
            raise Denied(Reason.DESTINATION_FORBIDDEN, "the host does not resolve") from e
        address = self.guard.vet((str(info[4][0]) for info in answers), port)
        if address is None:
            raise Denied(Reason.DESTINATION_FORBIDDEN, "the host resolves to a forbidden address")
        return str(address), port

    def _bind_destination(
        self,
        flow: http.HTTPFlow,
        tunnel: Tunnel | None,
        pending: Pending,
        headers: _RequestHeaders,
    ) -> tuple[str, int, str]:
        """Where mitmproxy will connect, the Host header and the SNI must name one host."""
        request = flow.request
        scheme = request.scheme
        if scheme not in DEFAULT_PORTS:
            raise Denied(Reason.BAD_REQUEST, "unsupported scheme")
        host, port = request.host, request.port
        if tunnel is None or host != tunnel.host:  # the tunnel's host is already normal
            try:
                host = normalize_host(host)
            except BadAuthority as e:
                raise Denied(Reason.BAD_REQUEST, "invalid host") from e
        pending.host, pending.port = host, port
        host_headers = headers.get_all(b"host")
        if len(host_headers) > 1:
            raise Denied(Reason.BAD_REQUEST, "duplicate Host header")
        if tunnel is not None and (host, port) != (tunnel.host, tunnel.port):
            raise Denied(Reason.HOST_MISMATCH, "request does not go to the CONNECT authority")
        # Every name the request carries: the Host header and the h2 :authority (or the
        # absolute-form authority) alike. On h2 mitmproxy's host_header prefers :authority,
        # but a Host header naming another host would still reach an HTTP/1 upstream.
        authorities = [value.decode("utf-8", "surrogateescape") for value in host_headers]
        if request.authority:
            authorities.append(request.authority)
        if not authorities or not (host_headers or request.is_http2):
            raise Denied(Reason.BAD_REQUEST, "missing Host header")
        for authority in authorities:
            try:
                a_host, a_port = _parse_authority(authority)
            except BadAuthority as e:
                raise Denied(Reason.BAD_REQUEST, "invalid Host header or authority") from e
            if (a_host, a_port or DEFAULT_PORTS[scheme]) != (host, port):
                raise Denied(Reason.HOST_MISMATCH, "Host header or authority names another host")
        if tunnel is not None and tunnel.sni_mismatch:
            raise Denied(Reason.HOST_MISMATCH, "TLS SNI names another host")
        if flow.client_conn.tls and tunnel is None and flow.client_conn.sni is not None:
            raise Denied(Reason.HOST_MISMATCH, "TLS to the proxy without CONNECT")
        if tunnel is None and scheme == "https":
            # mitmproxy would dial TLS itself and reuse that connection by address for the
            # next absolute-form request, whatever host it names: a credential could ride a
            # connection whose certificate was verified for another host. Clients use CONNECT.
            raise Denied(Reason.BAD_REQUEST, "https requests must use CONNECT")
        return host, port, scheme

    async def _consume(self, rule: Rule) -> None:
        """A once-grant is used as the last step before forwarding; losing the race denies."""
        if not rule.once:
            return
        if not self.live.store_up:
            raise Denied(Reason.STORE_UNAVAILABLE, "once-grants need the store")
        try:
            won = await self.live.consume_once(rule.grant_id)
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "the store did not answer") from e
        if not won:
            raise Denied(Reason.GRANT_CONSUMED, "this once-grant was already used")
        self.metrics.once_consumed.inc()

    def _forward(
        self,
        flow: http.HTTPFlow,
        policy: Policy,
        rule: Rule,
        host: str,
        path: str,
        query: bytes | None,
        address: tuple[str, int],
    ) -> None:
        request = flow.request
        pending = self.pending[flow.id]
        credential = rule.credential
        if credential is not None:
            stamp = policy.stamp(credential)
            pending.redactor = wsredact.REDACTORS[flow] = Redactor((stamp.secret,))
            if stamp.param is not None:
                query = stamp_query(query, stamp.param, stamp.secret)
            # Replace, never append: a second value would let the upstream pick the agent's.
            names = stamp.names
            request.headers.fields = (
                *[f for f in request.headers.fields if slot(f[0]) not in names],
                *stamp.fields,
            )
        # Forward exactly the path that was matched.
        request.data.path = path.encode("ascii") + (b"?" + query if query is not None else b"")
        if not request.is_http2:
            request.data.authority = b""
        # Dial the vetted (or --resolve) address; Host header and SNI keep the name.
        request.data.host, request.data.port = address
        self.upstream_names[(flow.client_conn.id, address)] = host
        request.stream = _counter(pending, "bytes_out")

    @_guard_flow
    async def request(self, flow: http.HTTPFlow) -> None:
        pending = self.pending.get(flow.id)
        if pending is None or not pending.internal:
            return
        assert pending.principal is not None and pending.path is not None
        flow.response = await self.access.handle(flow, pending.principal, pending.path)
        self.pending.pop(flow.id, None)
        self._audit(pending, "internal", status=flow.response.status_code)

    @_guard_response
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        pending = self.pending.get(flow.id)
        response = flow.response
        if pending is None or pending.rule is None or response is None:
            return
        redactor = pending.redactor
        if response.status_code == 101 and "sec-websocket-extensions" in response.headers:
            # The request went without it: no permessage-deflate, whatever the upstream says.
            response.headers.pop("sec-websocket-extensions")
        fields = response.headers.fields
        if wire.foreign_coding(fields):
            # addon.wire refuses these first (a JSON 502); never pass one undecoded.
            pending.failure = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "bad-transfer-coding")
            flow.kill()
            return
        lengths = [v for n, v in fields if n.lower() == b"content-length"]
        # Every Content-Encoding field and list item: a second header must not hide gzip.
        codings = [
            coding.strip().lower()
            for n, v in fields
            if n.lower() == b"content-encoding"
            for coding in v.split(b",")
        ]
        codings = [c for c in codings if c not in (b"", b"identity")]
        encoding = b", ".join(codings)
        drop = set()
        if flow.request.method == "HEAD" or response.status_code in (204, 304):
            # No body follows, whatever Content-Length announces: keep the head as it is.
            pending.buffered = True
        elif redactor is not None and encoding:
            # Compressed anyway, despite Accept-Encoding: identity. Decode so redaction
            # sees the plaintext; an encoding we cannot decode kills the flow.
            pending.decoder = Decoder(encoding.decode("latin-1"))
            drop.add(b"content-encoding")
        elif len(lengths) == 1 and lengths[0].isdigit() and int(lengths[0]) <= BUFFER_LIMIT:
            # Small and of known length: mitmproxy holds it whole, `response` redacts it, and
            # it goes out as one write, as it would through bare mitmproxy.
            pending.buffered = True
        if redactor is not None:
            if not pending.buffered and (pending.decoder is not None or lengths):
                # Redaction may change the length: re-frame instead of sending a wrong one.
                drop.update((b"content-length", b"transfer-encoding"))
            if drop:
                fields = tuple(f for f in fields if f[0].lower() not in drop)
            fields = redactor.headers(fields)
            if response.data.reason:  # the HTTP/1 reason phrase, sent with the headers
                response.data.reason = redactor.whole(response.data.reason)
            if b"content-length" in drop and _chunked(flow.request):
                fields += ((b"transfer-encoding", b"chunked"),)
            response.headers.fields = fields
        if not pending.buffered:
            response.stream = _response_stream(pending)
            pending.streamed = True

    @_guard_response
    def response(self, flow: http.HTTPFlow) -> None:
        pending = self.pending.get(flow.id)
        response = flow.response
        if pending is None or response is None:
            return
        if pending.buffered:
            body = response.raw_content or b""
            pending.bytes_in = len(body)
            if pending.redactor is not None and body:
                redacted = pending.redactor.whole(body)
                if redacted != body:
                    response.raw_content = redacted
                    response.headers["content-length"] = str(len(redacted))
        if pending.failure is not None and not pending.buffered:
            # A streamed body that could not be decoded or redacted: cut, never completed.
            del self.pending[flow.id]
            flow.kill()
            failure = pending.failure
            reason = failure.reason.value if failure.reason is not None else None
            self._audit(
                pending, "allow", status=response.status_code, reason=reason, error=failure.error
            )
            return
        if pending.redactor is not None and response.trailers is not None:
            # mitmproxy sends the trailers (h2, e.g. grpc-message) after this hook returns.
            if pending.buffered:
                body = response.raw_content or b""
                pending.redactor.flushed = body[len(body) - pending.redactor.partial(body) :]
            response.trailers.fields = pending.redactor.trailers(response.trailers.fields)
        del self.pending[flow.id]
        redactions = pending.redactor.count if pending.redactor is not None else 0
        self._audit(pending, "allow", status=response.status_code, redactions=redactions)

    def error(self, flow: http.HTTPFlow) -> None:
        """Audit a failed flow with a fixed error class: mitmproxy's text quotes the peer."""
        pending = self.pending.pop(flow.id, None)
        if pending is None:
            return
        try:
            failure = pending.failure or wire.classify(flow.error.msg if flow.error else "")
        except Exception as e:  # noqa: BLE001 - the line is still written, with a fixed class
            self.log.error("hook.failed", hook="error", error_type=type(e).__name__)
            failure = wire.Failure(Reason.INTERNAL_ERROR, "unclassified")
        status: int | None = None
        if pending.streamed and flow.response is not None:
            status = flow.response.status_code  # its head went out, then the body broke
        elif wire.answers_agent(failure):
            status = failure.status
        fields: dict[str, Any] = {"status": status, "error": failure.error}
        if failure.reason is not None:
            fields["reason"] = failure.reason.value
        self._audit(pending, "allow" if pending.rule is not None else "deny", **fields)

    # -- WebSocket -------------------------------------------------------------------

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        try:
            wsredact.on_message(flow)
        except Exception as e:  # noqa: BLE001 - fail closed: the message is dropped, the flow dies
            self.log.error("hook.failed", hook="websocket_message", error_type=type(e).__name__)
            wsredact.kill(flow)

    # -- helpers ---------------------------------------------------------------------

    def _begin(self, flow: http.HTTPFlow) -> Pending:
        peer = flow.client_conn.peername
        pending = Pending(
            start=time.monotonic(),
            request_id=flow.id,
            client=f"{peer[0]}:{peer[1]}" if peer else "",
        )
        self.pending[flow.id] = pending
        return pending

    def _policy(self) -> Any:
        if not audit.writable():
            raise Denied(Reason.AUDIT_UNAVAILABLE, "the audit stream cannot be written")
        policy = self.live.current()
        if policy is None:
            raise Denied(Reason.STORE_UNAVAILABLE, "the policy is stale and the store unreachable")
        return policy

    def _authenticate(self, flow: http.HTTPFlow, values: list[bytes]) -> str:
        """The principal from Proxy-Authorization, which is removed and never forwarded."""
        if values:
            flow.request.headers.pop("proxy-authorization", None)
        principal = self._principal(values)
        if principal is None:
            raise Denied(Reason.AUTH_REQUIRED, "proxy authentication required")
        return principal

    def _principal(self, values: list[bytes]) -> str | None:
        """Who exactly one valid Basic Proxy-Authorization value names, or None."""
        policy = self._policy()
        if len(values) == 1:
            scheme, _, encoded = values[0].partition(b" ")
            if scheme.lower() == b"basic":
                try:
                    name, sep, token = (
                        base64.b64decode(encoded.strip(), validate=True)
                        .decode("utf-8")
                        .partition(":")
                    )
                except (binascii.Error, UnicodeDecodeError):
                    sep = ""
                if sep and policy.authenticate(name, token):
                    return name
        return None

    def deny(
        self,
        flow: http.HTTPFlow,
        reason: Reason,
        detail: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        status = STATUS.get(reason, 403)
        headers = {"content-type": "application/json", "x-credproxy-reason": reason.value}
        if reason is Reason.AUTH_REQUIRED:
            headers["proxy-authenticate"] = 'Basic realm="credproxy"'
        body = json.dumps(
            {"error": "denied", "reason": reason.value, "detail": detail, **(extra or {})}
        )
        request = flow.request
        if "content-length" in request.headers or "transfer-encoding" in request.headers:
            # The body is dropped unread (addon/refusals.py): this connection cannot go on.
            headers["connection"] = "close"
        # No "100 Continue": the client need not send a body that is refused.
        request.headers.pop("expect", None)
        request.stream = False
        flow.response = http.Response.make(status, body, headers)
        pending = self.pending.pop(flow.id, None)
        if pending is None:
            pending = self._begin(flow)
            del self.pending[flow.id]
        pending.rule = None
        self._audit(pending, "deny", status=status, reason=reason.value, detail=detail)

    def _audit(self, pending: Pending, decision: str, **fields: Any) -> None:
        rule = pending.rule
        credential = rule.credential if rule is not None else None
        line: dict[str, Any] = {
            audit.REQUEST_ID: pending.request_id,
            audit.PRINCIPAL: pending.principal,
            audit.CLIENT: pending.client,
            audit.METHOD: pending.method,
            audit.HOST: pending.host,
            audit.PORT: pending.port,
            audit.PATH: pending.path,
            audit.DECISION: decision,
            audit.GRANT_ID: rule.grant_id if rule is not None else None,
            audit.CREDENTIAL: credential.name if credential is not None else None,
            audit.CREDENTIAL_FP: credential.fingerprint if credential is not None else None,
            audit.BYTES_IN: pending.bytes_in,
            audit.BYTES_OUT: pending.bytes_out,
            audit.DURATION_MS: round((time.monotonic() - pending.start) * 1000, 2),
            **fields,
        }
        audit.emit(audit.REQUEST_EVENT, line)
        self.metrics.observe(line)
        self.alerts.observe(pending.principal, decision, line.get(audit.REASON))


def _counter(pending: Pending, attribute: str) -> Callable[[bytes], bytes]:
    def count(chunk: bytes) -> bytes:
        setattr(pending, attribute, getattr(pending, attribute) + len(chunk))
        return chunk

    return count


def _response_stream(pending: Pending) -> Callable[[bytes], bytes | list[bytes]]:
    redactor, decoder = pending.redactor, pending.decoder

    def redacted(chunk: bytes) -> bytes:
        assert redactor is not None
        if decoder is None:
            return redactor.feed(chunk)
        if chunk:
            decoded = decoder.feed(chunk)
            return redactor.feed(decoded) if decoded else b""
        rest = decoder.feed(b"")
        return (redactor.feed(rest) if rest else b"") + redactor.feed(b"")

    def stream(chunk: bytes) -> bytes | list[bytes]:
        pending.bytes_in += len(chunk)
        if redactor is None:
            return chunk
        if pending.failure is not None:
            return []  # the flow dies in `response`; nothing more reaches the agent
        try:
            out = redacted(chunk)
        except Exception as e:  # noqa: BLE001 - fail closed: the rest is dropped, the flow killed
            audit.logger().error("hook.failed", hook="response_stream", error_type=type(e).__name__)
            pending.failure = wire.Failure(Reason.UPSTREAM_PROTOCOL_ERROR, "undecodable-body")
            return []
        # b"" mid-stream would end a chunked HTTP/1 response: send nothing instead.
        return out if out or not chunk else []

    return stream


def _chunked(request: http.Request) -> bool:
    """May the response to this request be re-framed with chunked encoding?"""
    return not request.is_http2 and request.http_version == "HTTP/1.1"


def _check_internal_body(request: http.Request) -> None:
    """The internal endpoint holds a body whole: only a declared length within its limit,
    never compressed (a few bytes of brotli decode to hundreds of MiB)."""
    if request.headers.get("content-encoding", "identity").strip().lower() != "identity":
        raise Denied(Reason.BAD_REQUEST, "credproxy.internal takes no Content-Encoding")
    if "transfer-encoding" in request.headers:
        raise Denied(Reason.BODY_TOO_LARGE, "send a Content-Length to credproxy.internal")
    length = request.headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY:
        raise Denied(
            Reason.BODY_TOO_LARGE, f"bodies to credproxy.internal are {MAX_BODY} bytes at most"
        )


def _method(raw: bytes) -> str:
    if not _TOKEN_RE.fullmatch(raw):
        raise Denied(Reason.BAD_REQUEST, "invalid method")
    return raw.decode("ascii")


@dataclass
class _RequestHeaders:
    """One pass over a request's header fields: indexed by lower-case name, and checked."""

    index: dict[bytes, list[bytes]]
    problem: str | None = None

    @classmethod
    def scan(cls, fields: tuple[tuple[bytes, bytes], ...]) -> _RequestHeaders:
        index: dict[bytes, list[bytes]] = {}
        for name, value in fields:
            index.setdefault(name.lower(), []).append(value)
        problem = None
        # One regex call for all the names and one for all the values: non-empty tokens
        # joined are one token, and tab (the separator) is allowed in values. Field by field
        # only when something is wrong, to name the first problem.
        names, values = zip(*fields, strict=True) if fields else ((), ())
        if fields and (
            not all(names)
            or not _TOKEN_RE.fullmatch(b"".join(names))
            or _CONTROL_RE.search(b"\t".join(values))
        ):
            problem = next((p for n, v in fields if (p := _field_problem(n, v))), None)
        return cls(index, problem)

    def get_all(self, name: bytes) -> list[bytes]:
        return self.index.get(name, [])

    def overrides(self) -> list[tuple[bytes, bytes]]:
        """Method- and path-override fields, `_` read as `-` as CGI and WSGI backends do."""
        return [
            (key, value)
            for name, values in self.index.items()
            if name.startswith(b"x") and (key := name.replace(b"_", b"-")) in _OVERRIDES
            for value in values
        ]

    def check_framing(self) -> None:
        """Refuse what a front end and a back end could read two ways (smuggling, injection)."""
        lengths = self.get_all(b"content-length")
        if lengths and b"transfer-encoding" in self.index:
            raise Denied(Reason.BAD_REQUEST, "both Content-Length and Transfer-Encoding")
        if len(set(lengths)) > 1:
            raise Denied(Reason.BAD_REQUEST, "conflicting Content-Length headers")
        if self.problem is not None:
            raise Denied(Reason.BAD_REQUEST, self.problem)


@functools.lru_cache(maxsize=64)
def _parsed_authority(text: str) -> tuple[str, int | None]:
    return parse_authority(text)


def _parse_authority(text: str) -> tuple[str, int | None]:
    """parse_authority, remembered for the few Host values a proxy sees again and again."""
    return _parsed_authority(text) if len(text) <= 300 else parse_authority(text)


def _field_problem(name: bytes, value: bytes) -> str | None:
    if not _TOKEN_RE.fullmatch(name):
        return "invalid header name"
    if _CONTROL_RE.search(value):
        return "control character in a header value"
    return None


def _is_tls_to_the_proxy(layers: list[Layer]) -> bool:
    """Is the client TLS being set up the proxy's own, not a tunnel's (no HTTP layer before it)?

    The HTTP layer above this TLS layer may already be in the list; only what precedes the
    last client TLS layer tells.
    """
    last = max(i for i, layer in enumerate(layers) if isinstance(layer, ClientTLSLayer))
    return not any(isinstance(layer, HttpLayer) for layer in layers[:last])


__all__ = ["Credproxy", "Decision"]
