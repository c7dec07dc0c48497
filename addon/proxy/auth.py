"""Authentication and the tunnel table: who a request is from, and what its CONNECT bound.

Proxy-Authorization is read and removed here, never forwarded. A CONNECT that passes binds
its principal, host and port to the client connection; every request inside is judged as
that principal's and must go to that authority (addon/core/verdict.py).
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime
from typing import Any

from mitmproxy import http

from addon.core.policy import Policy
from addon.core.reasons import Reason
from addon.core.verdict import INTERNAL_HOST, HeaderScan, Tunnel
from addon.observe import audit
from addon.proxy.failclosed import Denied, deny_on_error
from addon.proxy.live import LivePolicy
from addon.proxy.state import STEPS, Clients, Step
from addon.proxy.trail import Trail
from store.rules.grammar import BadAuthority, normalize_host

LOADING = "policy-loading"  # the reason of a readiness probe's 503
_LOADED = re.compile(rb"\?(?:[^#]*&)?loaded=([0-9]{1,18})(?:&|$)")


class Auth:
    def __init__(self, live: LivePolicy, clients: Clients, trail: Trail) -> None:
        self.live = live
        self.clients = clients
        self.trail = trail

    @deny_on_error
    def http_connect(self, flow: http.HTTPFlow) -> None:
        rec = self.trail.begin(flow)
        rec.method = "CONNECT"
        rec.host, rec.port = flow.request.host, flow.request.port
        headers = HeaderScan.scan(flow.request.headers.fields)
        principal, token = self._authenticate(flow, headers.get_all(b"proxy-authorization"))
        rec.principal = principal
        policy = self._policy()
        if flow.request.is_http2:
            raise Denied(Reason.BAD_REQUEST, "CONNECT over HTTP/2 to the proxy is not supported")
        state = self.clients.get(flow.client_conn)
        if state is not None and (state.tunnel is not None or state.broken):
            raise Denied(Reason.BAD_REQUEST, "CONNECT inside a tunnel")
        if state is not None and state.principal not in (None, principal):
            raise Denied(Reason.AUTH_REQUIRED, "credentials differ from the connection's")
        try:
            host, port = normalize_host(flow.request.host), flow.request.port
        except BadAuthority as e:
            raise Denied(Reason.BAD_REQUEST, "invalid CONNECT authority") from e
        rec.host = host
        if not policy.may_connect(principal, host, port):
            raise Denied(Reason.NO_GRANT, "no grant for this host and port")
        state = self.clients.state(flow.client_conn)
        state.tunnel, state.token = Tunnel(principal, host, port), token
        self.trail.forget(flow)

    @deny_on_error
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        rec = self.trail.begin(flow)
        rec.method = request.data.method.decode("latin-1")
        rec.host, rec.port = request.host, request.port
        headers = HeaderScan.scan(request.headers.fields)
        state = self.clients.get(flow.client_conn)
        tunnel = state.tunnel if state is not None else None
        token: int | None
        if tunnel is None and self._not_loaded_yet(request, headers):
            # A launcher's readiness probe, before this proxy has read the store's change
            # that made its token: answered without looking at the credentials, so it is
            # neither a denial nor an oracle for guessing tokens, and not audited.
            self.trail.forget(flow)
            flow.response = http.Response.make(
                503, b"", {"retry-after": "1", "x-credproxy-reason": LOADING}
            )
            return
        if tunnel is None:
            principal, token = self._authenticate(flow, headers.get_all(b"proxy-authorization"))
            # One client connection, one principal: its upstream connections are shared.
            if state is None:
                state = self.clients.state(flow.client_conn)
            if state.principal is None:
                state.principal = principal
            elif state.principal != principal:
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
                if named is None or named[0] != tunnel.principal:
                    raise Denied(Reason.AUTH_REQUIRED, "credentials differ from the tunnel's")
            principal = tunnel.principal
            token = state.token if state is not None else None
        rec.principal = principal
        policy = self._policy()
        if principal not in policy.principals():
            raise Denied(Reason.AUTH_REQUIRED, "the principal no longer exists")
        # A tunnel outlives the check at its CONNECT: a session token revoked or expired since
        # then ends what the connection may do.
        if tunnel is not None and state is not None:
            if not policy.token_live(principal, state.token, datetime.now(UTC)):
                raise Denied(Reason.AUTH_REQUIRED, "the session token was revoked or has expired")
        if state is not None and state.broken:
            raise Denied(Reason.INTERNAL_ERROR, "internal error")
        STEPS[flow] = Step(headers, principal, tunnel, policy, token=token)

    def _not_loaded_yet(self, request: http.Request, headers: HeaderScan) -> bool:
        """`GET http://credproxy.internal/...?loaded=N` while the policy is older than the
        store's change N."""
        if request.host != INTERNAL_HOST or request.data.method != b"GET":
            return False
        if b"content-length" in headers.index or b"transfer-encoding" in headers.index:
            return False
        found = _LOADED.search(request.data.path)
        if found is None:
            return False
        return self._policy().counter < int(found.group(1))

    def _policy(self) -> Policy:
        if not audit.writable():
            raise Denied(Reason.AUDIT_UNAVAILABLE, "the audit stream cannot be written")
        policy: Any = self.live.current()
        if policy is None:
            raise Denied(Reason.STORE_UNAVAILABLE, "the policy is stale and the store unreachable")
        return policy  # type: ignore[no-any-return]

    def _authenticate(self, flow: http.HTTPFlow, values: list[bytes]) -> tuple[str, int]:
        """The principal and its token's id from Proxy-Authorization, which is removed and
        never forwarded."""
        if not values:
            # What git, Java and curl --proxy-anyauth send first, to learn the scheme: the
            # 407 is a challenge, audited and counted as one, never a denial.
            self._policy()  # a proxy that cannot audit or decide answers that first
            raise Denied(
                Reason.AUTH_REQUIRED, "proxy authentication required", decision=audit.CHALLENGE
            )
        flow.request.headers.pop("proxy-authorization", None)
        found = self._principal(values)
        if found is None:
            raise Denied(Reason.AUTH_REQUIRED, "the proxy credentials are not valid")
        return found

    def _principal(self, values: list[bytes]) -> tuple[str, int] | None:
        """Who exactly one valid Basic Proxy-Authorization value names, with which of its
        live tokens, or None."""
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
                if sep:
                    token_id = policy.token_of(name, token, datetime.now(UTC))
                    if token_id is not None:
                        return name, token_id
        return None
