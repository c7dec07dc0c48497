"""Forwarding an allowed request: vet where it goes, use a once-grant, stamp the credential.

Runs after the gate, as the last step before the request leaves: nothing is spent (a
once-grant) or written (a secret) for a request that a check still refuses.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from mitmproxy import http

from addon.core.guard import DestinationGuard
from addon.core.hosts import ResolveMap
from addon.core.policy import Rule
from addon.core.reasons import Reason
from addon.mitm import hop, wire
from addon.observe import audit
from addon.observe.metrics import Metrics
from addon.proxy.approval import Holds, gone
from addon.proxy.dns import DEFAULT_TTL, FORBIDDEN, LookupFailed, Resolver
from addon.proxy.failclosed import Denied, deny_on_error, kill_on_error
from addon.proxy.live import LivePolicy
from addon.proxy.ratelimit import Limit, Limiter, grant_limit
from addon.proxy.signing import Signing, role_unavailable
from addon.proxy.state import KEY, STEPS, Clients, Record, Step
from addon.proxy.trail import Trail
from addon.redaction import wsredact
from addon.redaction.redactset import SETS
from addon.schemes import mint, tokens
from addon.schemes.assume import RoleSession, Unavailable
from addon.schemes.sigv4 import MINTING_SERVICES, Plan, signed_query
from addon.schemes.stamping import Stamp, slot, stamp_for, stamp_query
from store.errors import CredproxyError
from store.rules.grammar import BadPath, canonicalize
from store.rules.mintspec import MINTED

# The minted token each flow was stamped with, beside the flow (never in its metadata): an
# upstream 401 drops it.
STAMPED: weakref.WeakKeyDictionary[http.HTTPFlow, tuple[mint.TokenSession, tokens.Token]] = (
    weakref.WeakKeyDictionary()
)


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
    ) -> None:
        self.holds = holds
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
        plan = self._plan(flow, step)
        # A role without valid temporary keys yet: fetched first, before anything is spent.
        role = plan.role if isinstance(plan, Plan) and plan.role and not plan.role.now() else None
        # Likewise a minted credential without a usable token: minted (or awaited) first.
        minted = self._unminted(step)
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
        waits = (
            role is not None
            or minted is not None
            or v.rule.approval is not None
            or self.limiter.shared
        )
        if address is None or v.rule.once or v.rule.max_uses is not None or waits:
            return self._vet_then_forward(flow, step, rec, address, plan, role, minted)
        self._forward(flow, step, rec, address, plan)
        return None

    def _plan(self, flow: http.HTTPFlow, step: Step) -> Plan | str | None:
        """A sigv4 request's signing plan, a path credential's outgoing path, or None.

        Raises: Denied, for a request its scheme cannot serve.
        """
        v = step.verdict
        assert v is not None and v.rule is not None and v.host is not None
        credential = v.rule.credential
        if credential is None or credential.scheme not in ("sigv4", "path"):
            return None
        stamp = stamp_for(step.policy, credential)
        if stamp.signer is not None:
            _check_s3_reach(v.rule, step.headers.index)
            return self.signing.plan(flow, stamp.signer, v.host)
        assert v.path is not None
        placed = stamp.placed(v.path, flow.request.data.path, step.headers.index)
        if placed is None:
            rec: Record | None = flow.metadata.get(KEY)
            if rec is not None and rec.path is not None:
                # An agent that sent the secret itself must not get it into the audit line.
                rec.path = rec.path.replace(stamp.secret.decode("ascii"), "[REDACTED]")
            raise Denied(
                Reason.BAD_REQUEST,
                "the credential's placeholder goes once, at its position, and its secret nowhere",
            )
        return placed

    def _unminted(self, step: Step) -> mint.TokenSession | None:
        """A minted credential's session when it has no usable token now."""
        assert step.verdict is not None and step.verdict.rule is not None
        credential = step.verdict.rule.credential
        if credential is None or credential.scheme not in MINTED:
            return None
        session = stamp_for(step.policy, credential).minted
        assert session is not None
        return session if session.now() is None else None

    async def _vet_then_forward(
        self,
        flow: http.HTTPFlow,
        step: Step,
        rec: Record,
        address: tuple[str, int] | None,
        plan: Plan | str | None,
        role: RoleSession | None = None,
        minted: mint.TokenSession | None = None,
    ) -> None:
        v = step.verdict
        assert v is not None and v.host is not None and v.port is not None and v.rule is not None
        if self.limiter.shared and (limits := _limits(step)):
            await self.limiter.take(limits)
        if v.rule.approval is not None:
            if self.holds is None:
                raise Denied(Reason.APPROVAL_DENIED, "this proxy holds no requests")
            await self.holds.wait(flow, step, rec)  # before anything is spent or dialled
            self._still_authenticated(flow, step)
        if role is not None:
            try:
                await role.ensure()
            except Unavailable as e:
                raise role_unavailable() from e
        if minted is not None:
            started = time.monotonic()
            try:
                await minted.ensure()
            except tokens.Unavailable as e:
                raise token_unavailable(e.detail) from e
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
        await self._consume(v.rule)
        self._forward(flow, step, rec, address, plan)

    def _forward(
        self,
        flow: http.HTTPFlow,
        step: Step,
        rec: Record,
        address: tuple[str, int],
        plan: Plan | str | None = None,
    ) -> None:
        v = step.verdict
        assert v is not None and v.rule is not None and v.host is not None
        assert v.path is not None
        rule = v.rule
        rec.allowed = True
        rec.grant_id = rule.grant_id
        rec.minting = isinstance(plan, Plan) and plan.scope.service in MINTING_SERVICES
        if rule.credential is not None:
            rec.credential = rule.credential.name
            rec.credential_fp = rule.credential.fingerprint
        request = flow.request
        index = step.headers.index
        if not hop.FIELDS.isdisjoint(index):
            # Before stamping: a stamped field the agent named in Connection stays stamped.
            hop.for_upstream(request, websocket=rule.websocket)
        if b"sec-websocket-extensions" in index:
            # No permessage-deflate: a frame of it inflates without bound inside wsproto.
            request.headers.pop("sec-websocket-extensions")
        credential = rule.credential
        query = v.query
        path = v.path
        stamp: Stamp | None = None
        if credential is not None:
            stamp = stamp_for(step.policy, credential)
            secrets = stamp.secrets
            if isinstance(plan, Plan) and plan.role is not None:
                temporary = plan.role.now()
                secrets += temporary.secrets if temporary is not None else ()
            fields = stamp.fields
            if stamp.minted is not None:
                token = stamp.minted.now()
                if token is None:  # expired while the request waited: never stamp it
                    raise token_unavailable("the minted token expired before the request left")
                name, prefix = stamp.token_header
                fields = (*fields, (name, prefix + token.value))
                # The long-lived secret's parts as they are now (a refresh token rotates).
                secrets = stamp.minted.minter.secrets() + (token.value,)
                rec.token_fp = token.fingerprint
                STAMPED[flow] = (stamp.minted, token)
            # The credential's whole redaction set: every value the store or this process
            # gave it, the replaced ones for the grace period too (another replica's).
            wsredact.REDACTORS[flow] = SETS.redactor(credential.name, secrets)
            if stamp.param is not None:
                query = stamp_query(query, stamp.param, stamp.secret)
            elif isinstance(plan, str):
                path = plan  # the placeholder replaced, only now that it leaves
            elif stamp.signer is not None:
                query = signed_query(query)
            # Replace, never append: a second value would let the upstream pick the agent's.
            names = stamp.names
            request.headers.fields = (
                *[f for f in request.headers.fields if slot(f[0]) not in names],
                *fields,
            )
        # Forward exactly the path that was matched.
        request.data.path = path.encode("ascii") + (b"?" + query if query is not None else b"")
        if not request.is_http2:
            request.data.authority = b""
        # Dial the vetted (or --resolve) address; Host header and SNI keep the name.
        request.data.host, request.data.port = address
        self.clients.state(flow.client_conn).upstream[address] = v.host
        request.stream = _counter(rec)
        if isinstance(plan, Plan):
            assert stamp is not None and stamp.signer is not None
            self.signing.apply(flow, stamp.signer, plan)  # last: it signs what is forwarded

    @kill_on_error
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        stamped = STAMPED.pop(flow, None)
        if stamped is not None and flow.response is not None and flow.response.status_code == 401:
            stamped[0].drop(stamped[1])

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


