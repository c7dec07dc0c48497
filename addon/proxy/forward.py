"""Forwarding an allowed request: vet where it goes, use a once-grant, stamp the credential.

Runs after the gate, as the last step before the request leaves: nothing is spent (a
once-grant) or written (a secret) for a request that a check still refuses. How the
credential goes on the request is its scheme's Stamp (addon/schemes/stamp.py): this module
never asks which scheme it holds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from mitmproxy import http

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.core.policy import Rule
from addon.core.reasons import Reason
from addon.mitm import hop, wire
from addon.observe import audit
from addon.observe.metrics import Metrics
from addon.proxy.approval import Holds, gone
from addon.proxy.budgets import Budgets
from addon.proxy.dns import DEFAULT_TTL, FORBIDDEN, LookupFailed, Resolver
from addon.proxy.failclosed import Denied, deny_on_error, kill_on_error
from addon.proxy.live import LivePolicy
from addon.proxy.ratelimit import Limit, Limiter, grant_limit
from addon.proxy.signing import Signing
from addon.proxy.state import KEY, STEPS, Clients, Record, Step
from addon.proxy.trail import Trail
from addon.redaction import wsredact
from addon.redaction.redactset import SETS
from addon.schemes.renewal import Renewal, Unavailable
from addon.schemes.stamp import WATCHED, Refused, Stamping, target
from addon.schemes.stamping import stamp_for
from store.errors import CredproxyError

# A request held to go over its spent budget, refused by an owner or by no one in time, is
# answered as the budget refuses: 429 budget-exhausted, with Retry-After.
_NOT_LET_OVER = frozenset({Reason.APPROVAL_DENIED, Reason.APPROVAL_TIMEOUT})


class Forward:
    def __init__(
        self,
        live: LivePolicy,
        resolve: ResolveMap,
        guard: DestinationGuard,
        clients: Clients,
        trail: Trail,
        metrics: Metrics,
        dns_ttl: float = DEFAULT_TTL,
        limiter: Limiter | None = None,
        signing: Signing | None = None,
        holds: Holds | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        self.holds = holds
        self.budgets = budgets or Budgets(live)
        self.limiter = limiter or Limiter()
        self.live = live
        self.resolve = resolve
        self.resolver = Resolver(guard, ttl=dns_ttl)
        metrics.dns = self.resolver.stats
        self.clients = clients
        self.trail = trail
        self.metrics = metrics
        self.signing = signing or Signing(trail)

    @property
    def guard(self) -> DestinationGuard:
        return self.resolver.guard

    @guard.setter
    def guard(self, guard: DestinationGuard) -> None:
        self.resolver.reconfigure(guard)  # answers the old guard vetted are dropped

    @deny_on_error
    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        step = STEPS.pop(flow, None)
        rec: Record | None = flow.metadata.get(KEY)
        if step is None or step.verdict is None or rec is None:
            return None
        if flow.error is not None:
            # mitmproxy already refused it (e.g. a Content-Length it cannot read) and will
            # answer 400 itself: never stamp a secret or spend a once-grant on it.
            return None
        v = step.verdict
        assert v.host is not None and v.port is not None and v.rule is not None
        # Scheme checks that refuse come first: nothing is spent on a request they refuse.
        stamping = self._stamping(flow, step, rec)
        # Keys or a token the request cannot leave without: fetched (or awaited) first.
        renewal = stamping.pending() if stamping is not None else None
        limits = _limits(step)
        if limits and not self.limiter.shared:
            self.limiter.check(limits)  # every limit's token, or none
        address = self.resolve.lookup(v.host, v.port)
        if address is None:
            try:
                address = self.resolver.cached(v.host, v.port)
            except LookupFailed as e:
                raise _refusal(e, rec, v.rule) from e
        # AWS keys, a minted token, an owner's approval, or the store's rate buckets
        waits = renewal is not None or v.rule.approval is not None or self.limiter.shared
        counted = v.rule.once or v.rule.max_uses is not None or v.rule.budget is not None
        if address is None or counted or waits:
            return self._vet_then_forward(flow, step, rec, address, stamping, renewal)
        self._forward(flow, step, rec, address, stamping)
        return None

    def _stamping(self, flow: http.HTTPFlow, step: Step, rec: Record) -> Stamping | None:
        """How the verdict's credential goes on this request; None without a credential.

        Raises: Denied, for a request its scheme cannot serve.
        """
        v = step.verdict
        assert v is not None and v.rule is not None
        credential = v.rule.credential
        if credential is None:
            return None
        stamp = stamp_for(step.policy, credential)
        try:
            return stamp.prepare(v, flow.request, step.headers, self.signing.limit)
        except Refused as e:
            if rec.path is not None:
                rec.path = stamp.scrubbed(rec.path)
            raise Denied(e.reason, e.detail) from e

    async def _vet_then_forward(
        self,
        flow: http.HTTPFlow,
        step: Step,
        rec: Record,
        address: tuple[str, int] | None,
        stamping: Stamping | None,
        renewal: Renewal[Any] | None,
    ) -> None:
        v = step.verdict
        assert v is not None and v.host is not None and v.port is not None and v.rule is not None
        assert v.path is not None
        if self.limiter.shared and (limits := _limits(step)):
            await self.limiter.take(limits)
        over = None  # a spent budget the owner is asked to let this request go over
        if v.rule.approval is not None:
            if self.holds is None:
                raise Denied(Reason.APPROVAL_DENIED, "this proxy holds no requests")
            if v.rule.budget is not None:
                over = await self.budgets.spent(v.rule)
            try:
                # before anything is spent or dialled
                await self.holds.wait(flow, step, rec, over.limits if over else None)
            except Denied as e:
                if over is None or e.reason not in _NOT_LET_OVER or not e.extra:
                    raise
                why = "; an owner denied going over it"
                if e.reason == Reason.APPROVAL_TIMEOUT:
                    why = "; no owner let this request go over it in time"
                raise over.refusal(why, e.extra) from e
            self._still_authenticated(flow, step)
        if renewal is not None:
            started = time.monotonic()
            try:
                await renewal.ensure()
            except Unavailable as e:
                raise _unavailable(e) from e
            if renewal.timed:
                rec.token_ms = round((time.monotonic() - started) * 1000, 2)
        if address is None:
            try:
                address, waited = await self.resolver.resolve(v.host, v.port)
            except LookupFailed as e:
                raise _refusal(e, rec, v.rule) from e
            rec.dns_ms = round(waited * 1000, 2)
        if self.holds is not None and flow in self.holds.waited and gone(flow):
            # Approved, then its client left while the proxy dialled or minted: never sent.
            raise Denied(Reason.CLIENT_GONE, "the client left while its request was held")
        if v.rule.budget is not None:
            assert v.method is not None
            where = (v.host, v.port, v.method, v.path)
            if over is None:  # else an owner let this one request go over the budget
                left = await self.budgets.check(v.rule, step.principal, where)  # before a use
                if v.rule.budget.cap:
                    # BodyGate held the body whole: capped before it is stamped or signed.
                    await self.budgets.cap(flow, rec, v.path, left)
            # Usage is read from plain text; set before a scheme signs the headers.
            flow.request.headers["accept-encoding"] = "identity"
        await self._consume(v.rule)
        self._forward(flow, step, rec, address, stamping)
        if v.rule.budget is not None:
            assert v.path is not None  # _forward asserted it
            self.budgets.watch(flow, v.rule, v.host, v.path)

    def _forward(
        self,
        flow: http.HTTPFlow,
        step: Step,
        rec: Record,
        address: tuple[str, int],
        stamping: Stamping | None = None,
    ) -> None:
        v = step.verdict
        assert v is not None and v.rule is not None and v.host is not None
        assert v.path is not None
        rule = v.rule
        rec.allowed = True
        rec.grant_id = rule.grant_id
        rec.minting = stamping is not None and stamping.minting
        credential = rule.credential
        if credential is not None:
            rec.credential = credential.name
            rec.credential_fp = credential.fingerprint
        request = flow.request
        index = step.headers.index
        if not hop.FIELDS.isdisjoint(index):
            # Before stamping: a stamped field the agent named in Connection stays stamped.
            hop.for_upstream(request, websocket=rule.websocket)
        if b"sec-websocket-extensions" in index:
            # No permessage-deflate: a frame of it inflates without bound inside wsproto.
            request.headers.pop("sec-websocket-extensions")
        if credential is None or stamping is None:
            request.data.path = target(v.path, v.query)
        else:
            try:
                secrets = stamping.redacted()
            except Unavailable as e:
                raise _unavailable(e) from e
            rec.token_fp = stamping.token_fp
            # The credential's whole redaction set: every value the store or this process
            # gave it, the replaced ones for the grace period too (another replica's).
            wsredact.REDACTORS[flow] = SETS.redactor(credential.name, secrets)
            stamping.apply(flow, v.path, v.query)
        if not request.is_http2:
            request.data.authority = b""
        # Dial the vetted (or --resolve) address; Host header and SNI keep the name.
        request.data.host, request.data.port = address
        self.clients.state(flow.client_conn).upstream[address] = v.host
        request.stream = _counter(rec)
        if stamping is not None:
            stamping.sign(flow, self.signing)  # last: it signs what is forwarded

    @kill_on_error
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        watching = WATCHED.pop(flow, None)
        if watching is not None and flow.response is not None:
            watching.answered(flow.response.status_code)  # a minted token's 401 drops it

    async def dial(self, host: str, port: int) -> tuple[str, int]:
        """Where the proxy's own calls (STS for a role, token endpoints) connect: --resolve,
        or a vetted lookup."""
        address = self.resolve.lookup(host, port)
        if address is None:
            address, _ = await self.resolver.resolve(host, port)
        return address

    def _still_authenticated(self, flow: http.HTTPFlow, step: Step) -> None:
        """A held request waited: the session token of its tunnel may have been revoked or
        have expired meanwhile (auth checked it when the request came)."""
        state = self.clients.get(flow.client_conn)
        if step.tunnel is None or state is None:
            return
        policy = self.live.current()
        if policy is None:
            raise Denied(Reason.STORE_UNAVAILABLE, "the policy is stale")
        if not policy.token_live(step.principal, state.token, datetime.now(UTC)):
            raise Denied(Reason.AUTH_REQUIRED, "the session token was revoked or has expired")

    async def _consume(self, rule: Rule) -> None:
        """A once- or use-counted grant is used as the last step before forwarding; losing
        the race denies."""
        if not rule.once and rule.max_uses is None:
            return
        if not self.live.store_up:
            raise Denied(Reason.STORE_UNAVAILABLE, "once- and use-counted grants need the store")
        try:
            if rule.once:
                won = await self.live.consume_once(rule.grant_id)
            else:
                won = await self.live.use_grant(rule.grant_id)
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "the store did not answer") from e
        if not won:
            raise Denied(Reason.GRANT_CONSUMED, "this grant was already used up")
        if rule.once:
            self.metrics.once_consumed.inc()
        else:
            self.metrics.grant_uses.inc()


def _limits(step: Step) -> tuple[Limit, ...]:
    """The principal's rate and the grant's: a request takes a token from each, or none."""
    assert step.verdict is not None and step.verdict.rule is not None
    limit = grant_limit(step.verdict.rule)
    return step.limits if limit is None else (*step.limits, limit)


def _unavailable(e: Unavailable) -> Denied:
    """No usable keys or token: a failure of the allowed request, not a denial."""
    return Denied(Reason.CREDENTIALS_UNAVAILABLE, e.detail, decision=audit.ERROR, error=e.error)


def _refusal(e: LookupFailed, rec: Record, rule: Rule) -> Denied:
    """A forbidden address is a policy denial; a name that does not resolve is a network
    failure of a granted request, and must never read as a denial."""
    if e.detail == FORBIDDEN:
        return Denied(Reason.DESTINATION_FORBIDDEN, e.detail)
    rec.grant_id = rule.grant_id
    reason = Reason.UPSTREAM_UNRESOLVABLE
    failure = wire.Failure(reason, "name-not-resolved")
    return Denied(reason, failure.detail, decision=audit.ERROR, error=failure.error)


def _counter(rec: Record) -> Callable[[bytes], bytes]:
    def count(chunk: bytes) -> bytes:
        rec.bytes_out += len(chunk)
        return chunk

    return count
