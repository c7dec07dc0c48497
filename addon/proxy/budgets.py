"""Token budgets of grants: checked in the store before a request leaves, charged after its answer.

Forward calls `check` as one of its last steps (a budget already spent in any window answers
429 budget-exhausted with Retry-After at that window's end), then, for a grant that caps
max_tokens, `cap` on the body BodyGate held (addon/core/capping.py), and `watch` as it forwards.
The answer then passes to the agent as it streams: `responseheaders` puts a reader beside the
stream (addon/core/usage.py for JSON and SSE, addon/core/converse.py for Bedrock's event
stream; bounded), and `response` or `error` charges what it read, or the estimate, to every
window of the budget in one store transaction before the audit line is written. A request is
checked against what was charged before it: requests in flight together can each overshoot the
budget by their own answer (docs/budgets.md).
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from mitmproxy import http

from addon.core import capping
from addon.core.converse import EventStreamReader, bedrock_model
from addon.core.policy import Rule
from addon.core.prices import Prices
from addon.core.reasons import Reason
from addon.core.usage import Charge, Reader, Reading, UsageReader, charge
from addon.observe import audit
from addon.proxy.access import AccessRequests
from addon.proxy.failclosed import Denied
from addon.proxy.live import LivePolicy
from addon.proxy.state import Record, record
from store.errors import CredproxyError
from store.rules import aws, budgets
from store.rules.budgets import Budget, TokenLimit


@dataclass(slots=True)
class Meter:
    """One forwarded request under a budget, until its answer is charged."""

    grant_id: int
    budget: Budget
    reader: Reader | None = None  # None: the answer is not read (a coding left on it)
    model: str | None = None  # named by the request (Bedrock's modelId), if the answer does not
    # The answer is a success: the model named by the request ran. Else its name is only what
    # the agent wrote, and never a label (metrics) or a price.
    succeeded: bool = False


EVENT_STREAM = "application/vnd.amazon.eventstream"  # Bedrock's ConverseStream


Where = tuple[str, int, str, str]  # host, port, method, path


@dataclass(frozen=True, slots=True)
class Spent:
    """A grant's budget found spent: which limits, and until when."""

    limits: str  # `total=200000/day, output=20000/hour`
    until: datetime

    def refusal(self, why: str = "", extra: dict[str, object] | None = None) -> Denied:
        """429 budget-exhausted, with Retry-After at the end of the latest spent window."""
        resets = self.until.isoformat().replace("+00:00", "Z")
        seconds = max(1, math.ceil((self.until - datetime.now(UTC)).total_seconds()))
        return Denied(
            Reason.BUDGET_EXHAUSTED,
            f"this grant's token budget ({self.limits}) is spent until {resets}{why}",
            {"retry_after": seconds, "resets_at": resets} | (extra or {}),
        )


METERS: weakref.WeakKeyDictionary[http.HTTPFlow, Meter] = weakref.WeakKeyDictionary()
Stream = Callable[[bytes], Iterable[bytes] | bytes]
OFF_LOOP = 16 * 1024  # bytes of a body capped in a thread rather than on the event loop


