"""The request gate: gather a request's facts, ask for the verdict, deny or pass it on."""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import UTC, datetime

from mitmproxy import http

from addon.core.reasons import Reason
from addon.core.verdict import Facts, Verdict, verdict
from addon.proxy.access import HOW_TO_ASK, RECORDED_REASONS, AccessRequests
from addon.proxy.failclosed import Denied, deny_on_error
from addon.proxy.ratelimit import Limiter, principal_limit
from addon.proxy.state import KEY, STEPS, Record
from addon.proxy.trail import Trail


class Gate:
    def __init__(self, access: AccessRequests, trail: Trail, limiter: Limiter) -> None:
        self.access = access
        self.trail = trail
        self.limiter = limiter

    @deny_on_error
    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        step = STEPS.get(flow)
        rec: Record | None = flow.metadata.get(KEY)
        if step is None or rec is None:
            return None  # refused (or never seen) by authentication
        limit = step.policy.principal_limit(step.principal)
        if limit is not None:
            # Before anything else: a looping agent's refused requests cost little too. Only
            # looked at here; the token is taken with the grant's (Forward), or below.
            step.limits = (principal_limit(step.principal, *limit),)
            self.limiter.check(step.limits, take=False)
        request, client = flow.request, flow.client_conn
        facts = Facts(
            request.scheme,
            request.host,
            request.port,
            request.authority,
            request.data.method,
            request.data.path,
            step.headers,
            request.is_http2,
            client.tls,
            client.sni,
        )
        v = verdict(facts, step.principal, step.tunnel, step.policy, datetime.now(UTC))
        if v.host is not None:
            rec.host, rec.port = v.host, v.port
        if v.path is not None:
            rec.path = v.path
        if step.policy.path_secrets and step.policy.carries_path_secret(request.data.path):
            # An agent that holds a path credential's secret sends it itself: refused, and it
            # goes into no audit line and no access request.
            del STEPS[flow]
            rec.path = "[REDACTED]"
            raise Denied(Reason.BAD_REQUEST, "the request carries a credential's secret")
        if v.allowed:
            step.verdict = v
            return None
        del STEPS[flow]
        if step.limits:
            self.limiter.check(step.limits)  # a refused request spends the principal's token
        if v.internal:
            rec.internal = True
            return None  # answered in the request hook, with the body; never forwarded
        assert v.reason is not None
        if v.decided and v.reason in RECORDED_REASONS:
            return self._refuse_and_record(step.principal, v)
        raise Denied(v.reason, v.detail)

    async def _refuse_and_record(self, principal: str, v: Verdict) -> None:
        """Deny with the access request the refusal recorded, if the store took it."""
        assert v.reason is not None and v.host is not None and v.port is not None
        assert v.method is not None and v.path is not None
        extra = None
        asked = await self.access.on_denial(principal, v.host, v.port, v.method, v.path)
        if asked is not None:
            extra = {"access_request": asked, "how_to_ask": HOW_TO_ASK}
        raise Denied(v.reason, v.detail, extra)