def token_unavailable(detail: str) -> Denied:
    """No usable minted token: a failure of the allowed request, not a denial."""
    return Denied(
        Reason.CREDENTIALS_UNAVAILABLE, detail, decision=audit.ERROR, error="token-unavailable"
    )


def _refusal(e: LookupFailed, rec: Record, rule: Rule) -> Denied:
    """A forbidden address is a policy denial; a name that does not resolve is a network
    failure of a granted request, and must never read as a denial."""
    if e.detail == FORBIDDEN:
        return Denied(Reason.DESTINATION_FORBIDDEN, e.detail)
    rec.grant_id = rule.grant_id
    reason = Reason.UPSTREAM_UNRESOLVABLE
    failure = wire.Failure(reason, "name-not-resolved")
    return Denied(reason, failure.detail, decision=audit.ERROR, error=failure.error)


def _check_s3_reach(rule: Rule, index: dict[bytes, list[bytes]]) -> None:
    """Headers by which a signed S3 request reaches past its grant's paths: a copy reads its
    source with the stored keys (so the source must be one the grant lets it GET), and ACL
    headers open objects to others.

    Raises: Denied.
    """
    if b"x-amz-acl" in index or any(name.startswith(b"x-amz-grant-") for name in index):
        raise Denied(Reason.BAD_REQUEST, "S3 ACL headers are not sent with a stored key")
    for source in index.get(b"x-amz-copy-source", []):
        target = source.split(b"?", 1)[0].strip()
        target = target if target.startswith(b"/") else b"/" + target
        try:
            path, _ = canonicalize(target)
        except BadPath as e:
            raise Denied(Reason.BAD_REQUEST, "invalid x-amz-copy-source") from e
        if not rule.allows_method("GET") or rule.longest_path(path) < 0:
            raise Denied(
                Reason.PATH_NOT_ALLOWED, "the copy source is outside what the grant may read"
            )


def _counter(rec: Record) -> Callable[[bytes], bytes]:
    def count(chunk: bytes) -> bytes:
        rec.bytes_out += len(chunk)
        return chunk

    return count
