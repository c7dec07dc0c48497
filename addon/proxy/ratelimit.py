"""Token buckets for grant and principal rates, per replica, with no store round trip.

A bucket holds up to `burst` tokens (default: the rate's count) and refills at the rate.
A request takes one token from each bucket that applies, or from none: a request refused by
one limit never spends another's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from addon.core.policy import Rule
from addon.core.reasons import Reason
from addon.proxy.failclosed import Denied
from store.errors import CredproxyError
from store.rules.grammar import Rate
from store.tables.rates import Bucket

if TYPE_CHECKING:
    from addon.proxy.live import LivePolicy

# Buckets kept at most; past it the oldest is dropped (it starts again full). Keys are grant
# ids and principal names, so this bounds only what the store itself bounds.
MAX_BUCKETS = 65_536


class Limit(NamedTuple):
    key: Hashable
    rate: Rate
    burst: int | None
    what: str  # how the audit line names it: "rate 60/m of grant 7"


class Buckets:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, limits: Sequence[Limit], *, take: bool = True) -> tuple[Limit, float] | None:
        """Take a token from every bucket, or from none: the first limit that refuses, and
        the seconds until it would admit a request. `take=False` only looks."""
        now = self._clock()
        levels = []
        for limit in limits:
            capacity = float(limit.burst or limit.rate.count)
            key = (limit.key, limit.rate, capacity)  # a changed rate starts a new bucket
            tokens, at = self._state.get(key, (capacity, now))
            tokens = min(capacity, tokens + (now - at) * limit.rate.per_second)
            if tokens < 1.0:
                return limit, (1.0 - tokens) / limit.rate.per_second
            levels.append((key, tokens))
        if not take:
            return None
        for key, tokens in levels:
            self._state.pop(key, None)
            if len(self._state) >= MAX_BUCKETS:
                del self._state[next(iter(self._state))]
            self._state[key] = (tokens - 1.0, now)
        return None


class Limiter:
    """The proxy's buckets; a refused request raises Denied(rate-limited) with Retry-After."""

    shared = False  # True: the buckets are in the store, taken with `await take(...)`

    def __init__(self, buckets: Buckets | None = None) -> None:
        self.buckets = buckets or Buckets()

    async def take(self, limits: Sequence[Limit]) -> None:
        self.check(limits)

    def check(self, limits: Sequence[Limit], *, take: bool = True) -> None:
        refused = self.buckets.take(limits, take=take)
        if refused is not None:
            limit, wait = refused
            raise Denied(
                Reason.RATE_LIMITED,
                f"over the {limit.what}",
                {"retry_after": max(1, math.ceil(wait))},
            )


class SharedLimiter(Limiter):
    """`run --shared-rates`: buckets in the store, exact across replicas, one store round trip
    per request. Only requests a grant allows are counted (the forwarder takes their tokens);
    the gate's early look at a principal's rate finds nothing to refuse."""

    shared = True

    def __init__(self, live: LivePolicy) -> None:
        super().__init__()
        self.live = live

    def check(self, limits: Sequence[Limit], *, take: bool = True) -> None:
        return None

    async def take(self, limits: Sequence[Limit]) -> None:
        buckets = [
            Bucket(
                _stored_key(limit), limit.rate.per_second, float(limit.burst or limit.rate.count)
            )
            for limit in limits
        ]
        try:
            refused = await self.live.call(self.live.store.take_rates, buckets, time.time())
        except CredproxyError as e:
            raise Denied(Reason.STORE_UNAVAILABLE, "shared rates need the store") from e
        if refused is not None:
            index, wait = refused
            raise Denied(
                Reason.RATE_LIMITED,
                f"over the {limits[index].what}",
                {"retry_after": max(1, math.ceil(wait))},
            )


def _stored_key(limit: Limit) -> str:
    assert isinstance(limit.key, tuple)  # ("grant", id) or ("principal", name)
    kind, name = limit.key
    return f"{kind}:{name}:{limit.rate.text}:{limit.burst or limit.rate.count}"


def principal_limit(principal: str, rate: Rate, burst: int | None) -> Limit:
    return Limit(
        ("principal", principal), rate, burst, f"rate {rate.text} of principal {principal}"
    )


def grant_limit(rule: Rule) -> Limit | None:
    if rule.rate is None:
        return None
    return Limit(
        ("grant", rule.grant_id),
        rule.rate,
        rule.burst,
        f"rate {rule.rate.text} of grant {rule.grant_id}",
    )
