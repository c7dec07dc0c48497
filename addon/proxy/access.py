"""Access requests: what an agent was refused, or asks for, waiting for an owner's decision.

An agent can only ask. Requests are approved or denied from the CLI, never through the proxy.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from mitmproxy import http

from addon.core.reasons import Reason
from addon.core.verdict import INTERNAL_HOST, MAX_BODY
from addon.observe import audit
from addon.observe.problem import problem
from addon.proxy.failclosed import deny_on_error
from addon.proxy.live import LivePolicy
from addon.proxy.state import Record, record
from addon.proxy.trail import Trail
from store.errors import CredproxyError, InvalidInput
from store.records import AccessRequestEntry
from store.rules.grammar import canonicalize, parse_authority

RECORDED_REASONS = frozenset({Reason.NO_GRANT, Reason.METHOD_NOT_ALLOWED, Reason.PATH_NOT_ALLOWED})
HOW_TO_ASK = (
    f"ask for access with POST http://{INTERNAL_HOST}/access-requests "
    '{"host", "method", "path", "purpose"}'
)
# One store write per (principal, host, port, method, path) per window, for denials and for
# explicit asks alike: a looping agent cannot turn either into a write load under its row lock.
RECORD_WINDOW = 10.0
STORE_DOWN = "the store did not answer"
MAX_ID = 2**31 - 1  # ids are the store's integers (PostgreSQL's integer)
TOO_MANY_PENDING = "too many pending access requests: wait for an owner's decision"
CACHE_SIZE = 10_000


# (principal, host, port, method, path, explicit)
_Key = tuple[str, str, int, str, str, bool]


class AccessRequests:
    def __init__(self, live: LivePolicy, log: Any) -> None:
        self.live = live
        self.log = log
        self._recent: OrderedDict[_Key, tuple[float, int]] = OrderedDict()
        # Called with each new access request's event and fields (the notifier).
        self.notify: Callable[[str, dict[str, Any]], None] = lambda event, fields: None

    def _within_window(self, key: _Key) -> int | None:
        """The request id written for `key` less than RECORD_WINDOW ago, if any."""
        cached = self._recent.get(key)
        if cached is not None and time.monotonic() - cached[0] < RECORD_WINDOW:
            return cached[1]
        return None

    def _written(self, key: _Key, request_id: int) -> None:
        self._recent[key] = (time.monotonic(), request_id)
        self._recent.move_to_end(key)
        while len(self._recent) > CACHE_SIZE:
            self._recent.popitem(last=False)

    async def on_denial(
        self, principal: str, host: str, port: int, method: str, path: str
    ) -> dict[str, Any] | None:
        """Record (or re-count) the refused request; its id for the 403 body, or None."""
        key = (principal, host, port, method, path, False)
        seen_before = key in self._recent
        recent = self._within_window(key)
        if recent is not None:
            return {"id": recent, "state": "pending"}
        if not self.live.store_up:
            return None  # never a write to a store the poller has lost (or a deleted file)
        try:
            recorded = await self.live.call(
                self.live.store.record_access_request, principal, host, port, method, path
            )
        except CredproxyError:
            return None
        if recorded is None:
            return None
        request_id, state = recorded
        self._written(key, request_id)
        if not seen_before:
            self._recorded(request_id, principal, host, port, method, path, "auto")
        return {"id": request_id, "state": state}

    async def on_budget(
        self,
        principal: str,
        grant_id: int,
        where: tuple[str, int, str, str],
        spent: str,
    ) -> dict[str, Any] | None:
        """Record (or re-count) a request the grant's spent budget refused: one pending budget
        request per grant, which an owner approves with a new budget. Its id, or None."""
        host, port, method, path = where
        key = (principal, "", grant_id, "budget", "", False)
        seen_before = key in self._recent
        recent = self._within_window(key)
        if recent is not None:
            return {"id": recent, "state": "pending"}
        if not self.live.store_up:
            return None
        try:
            request_id, state = await self.live.call(
                self.live.store.record_budget_request,
                principal,
                grant_id,
                host,
                port,
                method,
                path,
                spent,
            )
        except CredproxyError:
            return None
        self._written(key, request_id)
        if not seen_before:
            event = {
                "id": request_id,
                "principal": principal,
                "grant_id": grant_id,
                "spent": spent,
                "host": host,
                "port": port,
                "method": method,
                "path": path,
            }
            self.log.info("budget_request.recorded", **event)
            self.notify("budget_request.recorded", event)
        return {"id": request_id, "state": state}

    async def handle(self, flow: http.HTTPFlow, principal: str, path: str) -> http.Response:
        """The agent's own endpoint: POST /access-requests, GET /access-requests/ID."""
        method = flow.request.method
        if not self.live.store_up:
            return _refused(flow, Reason.STORE_UNAVAILABLE, STORE_DOWN)
        if path == "/access-requests" and method == "POST":
            return await self._create(flow, principal)
        prefix = "/access-requests/"
        digits = path[len(prefix) :]
        if path.startswith(prefix) and digits.isascii() and digits.isdigit() and method == "GET":
            # An id beyond the store's integers is no request of anyone's (never a 500/503).
            if len(digits) > len(str(MAX_ID)) or int(digits) > MAX_ID:
                return _refused(flow, Reason.NOT_FOUND, "no such access request of yours")
            try:
                found = await self.live.call(
                    self.live.store.get_access_request, principal, int(digits)
                )
            except InvalidInput:
                found = None
            except CredproxyError:
                return _refused(flow, Reason.STORE_UNAVAILABLE, STORE_DOWN)
            if found is None:
                return _refused(flow, Reason.NOT_FOUND, "no such access request of yours")
            return _reply(200, _public(found))
        return _refused(flow, Reason.NOT_FOUND, HOW_TO_ASK)

    async def _create(self, flow: http.HTTPFlow, principal: str) -> http.Response:
        raw = flow.request.raw_content or b""  # never decoded: the gate refused codings
        try:
            if len(raw) > MAX_BODY:
                raise ValueError("too large")
            body = json.loads(raw)
            fields = {k: body[k] for k in ("host", "method", "path")}
            if not all(isinstance(v, str) for v in fields.values()):
                raise ValueError("fields must be strings")
            purpose = body.get("purpose")
            if purpose is not None and not isinstance(purpose, str):
                raise ValueError("purpose must be a string")
            host, port_or_none = parse_authority(fields["host"])
            port = port_or_none or 443
            path, _ = canonicalize(fields["path"].encode("ascii"))
        except (ValueError, KeyError, TypeError, UnicodeEncodeError):
            return _refused(flow, Reason.BAD_REQUEST, HOW_TO_ASK)
        key = (principal, host, port, fields["method"], path, True)
        recent = self._within_window(key)
        if recent is not None:
            # Asked again within the window: the same answer, no write (a new purpose waits).
            return _reply(202, {"id": recent, "state": "pending"})
        try:
            recorded = await self.live.call(
                self.live.store.record_access_request,
                principal,
                host,
                port,
                fields["method"],
                path,
                purpose,
                True,
            )
        except InvalidInput as e:  # our own one-line message, nothing from the store
            return _refused(flow, Reason.BAD_REQUEST, str(e))
        except CredproxyError:
            return _refused(flow, Reason.STORE_UNAVAILABLE, STORE_DOWN)
        if recorded is None:
            return _refused(flow, Reason.TOO_MANY_ACCESS_REQUESTS, TOO_MANY_PENDING)
        request_id, state = recorded
        self._written(key, request_id)
        self._recorded(request_id, principal, host, port, fields["method"], path, "explicit")
        return _reply(202, {"id": request_id, "state": state})

    def _recorded(
        self,
        request_id: int,
        principal: str,
        host: str,
        port: int,
        method: str,
        path: str,
        source: str,
    ) -> None:
        event = {
            "id": request_id,
            "principal": principal,
            "host": host,
            "port": port,
            "method": method,
            "path": path,
            "source": source,
        }
        self.log.info("access_request.recorded", **event)
        self.notify("access_request.recorded", event)


