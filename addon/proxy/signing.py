"""Signing as the request leaves (sigv4): from the head, or once a held body is complete.

A payload signed as a constant (UNSIGNED-PAYLOAD, aws-chunked with unsigned trailers) is
signed in `requestheaders` and the body streamed. A body whose SHA-256 is signed is held by
mitmproxy and signed in `request`, once whole; with streaming off, mitmproxy sends nothing
upstream before that hook. mitmproxy holds a request body without any limit, and no hook
sees its pieces, so `install()` patches `HttpStream.state_consume_request_body` (the way
addon/mitm/'s patches are, and installed with them) to bound the bodies held for signing:
past the limit the request is refused (413 body-too-large) and the rest of its body read and
dropped, never held.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from typing import Any

from mitmproxy import http
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._events import RequestData

from addon.core.reasons import Reason
from addon.mitm import once
from addon.mitm.refusals import answer_now
from addon.observe import audit
from addon.proxy.failclosed import Denied, deny_on_error
from addon.proxy.state import record
from addon.proxy.trail import Trail
from addon.redaction.redactset import SETS
from addon.redaction.wsredact import REDACTORS
from addon.schemes.sigv4 import DEFAULT_BODY_LIMIT, HELD, Plan, Signer, Unsignable, too_large

ROLE_UNAVAILABLE = "the role's temporary credentials could not be renewed"


# All the bodies held for signing at once, at most this many times --max-signed-body: one
# HTTP/2 connection may carry 100 streams, and a principal 256 tunnels.
HELD_BUDGET_FACTOR = 8


class Budget:
    """The bytes held for signing in this process, against one ceiling."""

    def __init__(self) -> None:
        self.held = 0
        self.ceiling = HELD_BUDGET_FACTOR * DEFAULT_BODY_LIMIT

    def take(self, n: int) -> bool:
        if self.held + n > self.ceiling:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


BUDGET = Budget()


class _Held:
    """A request waiting for its body: who signs it, how, and how much may be held.

    Without a signer, the body is held for another check (a grant's body rule, bodygate.py).
    """

    __slots__ = ("signer", "plan", "limit", "refuse", "counted")

    def __init__(
        self,
        signer: Signer | None,
        plan: Plan | None,
        limit: int,
        refuse: Callable[[http.HTTPFlow], None],
    ) -> None:
        self.signer, self.plan, self.limit, self.refuse = signer, plan, limit, refuse
        self.counted = 0  # of BUDGET.held

    def __del__(self) -> None:
        # Signed, refused or abandoned (the flow gone): its bytes go back to the budget.
        BUDGET.give(self.counted)


# Beside the flow, keyed weakly: a Signer holds keys, which flow.metadata must never hold.
PENDING: weakref.WeakKeyDictionary[http.HTTPFlow, _Held] = weakref.WeakKeyDictionary()


class Signing:
    def __init__(self, trail: Trail, limit: int = DEFAULT_BODY_LIMIT) -> None:
        self.trail = trail
        self.limit = limit
        BUDGET.ceiling = HELD_BUDGET_FACTOR * limit

    def plan(self, flow: http.HTTPFlow, signer: Signer, host: str) -> Plan:
        """How this request will be signed; decided from its head before anything is spent.

        Raises: Denied.
        """
        request = flow.request
        index: dict[bytes, list[bytes]] = {}
        for name, value in request.headers.fields:
            index.setdefault(name.lower(), []).append(value)
        try:
            return signer.plan(host, index, request.is_http2, self.limit)
        except Unsignable as e:
            raise Denied(e.reason, e.detail) from e

    def apply(self, flow: http.HTTPFlow, signer: Signer, plan: Plan) -> None:
        """Sign now if the payload needs no body, else hold the body for `request`."""
        if plan.payload != HELD:
            sign(flow, signer, plan, None)
            return
        flow.request.stream = False
        detail = too_large(self.limit, plan.scope.service)

        def refuse(held: http.HTTPFlow) -> None:
            self.trail.deny(held, Reason.BODY_TOO_LARGE, detail)

        PENDING[flow] = _Held(signer, plan, self.limit, refuse)

    @deny_on_error
    def request(self, flow: http.HTTPFlow) -> None:
        held = PENDING.get(flow)
        if held is None or held.signer is None or held.plan is None:
            return  # not held, or held for a body rule, whose addon releases it
        del PENDING[flow]
        if flow.response is not None:
            return
        body = flow.request.raw_content or b""
        rec = record(flow)
        if rec is not None:
            rec.bytes_out = len(body)
        sign(flow, held.signer, held.plan, body)


def hold(flow: http.HTTPFlow, limit: int, refuse: Callable[[http.HTTPFlow], None]) -> None:
    """Hold the request's body whole for a check other than signing, bounded as a signed body
    is: past `limit`, or past the process's budget, `refuse` answers and the rest is dropped."""
    flow.request.stream = False
    PENDING[flow] = _Held(None, None, limit, refuse)


def release(flow: http.HTTPFlow) -> None:
    """The held body is whole (or the flow answered): its bytes go back to the budget."""
    PENDING.pop(flow, None)


def sign(flow: http.HTTPFlow, signer: Signer, plan: Plan, body: bytes | None) -> None:
    """Add the signature of exactly what is forwarded: method, path and query, headers, body."""
    request = flow.request
    if request.host_header is None:
        raise Denied(Reason.BAD_REQUEST, "missing Host header")
    url = "https://" + request.host_header + request.data.path.decode("ascii")
    credentials = None
    if plan.role is not None:
        temporary = plan.role.now()
        if temporary is None:  # expired while the body arrived: never sign with it
            raise role_unavailable()
        credentials = temporary.credentials
        # The keys may have been renewed since the redactor was made (a body arriving
        # slowly): it must look for the ones that sign, before anything is sent.
        REDACTORS[flow] = SETS.redactor(plan.role.name, (*signer.secrets, *temporary.secrets))
    fields = request.headers.fields
    method = request.data.method.decode("ascii")
    added = signer.sign(method, url, fields, body, plan, credentials)
    request.headers.fields = (*fields, *added)


@once
def install() -> None:
    """Bound the bodies held for signing; raises if mitmproxy changed shape."""
    original = HttpStream.state_consume_request_body
    if not hasattr(HttpStream, "request_body_buf") and "request_body_buf" not in (
        HttpStream.__init__.__code__.co_names
    ):
        raise RuntimeError("mitmproxy's HttpStream has no request_body_buf: held bodies unbounded")

    def over_limit(self: Any, held: _Held) -> Generator[Any, Any, None]:
        del PENDING[self.flow]
        self.request_body_buf.clear()
        try:
            held.refuse(self.flow)
        except Exception as e:  # noqa: BLE001 - fail closed: refused all the same
            audit.logger().error("hook.failed", hook="held_body", error_type=type(e).__name__)
            self.flow.response = http.Response.make(413)
        yield from answer_now(self)

    # Not a generator itself: a body not held for signing goes to mitmproxy's own, one frame
    # less on every command it yields.
    def state_consume_request_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        if isinstance(event, RequestData) and PENDING:
            held = PENDING.get(self.flow)
            if held is not None:
                n = len(event.data)
                if len(self.request_body_buf) + n > held.limit or not BUDGET.take(n):
                    return over_limit(self, held)
                held.counted += n
        return original(self, event)  # type: ignore[no-any-return]

    HttpStream.state_consume_request_body = state_consume_request_body  # type: ignore[method-assign]


def role_unavailable() -> Denied:
    """STS did not give usable keys: a failure of the allowed request, not a denial."""
    return Denied(
        Reason.CREDENTIALS_UNAVAILABLE,
        ROLE_UNAVAILABLE,
        decision=audit.ERROR,
        error="role-keys-unavailable",
    )