class Budgets:
    def __init__(
        self,
        live: LivePolicy,
        prices: Prices | None = None,
        requests: AccessRequests | None = None,
    ) -> None:
        self.live = live
        self.prices = prices  # `run --prices`: what spend limits are charged by
        self.requests = requests  # where a spent budget is recorded as a budget request
        self._log = audit.logger()

    async def check(
        self, rule: Rule, principal: str | None = None, where: Where | None = None
    ) -> list[tuple[TokenLimit, int]]:
        """Refuse unless every limit of the grant's budget has tokens left in its window; each
        limit with what it has left. A refusal records a budget request (`where`: the refused
        request's host, port, method and path) for an owner to raise the budget.

        Raises: Denied (budget-exhausted, or store-unavailable: never forwarded unchecked).
        """
        left, over = await self._left(rule)
        if over is None:
            return left
        extra: dict[str, object] | None = None
        if self.requests is not None and principal is not None and where is not None:
            asked = await self.requests.on_budget(principal, rule.grant_id, where, over.limits)
            if asked is not None:
                extra = {"access_request": asked}
        raise over.refusal(extra=extra)

    async def spent(self, rule: Rule) -> Spent | None:
        """What of the grant's budget is spent now; None while every limit has tokens left.

        Raises: Denied (no price table for a spend limit, or store-unavailable).
        """
        return (await self._left(rule))[1]

    async def _left(self, rule: Rule) -> tuple[list[tuple[TokenLimit, int]], Spent | None]:
        """Each limit of the grant's budget with what it has left, and what of it is spent."""
        budget = rule.budget
        assert budget is not None
        if self.prices is None and any(limit.kind == "spend" for limit in budget.limits):
            raise Denied(
                Reason.BUDGET_EXHAUSTED,
                "this grant has a spend limit, and this proxy no price table (run --prices)",
            )
        now = datetime.now(UTC)
        keys = {w: budgets.window_key(w, now) for w in budget.windows()}
        if not self.live.store_up:
            raise Denied(Reason.STORE_UNAVAILABLE, "token budgets need the store")
        try:
            used = await self.live.budget_used(rule.grant_id, list(keys.values()))
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "the store did not answer") from e
        left = [
            (limit, limit.tokens - used[keys[limit.window]].of(limit.kind))
            for limit in budget.limits
        ]
        spent = [limit for limit, n in left if n <= 0]
        if not spent:
            return left, None
        end = max(budgets.window_end(limit.window, now) for limit in spent)
        return left, Spent(", ".join(map(str, spent)), end)

    async def cap(
        self, flow: http.HTTPFlow, rec: Record, path: str, left: list[tuple[TokenLimit, int]]
    ) -> None:
        """Cap the held body's output limit to what `left` leaves (grant --cap-max-tokens).

        Raises: Denied (body-undecidable for a body that cannot be capped, budget-exhausted
        when too little is left: never forwarded uncapped).
        """
        request = flow.request
        body = request.raw_content
        if body is None:
            raise Denied(Reason.BODY_UNDECIDABLE, "this grant caps max_tokens: its body is held")
        if not body:
            return  # asks for no answer of a model (GET /v1/models)
        codings = [c.strip().lower() for c in request.headers.get_all("content-encoding")]
        if any(c not in ("", "identity") for c in codings):
            raise Denied(Reason.BODY_UNDECIDABLE, "a compressed body cannot be capped")
        try:
            if len(body) > OFF_LOOP:
                # Milliseconds of parsing for a long conversation: not on the event loop.
                capped = await asyncio.to_thread(capping.cap, path, body, left)
            else:
                capped = capping.cap(path, body, left)
        except capping.Uncappable as e:
            raise Denied(e.reason, e.detail) from e
        except capping.Exhausted as e:
            said = "leaves no output tokens for this request's answer"
            raise exhausted([e.limit], said, datetime.now(UTC)) from e
        request.raw_content = capped.body
        # Whole now: sent with its length, not in the chunks it came in.
        request.headers.pop("transfer-encoding", None)
        request.headers["content-length"] = str(len(capped.body))
        rec.bytes_out = len(capped.body)
        rec.max_tokens = capped.max_tokens

    def watch(self, flow: http.HTTPFlow, rule: Rule, host: str, path: str) -> None:
        """The request went (to `host`, `path` as matched): its answer is read and charged."""
        assert rule.budget is not None
        METERS[flow] = Meter(rule.grant_id, rule.budget, model=_path_model(rule, host, path))

    # -- hooks -------------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        meter = METERS.get(flow)
        response = flow.response
        if meter is None or response is None:
            return
        try:
            meter.succeeded = 200 <= response.status_code < 300
            coding = response.headers.get("content-encoding", "").strip().lower()
            if coding not in ("", "identity"):
                return  # not decoded for redaction: read nothing, charge the estimate
            kind = response.headers.get("content-type", "").lower()
            if EVENT_STREAM in kind:
                meter.reader = EventStreamReader()
            else:
                meter.reader = UsageReader("text/event-stream" in kind)
            inner = response.stream
            if callable(inner):
                response.stream = _observed(inner, meter)
        except Exception as e:  # noqa: BLE001 - fail closed: the answer is not passed unread
            self._log.error("hook.failed", hook="responseheaders", error_type=type(e).__name__)
            flow.kill()

    def response(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        meter = METERS.pop(flow, None)
        rec = record(flow)
        if meter is None or rec is None:
            return None
        try:
            if meter.reader is not None and rec.buffered and flow.response is not None:
                meter.reader.feed(flow.response.raw_content or b"")
            return self._charge(meter, rec)
        except Exception as e:  # noqa: BLE001 - fail closed: the flow dies, the estimate is charged
            self._log.error("hook.failed", hook="response", error_type=type(e).__name__)
            flow.kill()
            meter.reader = None
            return self._charge(meter, rec)

    def error(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """A cut stream, a failed upstream: whatever usage was read, the rest estimated."""
        meter = METERS.pop(flow, None)
        rec = record(flow)
        if meter is None or rec is None:
            return None
        try:
            return self._charge(meter, rec, complete=False)
        except Exception as e:  # noqa: BLE001 - the audit line after this one is still written
            self._log.error("hook.failed", hook="error", error_type=type(e).__name__)
            return None

    def _charge(self, meter: Meter, rec: Record, complete: bool = True) -> Awaitable[None]:
        reader = meter.reader
        reading = reader.finish() if reader is not None else Reading()
        if meter.succeeded:
            reading.model = reading.model or meter.model
        answered = reader.size if reader is not None else rec.bytes_in
        cost = charge(reading, rec.bytes_out, answered, complete and rec.failure is None)
        rec.model = cost.model
        rec.input_tokens, rec.output_tokens = cost.input_tokens, cost.output_tokens
        rec.tokens_estimated = cost.estimated
        spend = 0
        if self.prices is not None:
            spend = self.prices.of(cost.model).micros(cost.input_tokens, cost.output_tokens)
            rec.cost_micros = spend
        windows = [budgets.window_key(w, datetime.now(UTC)) for w in meter.budget.windows()]
        return self._store(meter.grant_id, windows, cost, spend)

    async def _store(self, grant_id: int, windows: list[str], cost: Charge, spend: int) -> None:
        try:
            await self.live.charge_budget(grant_id, windows, cost, spend)
        except CredproxyError as e:
            # The answer went; what it cost is in its audit line. Logged to be reconciled.
            self._log.error(
                "budget.charge_failed",
                grant_id=grant_id,
                input_tokens=cost.input_tokens,
                output_tokens=cost.output_tokens,
                error_type=type(e).__name__,
            )


def _path_model(rule: Rule, host: str, path: str) -> str | None:
    """Bedrock's modelId in the path, for a request signed for Bedrock: what it runs. Elsewhere
    the path is the agent's to write, and names nothing."""
    credential = rule.credential
    options = credential.options if credential is not None and credential.scheme == "sigv4" else {}
    scope = aws.scope_of(host, options.get("service"), options.get("region"))
    if scope is None or scope.service != "bedrock":
        return None
    return bedrock_model(path)


def exhausted(limits: list[TokenLimit], said: str, now: datetime) -> Denied:
    """budget-exhausted, with Retry-After at the end of the latest of the limits' windows."""
    end = max(budgets.window_end(limit.window, now) for limit in limits)
    resets = end.isoformat().replace("+00:00", "Z")
    return Denied(
        Reason.BUDGET_EXHAUSTED,
        f"this grant's token budget ({', '.join(map(str, limits))}) {said} until {resets}",
        {"retry_after": max(1, math.ceil((end - now).total_seconds())), "resets_at": resets},
    )


def _observed(inner: Stream, meter: Meter) -> Stream:
    """The stream as Responses set it (decoded, redacted), with the reader fed on the side."""

    def stream(chunk: bytes) -> Iterable[bytes] | bytes:
        out = inner(chunk)
        if not isinstance(out, bytes):
            out = list(out)  # read once here, once by mitmproxy
        reader = meter.reader
        if reader is not None:
            try:
                reader.feed(out if isinstance(out, bytes) else b"".join(out))
            except Exception as e:  # noqa: BLE001 - counting never stops the stream
                audit.logger().error(
                    "hook.failed", hook="budget_stream", error_type=type(e).__name__
                )
                meter.reader = None  # the estimate is charged instead
        return out

    return stream