class AccessEndpoint:
    """The `request` hook of credproxy.internal: the gate let it through, unforwarded."""

    def __init__(self, requests: AccessRequests, trail: Trail) -> None:
        self.requests = requests
        self.trail = trail

    @deny_on_error
    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        rec = record(flow)
        if rec is None or not rec.internal:
            return None
        return self._answer(flow, rec)

    async def _answer(self, flow: http.HTTPFlow, rec: Record) -> None:
        assert rec.principal is not None and rec.path is not None
        flow.response = response = await self.requests.handle(flow, rec.principal, rec.path)
        reason = response.headers.get("x-credproxy-reason")
        fields = {"status": response.status_code} | ({"reason": reason} if reason else {})
        self.trail.finish(flow, audit.INTERNAL, **fields)


def _public(found: AccessRequestEntry) -> dict[str, Any]:
    keys = (
        "id",
        "host",
        "port",
        "method",
        "path",
        "purpose",
        "state",
        "count",
        "grant_id",
        "decision_reason",
    )
    return {k: getattr(found, k) for k in keys}


def _refused(flow: http.HTTPFlow, reason: Reason, detail: str) -> http.Response:
    return problem(reason, detail, request_id=flow.id).response()


def _reply(status: int, body: dict[str, Any]) -> http.Response:
    return http.Response.make(status, json.dumps(body), {"content-type": "application/json"})
