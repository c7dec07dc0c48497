"""Token budgets of grants: checked in the store before a request leaves, charged after its answer.

Forward calls `check` as one of its last steps (a budget already spent in any window answers
429 budget-exhausted with Retry-After at that window's end) and `watch` as it forwards. The
answer then passes to the agent as it streams: `responseheaders` puts a UsageReader beside the
stream (addon/core/usage.py, bounded), and `response` or `error` charges what it read, or the
estimate, to every window of the budget in one store transaction before the audit line is
written. A request is checked against what was charged before it: requests in flight together
can each overshoot the budget by their own answer (docs/budgets.md).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from mitmproxy import http

from addon.core.policy import Rule
from addon.core.prices import Prices
from addon.core.reasons import Reason
from addon.core.usage import Charge, Reading, UsageReader, charge
from addon.observe import audit
from addon.proxy.access import AccessRequests
from addon.proxy.failclosed import Denied
from addon.proxy.live import LivePolicy
from addon.proxy.state import Record, record
from store.errors import CredproxyError
from store.rules import budgets
from store.rules.budgets import Budget


@dataclass(slots=True)
class Meter:
    """One forwarded request under a budget, until its answer is charged."""

    grant_id: int
    budget: Budget
    reader: UsageReader | None = None  # None: the answer is not read (a coding left on it)


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
    ) -> None:
        """Refuse unless every limit of the grant's budget has tokens left in its window; a
        refusal records a budget request (`where`: the refused request's host, port, method
        and path) for an owner to raise the budget.

        Raises: Denied (budget-exhausted, or store-unavailable: never forwarded unchecked).
        """
        over = await self.spent(rule)
        if over is None:
            return
        extra = None
        if self.requests is not None and principal is not None and where is not None:
            asked = await self.requests.on_budget(principal, rule.grant_id, where, over.limits)
            if asked is not None:
                extra = {"access_request": asked}
        raise over.refusal(extra=extra)

    async def spent(self, rule: Rule) -> Spent | None:
        """What of the grant's budget is spent now; None while every limit has tokens left.

        Raises: Denied (no price table for a spend limit, or store-unavailable).
        """
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
        spent = [
            limit
            for limit in budget.limits
            if used[keys[limit.window]].of(limit.kind) >= limit.tokens
        ]
        if not spent:
            return None
        end = max(budgets.window_end(limit.window, now) for limit in spent)
        return Spent(", ".join(map(str, spent)), end)

    def watch(self, flow: http.HTTPFlow, rule: Rule) -> None:
        """The request went: its answer is read and charged."""
        assert rule.budget is not None
        METERS[flow] = Meter(rule.grant_id, rule.budget)

    # -- hooks -------------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        meter = METERS.get(flow)
        response = flow.response
        if meter is None or response is None:
            return
        try:
            coding = response.headers.get("content-encoding", "").strip().lower()
            if coding not in ("", "identity"):
                return  # not decoded for redaction: read nothing, charge the estimate
            sse = "text/event-stream" in response.headers.get("content-type", "").lower()
            meter.reader = UsageReader(sse)
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
